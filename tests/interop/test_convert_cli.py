"""`archlab convert` (HF <-> run folder) and `archlab verify` end to end on a tiny random model."""
import json

import pytest
import torch

from archlab.cli import main

transformers = pytest.importorskip("transformers")


@pytest.fixture
def hf_folder(tmp_path, tiny_kwargs):
    """A tiny Qwen2 (vocab 256) with a byte-level tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**tiny_kwargs(vocab_size=256))).eval()
    folder = tmp_path / "hf"
    model.save_pretrained(folder, safe_serialization=True)
    # a byte-level BPE (the kind archlab.tokenizer reads): 256 byte symbols, no merges
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(tokenizers.models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    return folder, model


def test_non_byte_level_tokenizer_is_copied_to_tokenizer(tmp_path, hf_folder):
    """A tokenizer.json archlab's own readers refuse (WordLevel) still becomes tokenizer/: load_run reads
    it through the `tokenizers` library, with the same ids."""
    import tokenizers

    from archlab.runs.model_folder import load_run

    folder, _ = hf_folder
    word = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    word.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    word.save(str(folder / "tokenizer.json"))
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(folder), "--out", str(run)]) == 0
    assert (run / "tokenizer" / "tokenizer.json").is_file() and not (run / "tokenizer_hf").exists()
    model, tok = load_run(run)
    assert type(tok).__name__ == "HFTokenizer" and model.config.vocab_size == 256
    assert tok.encode("a b c a") == word.encode("a b c a").ids == [0, 1, 2, 0]


def test_unreadable_tokenizer_goes_aside(tmp_path, hf_folder, capsys, monkeypatch):
    """Without `tokenizers`, a tokenizer archlab cannot read is kept in tokenizer_hf/, so the run folder
    still loads."""
    import sys

    import tokenizers

    from archlab.runs.model_folder import load_run

    folder, _ = hf_folder
    word = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    word.save(str(folder / "tokenizer.json"))
    monkeypatch.setitem(sys.modules, "tokenizers", None)   # `import tokenizers` now raises ImportError
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(folder), "--out", str(run)]) == 0
    assert (run / "tokenizer_hf" / "tokenizer.json").is_file() and not (run / "tokenizer").exists()
    assert "cannot read" in capsys.readouterr().err
    model, tok = load_run(run)
    assert tok is None and model.config.vocab_size == 256


def test_convert_round_trip_and_verify(tmp_path, hf_folder, capsys):
    from archlab.runs.model_folder import load_run

    folder, hf_model = hf_folder
    run = tmp_path / "run"
    assert main(["convert", "--from-hf", str(folder), "--out", str(run)]) == 0
    assert (run / "config.yaml").is_file() and (run / "tokenizer" / "tokenizer.json").is_file()
    ours, _ = load_run(run)
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = hf_model(ids).logits
        assert torch.allclose(ours(ids), ref, atol=1e-5)

    back = tmp_path / "back"
    assert main(["convert", "--to-hf", str(run), "--out", str(back)]) == 0
    assert json.loads((back / "config.json").read_text())["model_type"] == "qwen2"
    assert (back / "tokenizer.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, ref, atol=1e-5)

    capsys.readouterr()
    assert main(["verify", str(back)]) == 0
    out = capsys.readouterr().out
    assert "max rel logit diff" in out and "mean KL" in out and "OK" in out


def test_verify_fails_on_a_mismatch(hf_folder, monkeypatch, capsys):
    """A perturbed archlab model must be caught (exit 1): verify really compares."""
    import archlab.interop.hf as hf

    folder, _ = hf_folder
    real = hf.load_hf

    def perturbed(*args, **kw):
        model = real(*args, **kw)
        with torch.no_grad():
            model.blocks[0].attn.q_proj.weight.mul_(1.5)
        return model

    monkeypatch.setattr(hf, "load_hf", perturbed)
    assert main(["verify", str(folder)]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_convert_reports_bad_input(tmp_path, capsys):
    assert main(["convert", "--from-hf", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "no config.json" in capsys.readouterr().err
