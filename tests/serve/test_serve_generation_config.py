"""archlab serve applies the model folder's generation_config.json: its EOS ids, n-gram blocking, bad words,
sampling defaults and max_new_tokens give each request its defaults, the request's own fields win, and a
served completion equals archlab.generate's (and `archlab generate`'s) with the same settings, token for token,
also when requests share the batch (each row blocks n-grams of its own history)."""
from __future__ import annotations

import json

import pytest
import torch
from test_serve import _live_server, complete_together
from variants import BASE

import archlab
from archlab.cli import main
from archlab.generation import read_generation_config
from archlab.runs.checkpoint import save_checkpoint
from archlab.runs.model_folder import write_run_config
from archlab.tokenizer import Tokenizer

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from archlab.serve import CompletionRequest, Engine, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT, NEW = "hello", 20


def _run_folder(root, **generation_config):
    cfg = BASE.with_overrides({"vocab_size": 257, "init.std": 0.2, "max_seq_len": 64})
    torch.manual_seed(0)
    model = archlab.TransformerLM(cfg).eval()
    write_run_config(root, cfg.to_dict(), {}, {})
    save_checkpoint(root / "checkpoints", 5, model.state_dict(), {})
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    tok.save(root / "tokenizer")
    if generation_config:
        (root / "generation_config.json").write_text(json.dumps(generation_config))
    return model, tok


def _new(model, tok, prompt: str, cfg, **kw) -> list[int]:
    """archlab.generate's new tokens under `cfg` (+ kw), up to the first EOS."""
    ids = tok.encode(prompt)
    out = archlab.generate(model, ids, generation_config=cfg, **kw)[len(ids):].tolist()
    eos = kw["eos_token_id"] if "eos_token_id" in kw else cfg.eos
    ends = [i for i, t in enumerate(out) if t in eos]
    return out[:ends[0]] if ends else out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A run folder whose generation_config.json bans a token and a bigram of the free greedy continuation,
    blocks repeated bigrams, and ends at a second EOS id that the constrained continuation reaches at step 8."""
    root = tmp_path_factory.mktemp("served")
    model, tok = _run_folder(root)
    free = _new(model, tok, PROMPT, archlab.generation.GenerationConfig(), max_new_tokens=NEW, eos_token_id=[])
    settings = {"no_repeat_ngram_size": 2, "bad_words_ids": [[free[2]], free[5:7]], "max_new_tokens": NEW}
    constrained = _new(model, tok, PROMPT, archlab.generation.GenerationConfig(**{
        **settings, "bad_words_ids": tuple(map(tuple, settings["bad_words_ids"]))}), eos_token_id=[])
    stop = constrained[8]
    assert stop not in constrained[:8] and constrained != free[:len(constrained)]
    settings["eos_token_id"] = [tok.eot_id, stop]
    (root / "generation_config.json").write_text(json.dumps({**settings, "transformers_version": "5.24.0"}))
    return root, model, tok


def call(engine, method: str, path: str, **kw):
    import asyncio

    async def go():
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.request(method, path, **kw)
    return asyncio.run(go())


def test_served_completion_equals_generate_and_the_cli_under_the_folders_settings(folder, capsys):
    root, model, tok = folder
    cfg = read_generation_config(root)
    expected = _new(model, tok, PROMPT, cfg)
    assert len(expected) == 8                          # stopped at the folder's second EOS id
    engine = Engine.from_folder(root)
    body = call(engine, "POST", "/v1/completions", json={"prompt": PROMPT, "temperature": 0}).json()
    assert body["choices"][0]["text"] == tok.decode(expected)
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 8
    assert main(["generate", str(root), "--prompt", PROMPT]) == 0
    assert capsys.readouterr().out == PROMPT + body["choices"][0]["text"] + "\n"


def test_the_model_list_and_the_startup_line_name_what_is_applied(folder, capsys, monkeypatch):
    root, _, tok = folder
    listed = call(Engine.from_folder(root), "GET", "/v1/models").json()["data"][0]["generation_config"]
    cfg = json.loads((root / "generation_config.json").read_text())
    assert listed == {k: cfg[k] for k in ("max_new_tokens", "eos_token_id", "no_repeat_ngram_size", "bad_words_ids")}
    from archlab.serve.server import Server
    monkeypatch.setattr(Server, "run", lambda self: None)
    assert main(["serve", str(root), "--port", "0"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "no_repeat_ngram_size=2" in line and f"eos_token_id={cfg['eos_token_id']}" in line, line


def test_request_fields_override_the_folders(folder):
    root, model, tok = folder
    cfg = read_generation_config(root)
    engine = Engine.from_folder(root)

    def served(**fields) -> str:
        return "".join(d.text for d in engine.complete(CompletionRequest(PROMPT, **fields)))
    # max_tokens over max_new_tokens: 5 of the same tokens
    assert served(temperature=0, max_tokens=5) == tok.decode(_new(model, tok, PROMPT, cfg, max_new_tokens=5))
    # a repetition penalty the folder does not name, on top of its settings
    penalized = _new(model, tok, PROMPT, cfg, repetition_penalty=3.0)
    assert served(temperature=0, repetition_penalty=3.0) == tok.decode(penalized) != tok.decode(_new(model, tok,
                                                                                                     PROMPT, cfg))
    # a stop string (OpenAI's: cut before it) in place of none
    text = tok.decode(_new(model, tok, PROMPT, cfg))
    assert served(temperature=0, stop=[text[3:5]]) == text[:text.find(text[3:5])]


def test_the_folders_sampling_defaults_apply_and_a_request_temperature_wins(tmp_path):
    model, tok = _run_folder(tmp_path, do_sample=True, temperature=0.9, top_k=20, repetition_penalty=1.3,
                             no_repeat_ngram_size=3, max_new_tokens=12, eos_token_id=[])
    cfg = read_generation_config(tmp_path)
    engine = Engine.from_folder(tmp_path)
    texts = {seed: "".join(d.text for d in engine.complete(CompletionRequest(PROMPT, seed=seed))) for seed in (1, 2)}
    for seed, text in texts.items():
        assert text == tok.decode(_new(model, tok, PROMPT, cfg, seed=seed))
    assert texts[1] != texts[2]                                 # sampled, as the folder asks
    greedy = "".join(d.text for d in engine.complete(CompletionRequest(PROMPT, temperature=0, seed=1)))
    assert greedy == tok.decode(_new(model, tok, PROMPT, cfg, temperature=0.0))
    # top_k -1 turns the folder's top-k off: the sampling then equals generate without it
    off = "".join(d.text for d in engine.complete(CompletionRequest(PROMPT, seed=3, top_k=-1)))
    assert off == tok.decode(_new(model, tok, PROMPT, cfg.merged(top_k=257), seed=3))


def test_batched_requests_each_block_the_ngrams_of_their_own_history(folder):
    """Rows that join and leave the batch at different steps get the texts generate gives them alone: the
    n-gram and bad-words processors look at each row's own prompt and tokens."""
    root, model, tok = folder
    cfg = read_generation_config(root).merged(eos_token_id=[])       # no early stop: longer overlaps
    prompts = [("hello", 20), ("abab abab abab", 16), ("x", 24), ("the the the", 12), ("zz", 8)]
    # per prompt, a banned pair (its last byte, the token it would take next): its first token depends on its own
    # prompt; with another row's history it would be banned or allowed wrongly
    pairs = tuple((tok.encode(p)[-1], _new(model, tok, p, cfg, max_new_tokens=1)[0]) for p, _ in prompts)
    cfg = cfg.merged(bad_words_ids=cfg.bad_words_ids + pairs)
    engine = Engine(model, tok, "tiny", max_batch=3, generation_config=cfg)
    results = complete_together(engine, prompts, delay=0.004)
    for prompt, n in prompts:
        assert results[prompt] == tok.decode(_new(model, tok, prompt, cfg, max_new_tokens=n)), prompt
    assert max(engine.rows_per_step) >= 2 and not engine._active


def test_a_real_socket_serves_the_folders_settings(folder):
    root, model, tok = folder
    server, thread, port = _live_server(Engine.from_folder(root))
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": PROMPT, "temperature": 0},
                       timeout=30)
        assert r.json()["choices"][0]["text"] == tok.decode(_new(model, tok, PROMPT, read_generation_config(root)))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert not thread.is_alive()


@pytest.mark.parametrize("model_type, hint", [("t5", "archlab generate {path} --source TEXT"),
                                              ("bert", "archlab fill-mask {path} TEXT")])
def test_an_encoder_or_encoder_decoder_folder_is_one_line_before_loading(tmp_path, capsys, model_type, hint):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))   # no weights: never read
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "archlab serve serves decoder-only models" in err and hint.format(path=tmp_path) in err
    assert len(err.strip().splitlines()) == 1


def test_ids_past_the_vocabulary_are_named_at_start(tmp_path, capsys):
    _run_folder(tmp_path, bad_words_ids=[[3], [300]])
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bad_words_ids names token(s) [300]" in err and len(err.strip().splitlines()) == 1
