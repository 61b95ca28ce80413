"""`archlab generate` on a run folder built here (config.yaml, checkpoints/, tokenizer/)."""
import pytest
from variants import BASE

import archlab
from archlab.cli import main
from archlab.runs.checkpoint import save_checkpoint
from archlab.runs.model_folder import write_run_config
from archlab.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    cfg = BASE.with_overrides({"vocab_size": 257, "init.std": 0.2, "max_seq_len": 48})
    model = archlab.TransformerLM(cfg).eval()
    write_run_config(root, cfg.to_dict(), {}, {})
    save_checkpoint(root / "checkpoints", 5, model.state_dict(), {})
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    tok.save(root / "tokenizer")
    return root, model, tok


def test_cli_streams_the_greedy_continuation(run_dir, capsys):
    root, model, tok = run_dir
    prompt = "hello"
    expected = archlab.generate(model, tok.encode(prompt), max_new_tokens=12,
                                eos_token_id=tok.eot_id)[len(prompt):].tolist()
    if tok.eot_id in expected:
        expected = expected[:expected.index(tok.eot_id)]
    assert main(["generate", str(root), "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert out == prompt + tok.decode(expected) + "\n"
    assert main(["generate", str(root), "--prompt", prompt, "--max-new-tokens", "12", "--no-stream"]) == 0
    assert capsys.readouterr().out == out


def test_cli_seeded_sampling_is_reproducible(run_dir, capsys):
    root, _, _ = run_dir
    args = ["generate", str(root), "--prompt", "ab", "--max-new-tokens", "10", "--temperature", "1",
            "--top-k", "50", "--seed", "3"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first


def test_cli_prompt_longer_than_context_is_a_clear_error(run_dir, capsys):
    root, _, _ = run_dir
    assert main(["generate", str(root), "--prompt", "x" * 60, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "longer than the model's context max_seq_len=48" in err and "(--sink-window N, --sink-tokens 4)" in err
    assert main(["generate", str(root), "--prompt", "x" * 40, "--max-new-tokens", "20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]        # named as the command's flags, not Python's
    assert "prompt (40 tokens) + --max-new-tokens 20 exceeds" in err and "lower --max-new-tokens" in err, err
    assert main(["generate", str(root), "--prompt", "x" * 60, "--max-new-tokens", "4",
                 "--sink-window", "20"]) == 0


def test_cli_rejects_a_folder_that_is_not_a_model(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "neither a run folder" in err and err.count("\n") == 1


@pytest.mark.parametrize("flag,value,message", [
    ("--temperature", "nan", "--temperature nan must be a finite number >= 0"),
    ("--num-beams", "0", "--num-beams 0 must be at least 1"),
    ("--top-p", "1.5", "--top-p 1.5 must be in (0, 1]"),
    ("--device", "tpu", "--device tpu"),
    ("--sink-window", "256", "must fit the model's context max_seq_len=48: use --sink-window 44"),
])
def test_cli_bad_arguments_are_one_line_and_print_no_prompt(run_dir, capsys, flag, value, message):
    root = run_dir[0] if isinstance(run_dir, tuple) else run_dir
    assert main(["generate", str(root), "--prompt", "ROMEO:", flag, value]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and "ROMEO" not in captured.out


@pytest.mark.parametrize("extra", [[], ["--temperature", "1.5", "--seed", "3"], ["--num-beams", "2"]])
def test_cli_on_a_model_padded_past_its_tokenizer_prints_only_decodable_text(tmp_path, capsys, extra):
    """The embedding has 300 rows for a 257-id tokenizer and the padding rows would win every pick:
    the CLI decodes inside the tokenizer's vocabulary (no TokenIdError, text of 12 bytes at most)."""
    import torch
    cfg = BASE.with_overrides({"vocab_size": 300, "bias.head": True, "max_seq_len": 48})
    model = archlab.TransformerLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.bias[257:] = 50.0
    write_run_config(tmp_path, cfg.to_dict(), {}, {})
    save_checkpoint(tmp_path / "checkpoints", 5, model.state_dict(), {})
    Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(tmp_path / "tokenizer")
    assert main(["generate", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "12", *extra]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hi") and len(out.encode()) <= len("hi") + 12 * 3 + 1


def _run_folder(root, **generation_config):
    import json
    cfg = BASE.with_overrides({"vocab_size": 257, "init.std": 0.2, "max_seq_len": 48})
    model = archlab.TransformerLM(cfg).eval()
    write_run_config(root, cfg.to_dict(), {}, {})
    save_checkpoint(root / "checkpoints", 5, model.state_dict(), {})
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    tok.save(root / "tokenizer")
    (root / "generation_config.json").write_text(json.dumps(generation_config))
    return model, tok


@pytest.mark.parametrize("beams", [1, 3])
def test_cli_applies_the_folders_generation_config_and_flags_override_it(tmp_path, capsys, beams):
    from archlab.generation import read_generation_config
    prompt = "hello"
    model, tok = _run_folder(tmp_path)
    free = archlab.generate(model, tok.encode(prompt), max_new_tokens=12, num_beams=beams)[len(prompt):].tolist()
    bad = [[free[2]], free[5:7]]
    model, tok = _run_folder(tmp_path, no_repeat_ngram_size=2, bad_words_ids=bad, max_new_tokens=12, num_beams=beams,
                             transformers_version="5.24.0")
    cfg = read_generation_config(tmp_path).merged(eos_token_id=tok.eot_id)
    expected = archlab.generate(model, tok.encode(prompt), generation_config=cfg)[len(prompt):].tolist()
    assert expected != free[:len(expected)] and free[2] not in expected
    if tok.eot_id in expected:
        expected = expected[:expected.index(tok.eot_id)]
    assert main(["generate", str(tmp_path), "--prompt", prompt]) == 0
    captured = capsys.readouterr()
    assert captured.out == prompt + tok.decode(expected) + "\n" and captured.err == ""
    assert main(["generate", str(tmp_path), "--prompt", prompt, "--max-new-tokens", "3", "--num-beams", "1",
                 "--no-repeat-ngram-size", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt) and len(out.encode()) <= len(prompt) + 3 * 4 + 1


def test_cli_names_generation_config_fields_it_does_not_apply(tmp_path, capsys):
    _run_folder(tmp_path, suppress_tokens=[1, 2], max_new_tokens=4, do_sample=True, temperature=0.7)
    with pytest.warns(UserWarning) as caught:
        assert main(["generate", str(tmp_path), "--prompt", "hi", "--seed", "0"]) == 0
    messages = [str(w.message) for w in caught]
    assert any("not applied by archlab" in m and "suppress_tokens=[1, 2]" in m for m in messages)
    assert any("sampling as the folder's generation_config.json asks (temperature 0.7, top_k 50)" in m
               for m in messages)


def test_cli_help_says_the_generation_config_applies(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "generation_config.json" in capsys.readouterr().out
