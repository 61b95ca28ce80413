"""Errors name the user's paths: a --data folder that does not exist is called a missing data folder (with the
command that makes one), and a trainable token finetune cannot find names the base's tokenizer, not the staging
folder finetune builds it in."""
from __future__ import annotations

from finetune_runs import finetune_argv

from archlab.cli import main


def test_a_missing_data_folder_is_named_as_one(tmp_path, capsys):
    missing = tmp_path / "shakespeare"
    assert main(["train", "--preset", "tiny:llama3-8b", "--data", str(missing), "--out", str(tmp_path / "run"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{missing}: no such data folder; make one with `archlab data prepare" in err
    assert not (tmp_path / "run").exists()


def test_an_unknown_trainable_token_names_the_bases_tokenizer(chat_world, make_base, tmp_path, capsys):
    base = make_base(tmp_path / "base")
    assert main(finetune_argv(base, chat_world["data"], tmp_path / "run", "--lora-r", "2",
                              "--lora-trainable-tokens", "<|nope|>")) == 2
    err = capsys.readouterr().err
    assert f"'<|nope|>' is not a token of the tokenizer in {base / 'tokenizer'} (give" in err, err
    assert "archlab-finetune-" not in err and not (tmp_path / "run").exists()


def test_finetune_data_that_is_a_folder_or_missing_says_which(chat_world, make_base, tmp_path, capsys):
    base = make_base(tmp_path / "base")
    (tmp_path / "prepared").mkdir()
    for data, said in ((tmp_path / "prepared", " is a folder: chat data is a .jsonl file"),
                       (tmp_path / "gone.jsonl", ": no such file (chat data is a .jsonl file")):
        assert main(finetune_argv(base, data, tmp_path / "run")) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--data {data}{said}" in err, err


def test_a_tokenizer_without_end_of_text_is_named_as_the_user_gave_it(tmp_path):
    """The data folder is written with the staged copy of the base's tokenizer; its error names the base's."""
    import pytest

    from archlab.errors import UserError
    from archlab.tokenizer import Tokenizer
    from archlab.training.methods.sft import _write_data

    staged = Tokenizer({i: bytes([i]) for i in range(256)}, [], []).save(tmp_path / "archlab-finetune-x" / "tok")
    with pytest.raises(UserError) as caught:
        _write_data(tmp_path / "out" / "data", "decoder", {"train": [], "val": []}, staged, {},
                    shown_as="runs/base/tokenizer")
    assert str(caught.value) == ("the tokenizer of runs/base/tokenizer has no end-of-text token to pad and end "
                                 "examples with")
    assert not (tmp_path / "out").exists()
