"""The tiled kernel (nn/tiled_attention.py): its causal form (SDPA's flash forward + the tiled backward, for bf16
on CPUs with bf16 units) against SDPA and a float64 reference; its general form (any plan from a MaskSpec)
against the eager backend, values and gradients."""
import pytest
import torch
import torch.nn.functional as F

from archlab.config import ModelConfig
from archlab.models.decoder import TransformerLM
from archlab.nn import tiled_attention
from archlab.nn.masks import MaskSpec
from archlab.nn.tiled_attention import causal_attention, use_cpu_attention


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


@pytest.mark.parametrize("tile", [4, 5, 16])
def test_tiles_give_the_same_gradients(monkeypatch, tile):
    """Query tiles (an uneven last one) change no result."""
    q, k, v, g = _inputs(3, 4, 2, 18, 8, torch.float64, seed=2)
    whole = _reference(q, k, v, g, 0.35)
    causal = tiled_attention.TilePlan.causal.__func__
    monkeypatch.setattr(tiled_attention.TilePlan, "causal", classmethod(lambda cls, t: causal(cls, t, tile)))
    parts = _run(lambda *a: causal_attention(*a, 0.35), q, k, v, g)
    for a, b in zip(parts, whole):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.fixture(autouse=True)
def bf16_units(monkeypatch):
    """Test the path on any CPU: pretend it has bf16 matmul units (AMX), where the path is used."""
    monkeypatch.setattr(tiled_attention, "has_native_bf16", lambda device: True)


def test_not_used_where_bf16_is_emulated(monkeypatch):
    monkeypatch.setattr(tiled_attention, "has_native_bf16", lambda device: False)
    xb = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    assert not use_cpu_attention(xb, 0.0)                              # AVX2: SDPA's backward is faster


def test_used_only_for_bf16_training_on_cpu():
    x = torch.randn(1, 2, 4, 8, requires_grad=True)
    assert not use_cpu_attention(x, 0.0)                               # float32: SDPA's backward
    xb = x.detach().bfloat16().requires_grad_()
    assert use_cpu_attention(xb, 0.0)
    assert not use_cpu_attention(xb, 0.1)                              # dropout: SDPA
    assert not use_cpu_attention(xb.detach(), 0.0)                     # nothing to differentiate
    long = torch.zeros(1, 1, tiled_attention.MAX_LEN + 1, 8, dtype=torch.bfloat16, requires_grad=True)
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
    original = tiled_attention._CausalAttention.apply
    monkeypatch.setattr(tiled_attention._CausalAttention, "apply",
                        lambda *a: calls.append(1) or original(*a))
    ours = _grads(model, x, y)
    assert len(calls) == cfg.n_layers
    monkeypatch.setattr(tiled_attention, "use_cpu_attention", lambda q, dropout: False)   # the seam picks SDPA
    sdpa = _grads(model, x, y)
    assert len(calls) == cfg.n_layers
    for name in ours:   # two bf16 backward passes: equal to bf16 rounding
        assert _rel(ours[name], sdpa[name]) < 3e-2, name


SPECS = {
    "full": lambda causal: MaskSpec(causal=causal),
    "window": lambda causal: MaskSpec(causal=causal).with_window(5),
    "dilated": lambda causal: MaskSpec(causal=causal, dilation=2).with_window(4),
    "global": lambda causal: MaskSpec(causal=causal, global_indices=(0, 9)).with_window(3),
    "strided": lambda causal: MaskSpec(causal=causal, pattern="strided", block_size=4),
    "fixed": lambda causal: MaskSpec(causal=causal, pattern="fixed", block_size=5, summary=2),
    "prefix": lambda causal: MaskSpec(causal=causal, prefix_lengths=torch.tensor([6, 0])).with_window(3),
    "padding": lambda causal: MaskSpec(causal=causal, key_padding=torch.arange(19)[None].expand(2, 19) % 7 != 3),
}


@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_tiled_equals_eager_for_every_mask(monkeypatch, name, causal, alibi):
    """Tiles of 4 rows and key runs of 4 over 19 tokens (5 tiles, a ragged tail), GQA, float64."""
    from archlab.nn.attention_backends import BACKENDS, AttnCall
    from archlab.nn.position import alibi_slopes

    monkeypatch.setattr(tiled_attention, "TILE", 4)
    q, k, v, g = _inputs(2, 4, 2, 19, 8, torch.float64, seed=3)
    pos = torch.arange(19)[None]
    slopes = alibi_slopes(4).double()
    bias = (lambda qp, kp: -slopes[:, None, None] * (qp[:, None, :, None] - kp[:, None, None, :]).abs()
            ) if alibi else None
    call = AttnCall(q, k, v, 0.4, spec=SPECS[name](causal), q_pos=pos, k_pos=pos, aligned=True,
                    position_bias=bias)
    tiled, eager = BACKENDS.get("tiled"), BACKENDS.get("eager")
    assert tiled.supports(call) is None
    got = _run(lambda *a: tiled(call.__class__(*a, 0.4, spec=call.spec, q_pos=pos, k_pos=pos, aligned=True,
                                               position_bias=bias))[0], q, k, v, g)
    ref = _run(lambda *a: eager(call.__class__(*a, 0.4, spec=call.spec, q_pos=pos, k_pos=pos, aligned=True,
                                               position_bias=bias))[0], q, k, v, g)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_tiled_plans_skip_what_the_mask_never_reaches(monkeypatch):
    """A window's plan visits the key runs within its reach only: pairs computed grow as n·w, not n²."""
    monkeypatch.setattr(tiled_attention, "TILE", 16)
    pos = torch.arange(256)[None]
    plan = tiled_attention.TilePlan.from_spec(MaskSpec().with_window(16), pos, pos, aligned=True)
    pairs = sum((rows.stop - rows.start) * (s.keys.stop - s.keys.start) for rows, spans in plan.tiles for s in spans)
    assert pairs == 16 * 16 + 15 * 16 * 31                  # the first tile sees itself, the others 31 keys back
    full = tiled_attention.TilePlan.from_spec(MaskSpec(), pos, pos, aligned=True)
    assert sum(len(spans) for _, spans in full.tiles) == 16  # causal: one run per tile
