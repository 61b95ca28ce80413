"""The server's default KV cache row length: the model's context, cut to a memory budget (archlab.serve.cache_size)."""
from __future__ import annotations

import pytest

from archlab.serve.cache_size import DEFAULT_BUDGET, STEP, CachePlan, cache_budget, row_tokens

GIB = 2 ** 30
GEMMA_270M = 2 * 18 * 1 * 256 * 4 + 8      # bytes a token of one row: 18 layers, 1 kv head of 256, fp32, a position


def test_gemma_3_270m_fits_a_laptop_by_default():
    # 8 rows x 32,768 tokens was 9.0 GiB; the default cuts each row to what fits 2 GiB
    plan = row_tokens(32768, 8, GEMMA_270M, cache_budget(16 * GIB))
    assert plan.cut and plan.tokens % STEP == 0
    assert 8 * plan.tokens * GEMMA_270M <= DEFAULT_BUDGET < 8 * (plan.tokens + STEP) * GEMMA_270M
    assert plan.tokens == 7168


def test_a_context_that_fits_is_kept_whole():
    assert row_tokens(8192, 8, 1000, DEFAULT_BUDGET) == CachePlan(8192, False, DEFAULT_BUDGET)


@pytest.mark.parametrize("available, budget", [(None, DEFAULT_BUDGET), (64 * GIB, DEFAULT_BUDGET),
                                               (4 * GIB, GIB), (0, 0)])
def test_the_budget_is_2_gib_or_a_quarter_of_free_memory(available, budget):
    assert cache_budget(available) == budget


def test_a_tiny_budget_still_leaves_a_row_of_step_tokens_and_never_more_than_the_context():
    assert row_tokens(32768, 8, 10_000, 0).tokens == STEP
    assert row_tokens(100, 8, 10_000, 0).tokens == 100


def _folder(root):
    """A tiny run whose context is 2,048 tokens; returns the cache's bytes a token of one row."""
    import torch
    from variants import BASE

    import archlab
    from archlab.runs.checkpoint import save_checkpoint
    from archlab.runs.model_folder import write_run_config
    from archlab.tokenizer import Tokenizer
    cfg = BASE.with_overrides({"vocab_size": 257, "max_seq_len": 2048})
    write_run_config(root, cfg.to_dict(), {}, {})
    save_checkpoint(root / "checkpoints", 5, archlab.TransformerLM(cfg).state_dict(), {})
    Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(root / "tokenizer")
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * torch.float32.itemsize + 8


def _serve(tmp_path, monkeypatch, capsys, *args, free: int | None = None):
    from archlab.cli import main
    from archlab.models import accounting
    from archlab.serve.server import Server
    monkeypatch.setattr(Server, "run", lambda self: None)
    if free is not None:
        monkeypatch.setattr(accounting, "available_memory", lambda device: free)
    code = main(["serve", str(tmp_path), "--port", "0", *args])
    return code, capsys.readouterr()


def test_the_startup_line_says_the_cut_and_how_to_change_it(tmp_path, monkeypatch, capsys):
    # free memory a quarter of which holds 8 rows of 1,000 tokens: each row is cut to 768 (a multiple of 256)
    per_token = _folder(tmp_path)
    code, out = _serve(tmp_path, monkeypatch, capsys, free=4 * 8 * 1000 * per_token)
    assert code == 0, out.err
    line = next(x for x in out.out.splitlines() if x.startswith("KV cache:"))
    assert line.startswith("KV cache: 8 rows x 768 tokens"), line
    assert "the model's context 2,048 cut to fit" in line and "--context 2048 for all of it" in line
    assert "--cache-rows / --max-batch" in line
    code, out = _serve(tmp_path, monkeypatch, capsys, free=64 * GIB)     # plenty free: the whole context
    assert "KV cache: 8 rows x 2,048 tokens" in out.out and "cut" not in out.out


def test_explicit_flags_win(tmp_path, monkeypatch, capsys):
    _folder(tmp_path)
    # enough free memory for the whole 2,048-token row: --context still wins
    code, out = _serve(tmp_path, monkeypatch, capsys, "--max-batch", "1", "--cache-rows", "1", "--context", "48",
                       free=64 * GIB)
    assert code == 0, out.err
    assert "KV cache: 1 row x 48 tokens" in out.out and "(--context; the model's is 2,048)" in out.out
    code, out = _serve(tmp_path, monkeypatch, capsys, "--context", "2049")
    assert code == 2 and "context of 2049 tokens must be in 1..2048" in out.err
    code, out = _serve(tmp_path, monkeypatch, capsys, "--context", "0")
    assert code == 2 and "--context 0 must be >= 1" in out.err


def test_a_request_past_a_cut_context_names_the_servers_context(tmp_path):
    from archlab.serve import CompletionRequest, Engine
    from archlab.serve.fields import RequestError
    _folder(tmp_path)
    engine = Engine.from_folder(tmp_path, context=16)
    assert engine.slots.capacity == 16
    with pytest.raises(RequestError, match="do not fit the server's context of 16"):
        engine.encode(CompletionRequest("hello " * 4, max_tokens=12))
