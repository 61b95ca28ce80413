"""`archlab generate --draft`: the text of plain greedy decoding with every draft, the figures on stderr, and one
line with exit status 2 for each bad combination (before anything is decoded)."""
import pytest
from variants import BASE

import archlab
from archlab.cli import main
from archlab.runs.checkpoint import save_checkpoint
from archlab.runs.model_folder import write_run_config
from archlab.tokenizer import Tokenizer

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"


def _run(root, cfg, tok):
    model = archlab.TransformerLM(cfg).eval()
    write_run_config(root, cfg.to_dict(), {}, {})
    save_checkpoint(root / "checkpoints", 5, model.state_dict(), {})
    tok.save(root / "tokenizer")
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cfg = BASE.with_overrides({"vocab_size": 257, "init.std": 0.2, "max_seq_len": 96})
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    target = tmp_path_factory.mktemp("target")
    _run(target, cfg, tok)
    draft = tmp_path_factory.mktemp("draft")
    _run(draft, cfg.with_overrides({"seed": 3, "n_layers": 1}), tok)
    other = tmp_path_factory.mktemp("other")      # another tokenizer (its byte order reversed): refused
    _run(other, cfg, Tokenizer({i: bytes([255 - i]) for i in range(256)}, [], ["<|endoftext|>"]))
    return target, draft, other


@pytest.mark.parametrize("draft", ["prompt-lookup", "ngram", "ngram:2", "RUN"])
def test_draft_prints_plain_greedy_text_and_its_figures(runs, capsys, draft):
    target, draft_run, _ = runs
    base = ["generate", str(target), "--prompt", PROMPT, "--max-new-tokens", "20"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    name = str(draft_run) if draft == "RUN" else draft
    assert main(base + ["--draft", name, "--draft-tokens", "3", "--compare-plain"]) == 0
    out = capsys.readouterr()
    assert out.out == plain
    assert "acceptance rate" in out.err and "tokens per target forward" in out.err and "theory" in out.err
    assert "output identical: yes" in out.err


@pytest.mark.parametrize("extra, message", [
    (["--draft", "prompt-lookup", "--draft-tokens", "0"], "--draft-tokens 0 must be at least 1"),
    (["--draft", "prompt-lookup", "--draft-tokens", "-3"], "--draft-tokens -3 must be at least 1"),
    (["--draft", "prompt-lookup", "--draft-tokens", "many"], "must be a whole number"),
    (["--draft", "prompt-lookup", "--num-beams", "2"], "beam search"),
    (["--draft", "ngram:0"], "ORDER must be in"),
    (["--draft-tokens", "3"], "needs --draft"),
    (["--draft", "prompt-lookup", "--draft-tokens", "96"], "--draft-tokens 96 is longer than the model's context"),
    (["--draft", "RUN", "--max-new-tokens", "200"], "+ --max-new-tokens 200"),      # the flags, not Python's names
    (["--draft", "OTHER"], "tokenizer differs"),
    (["--draft", "no-such-run"], "--draft no-such-run is neither a run folder"),      # named as the draft
    (["--draft", "prompt-lookup", "--sink-window", "16"], "StreamingLLM"),
])
def test_bad_draft_arguments_are_one_line_exit_2(runs, capsys, extra, message):
    target, draft, other = runs
    extra = [{"OTHER": str(other), "RUN": str(draft)}.get(a, a) for a in extra]
    assert main(["generate", str(target), "--prompt", "ab", "--max-new-tokens", "4", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)
    assert not any(f"{name}=" in err[-1] for name in ("draft_tokens", "max_new_tokens", "sink_window")), err


def test_draft_data_prepared_with_another_tokenizer_is_refused(runs, tmp_path, capsys):
    """Ids below the vocabulary size pass the range check, but another tokenizer's ids stand for other tokens."""
    target, _, other = runs
    (tmp_path / "corpus.txt").write_text(PROMPT * 20)
    for name, tok in (("own", target), ("theirs", other)):
        assert main(["data", "prepare", "--corpus", str(tmp_path / "corpus.txt"), "--tokenizer",
                     str(tok / "tokenizer"), "--out", str(tmp_path / name), "--workers", "0", "--quiet"]) == 0
    base = ["generate", str(target), "--prompt", PROMPT, "--max-new-tokens", "4", "--draft", "ngram"]
    assert main([*base, "--draft-data", str(tmp_path / "own")]) == 0
    capsys.readouterr()
    assert main([*base, "--draft-data", str(tmp_path / "theirs")]) == 2
    err = capsys.readouterr().err.strip()
    assert "was prepared with another tokenizer" in err and len(err.splitlines()) == 1, err


@pytest.fixture(scope="module")
def int8_run(runs, tmp_path_factory):
    """The target's int8 copy, written by archlab quantize."""
    root = tmp_path_factory.mktemp("int8")
    (root / "text.txt").write_text(PROMPT * 4)
    assert main(["quantize", str(runs[0]), "--weights", "int8", "--out", str(root / "run"),
                 "--text", str(root / "text.txt"), "--seq-len", "32"]) == 0
    return root / "run"


def test_the_int8_copy_of_the_target_drafts_its_plain_greedy_text(runs, int8_run, capsys):
    target = runs[0]
    base = ["generate", str(target), "--prompt", PROMPT, "--max-new-tokens", "24"]
    capsys.readouterr()
    assert main(base) == 0
    plain = capsys.readouterr().out
    for k in ("2", "auto"):
        assert main(base + ["--draft", str(int8_run), "--draft-tokens", k, "--compare-plain"]) == 0
        out = capsys.readouterr()
        assert out.out == plain and "output identical: yes" in out.err, out.err


def test_an_int8_target_is_refused_before_the_prompt_is_printed(runs, int8_run, capsys):
    from archlab.nn.int8 import KERNELS, decode_kernel
    if not KERNELS.get(decode_kernel()).rows_together:
        pytest.skip("this torch's int8 decode kernel keeps rows apart: speculative decoding stays exact")
    target, draft_run, _ = runs
    capsys.readouterr()
    for draft in ("prompt-lookup", str(draft_run)):
        assert main(["generate", str(int8_run), "--prompt", PROMPT, "--max-new-tokens", "4",
                     "--draft", draft]) == 2
        out = capsys.readouterr()
        assert out.out == "" and len(out.err.strip().splitlines()) == 1, out
        assert "int8 layers quantize the activations" in out.err and "draft for the float run" in out.err


@pytest.mark.parametrize("what", ["text file", "missing", "folder"])
def test_a_draft_data_that_is_not_prepared_data_is_named_as_draft_data(runs, tmp_path, capsys, what):
    target, _, _ = runs
    path = {"text file": tmp_path / "corpus.txt", "missing": tmp_path / "nope", "folder": tmp_path}[what]
    (tmp_path / "corpus.txt").write_text(PROMPT)
    assert main(["generate", str(target), "--prompt", PROMPT, "--max-new-tokens", "4", "--draft", "ngram",
                 "--draft-data", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"error: --draft-data {path}" in err, err
