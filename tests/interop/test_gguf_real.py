"""GGUF in, on the two real pretrained models the `models` extra installs, against transformers' own GGUF loader
(`from_pretrained(dir, gguf_file=name)`): the same logits (rel. err < 1e-3), the same greedy tokens, the same chat
template ids; and the converted run folder works with `archlab generate` and `archlab chat`.

Slow (CI runs them): transformers' loader takes ~20 s (SmolLM2) and ~60 s (Gemma 3) on 2 cores."""
from __future__ import annotations

import time

import pytest
import torch

from archlab.cli import main

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of Germany is"


def _model_path(name):
    from archlab.errors import UserError
    from archlab.interop.gguf import packaged_model
    try:
        return packaged_model(name)
    except UserError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (run folder converted once per module, seconds the conversion took)."""
    runs: dict = {}

    def get(name):
        if name not in runs:
            run = tmp_path_factory.mktemp("gguf") / name
            start = time.perf_counter()
            assert main(["convert", "--from-gguf", str(_model_path(name)), "--out", str(run)]) == 0
            runs[name] = run, time.perf_counter() - start
        return runs[name]
    return get


def _reference(path):
    """transformers' model and tokenizer from the GGUF file, and the seconds its model loader took."""
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    seconds = time.perf_counter() - start
    return model, transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), seconds


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_converted_real_model_matches_transformers_gguf_loader(name, converted):
    import archlab
    from archlab.runs.model_folder import load_run
    from archlab.tokenizer.chat import apply_chat_template

    path = _model_path(name)
    run, convert_seconds = converted(name)
    ours, tok = load_run(run)
    theirs, their_tok, their_seconds = _reference(path)
    print(f"{name}: archlab convert {convert_seconds:.1f} s, transformers' GGUF loader {their_seconds:.1f} s")

    ids = torch.tensor([their_tok(PROMPT).input_ids])
    assert tok.encode(PROMPT, add_special_tokens=True) == ids[0].tolist()
    with torch.no_grad():
        a, b = ours(ids), theirs(ids, use_cache=False).logits
    assert float((a - b).abs().max() / b.abs().max()) < 1e-3
    with torch.no_grad():
        want = theirs.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    got = archlab.generate(ours, ids, max_new_tokens=12, temperature=0.0)[0, ids.shape[1]:].tolist()
    assert got[:len(want)] == want
    if their_tok.chat_template:
        chat = [{"role": "user", "content": "What is 2+2?"}]
        assert (apply_chat_template(run, chat, add_generation_prompt=True)
                == their_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))


def test_converted_smollm2_chats_and_generates(converted, tmp_path, capsys, monkeypatch):
    """The converted run is an ordinary run folder: `archlab generate` continues a prompt, `archlab chat` answers
    through the file's ChatML template, `archlab diagnose` reads it."""
    import io
    run, _ = converted("smollm2-135m-instruct")
    assert main(["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "3", "--no-stream"]) == 0
    assert "Berlin" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n"))
    assert main(["chat", str(run), "--max-new-tokens", "12"]) == 0
    assert "Paris" in capsys.readouterr().out
    (tmp_path / "text.txt").write_text(PROMPT + " Berlin. The capital of Italy is Rome.")
    assert main(["diagnose", str(run), "--text", str(tmp_path / "text.txt"), "--out", str(tmp_path / "diag")]) == 0
    assert any((tmp_path / "diag").iterdir())
