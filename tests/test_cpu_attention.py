"""The bf16 CPU attention (flash forward, matmul backward) against SDPA and a float64 reference."""
import pytest
import torch
import torch.nn.functional as F

from archlab.config import ModelConfig
from archlab.model import TransformerLM
from archlab.nn import cpu_attention
from archlab.nn.cpu_attention import causal_attention, use_cpu_attention


def _inputs(b, h, kv, t, e, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, t, e, generator=gen).to(dtype).requires_grad_() for n in (h, kv, kv))
    grad_out = torch.randn(b, h, t, e, generator=gen).to(dtype)
    return q, k, v, grad_out


def _reference(q, k, v, grad_out, scale):
    """Plain softmax attention in float64 by autograd, GQA by repeating the key/value heads."""
    q64, k64, v64 = (z.detach().double().requires_grad_() for z in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kr, vr = k64.repeat_interleave(groups, 1), v64.repeat_interleave(groups, 1)
    t = q.shape[2]
    scores = (q64 @ kr.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = scores.softmax(-1) @ vr
    out.backward(grad_out.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def _run(fn, q, k, v, grad_out):
    for z in (q, k, v):
        z.grad = None
    out = fn(q, k, v)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("heads,kv_heads,t", [(4, 4, 17), (4, 2, 33), (6, 1, 8), (2, 2, 1)])
def test_float64_matches_reference(heads, kv_heads, t):
    q, k, v, g = _inputs(2, heads, kv_heads, t, 8, torch.float64)
    scale = 0.3
    got = _run(lambda *a: causal_attention(*a, scale), q, k, v, g)
    for a, b in zip(got, _reference(q, k, v, g, scale)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("heads,kv_heads", [(5, 5), (4, 2)])
def test_bf16_gradients_as_accurate_as_sdpa(heads, kv_heads):
    q, k, v, g = _inputs(2, heads, kv_heads, 64, 32, torch.bfloat16, seed=1)
    scale = 32 ** -0.5
    ref = _reference(q, k, v, g, scale)
    ours = _run(lambda *a: causal_attention(*a, scale), q, k, v, g)
    sdpa = _run(lambda *a: F.scaled_dot_product_attention(*a, is_causal=True, scale=scale,
                                                          enable_gqa=heads != kv_heads), q, k, v, g)
    assert all(z.dtype == torch.bfloat16 for z in ours)
    torch.testing.assert_close(ours[0], sdpa[0], rtol=0, atol=0)   # the same forward kernel
    for mine, theirs, exact in zip(ours[1:], sdpa[1:], ref[1:]):
        assert _rel(mine, exact) < 1.5 * _rel(theirs, exact) + 1e-3


@pytest.mark.parametrize("block,slice_rows", [(4, 24), (5, 5), (16, 7)])
def test_blocks_and_slices_give_the_same_gradients(monkeypatch, block, slice_rows):
    """Query blocks (uneven last one) and (batch x head) slices (uneven too) change no result."""
    q, k, v, g = _inputs(3, 4, 2, 18, 8, torch.float64, seed=2)
    whole = _reference(q, k, v, g, 0.35)
    monkeypatch.setattr(cpu_attention, "QUERY_BLOCK", block)
    monkeypatch.setattr(cpu_attention, "SLICE_BYTES", 4 * block * 18 * slice_rows)
    parts = _run(lambda *a: causal_attention(*a, 0.35), q, k, v, g)
    for a, b in zip(parts, whole):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.fixture(autouse=True)
def bf16_units(monkeypatch):
    """Test the path on any CPU: pretend it has bf16 matmul units (AMX), where the path is used."""
    monkeypatch.setattr(cpu_attention, "has_native_bf16", lambda device: True)


def test_not_used_where_bf16_is_emulated(monkeypatch):
    monkeypatch.setattr(cpu_attention, "has_native_bf16", lambda device: False)
    xb = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    assert not use_cpu_attention(xb, 0.0)                              # AVX2: SDPA's backward is faster


def test_used_only_for_bf16_training_on_cpu():
    x = torch.randn(1, 2, 4, 8, requires_grad=True)
    assert not use_cpu_attention(x, 0.0)                               # float32: SDPA's backward
    xb = x.detach().bfloat16().requires_grad_()
    assert use_cpu_attention(xb, 0.0)
    assert not use_cpu_attention(xb, 0.1)                              # dropout: SDPA
    assert not use_cpu_attention(xb.detach(), 0.0)                     # nothing to differentiate
    long = torch.zeros(1, 1, cpu_attention.MAX_LEN + 1, 8, dtype=torch.bfloat16, requires_grad=True)
    assert not use_cpu_attention(long, 0.0)                            # SDPA is as fast there
    with torch.no_grad():
        assert not use_cpu_attention(xb, 0.0)


def _grads(model, x, y):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, targets=y).total.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_model_step_uses_it_and_matches_sdpa(monkeypatch, kv_heads):
    cfg = ModelConfig(name="t", vocab_size=97, d_model=64, n_layers=2, max_seq_len=64,
                      attention={"n_heads": 4, "n_kv_heads": kv_heads}, mlp={"activation": "swiglu"},
                      position={"kind": "rope"})
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    x = torch.randint(0, 97, (2, 48))
    y = torch.randint(0, 97, (2, 48))
    calls = []
    original = cpu_attention._CausalAttention.apply
    monkeypatch.setattr(cpu_attention._CausalAttention, "apply",
                        lambda *a: calls.append(1) or original(*a))
    ours = _grads(model, x, y)
    assert len(calls) == cfg.n_layers
    monkeypatch.setattr(cpu_attention, "use_cpu_attention", lambda q, dropout: False)   # the seam picks SDPA
    sdpa = _grads(model, x, y)
    assert len(calls) == cfg.n_layers
    for name in ours:   # two bf16 backward passes: equal to bf16 rounding
        assert _rel(ours[name], sdpa[name]) < 3e-2, name
