"""Cross-attention through the one Attention module (x-transformers' `kv_input = context or x`): queries from
the decoder, keys and values from an encoder's output projected once per context, the context's padding
masked; hand-computed, with GQA and QK-norm."""
import pytest
import torch
from variants import variant

from archlab.nn.attention import Attention
from archlab.nn.masks import AttnInputs, Context, MaskSpec
from archlab.nn.position import build_attention_position

pytestmark = pytest.mark.usefixtures("one_thread")


def _attention(overrides):
    cfg = variant("base").with_overrides(overrides)
    spec = cfg.layer_spec(0, "decoder")
    torch.manual_seed(0)
    attn = Attention(cfg.d_model, cfg.attention, spec, build_attention_position(cfg, spec),
                     bias=cfg.bias, norm=cfg.norm)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return cfg, attn


def _by_hand(attn, x, enc, padding):
    """softmax(q k^T / sqrt(e), keys of the padding masked) v, heads merged, out-projected."""
    b, t, _ = x.shape
    s, h, kv, e = enc.shape[1], attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = (x @ attn.q_proj.weight.T).view(b, t, h, e).transpose(1, 2)
    k = (enc @ attn.k_proj.weight.T).view(b, s, kv, e).transpose(1, 2)
    v = (enc @ attn.v_proj.weight.T).view(b, s, kv, e).transpose(1, 2)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    k, v = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
    scores = (q @ k.transpose(-1, -2)) * attn.scale
    scores = scores.masked_fill(~padding[:, None, None, :], float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h * e)
    return out @ attn.o_proj.weight.T


@pytest.mark.parametrize("overrides", [{}, {"attention.n_kv_heads": 2},
                                       {"attention.qk_norm": "per_head", "attention.n_kv_heads": 1}])
def test_cross_attention_equals_the_hand_computation_and_projects_the_context_once(overrides):
    cfg, attn = _attention(overrides)
    x, enc = torch.randn(2, 5, cfg.d_model), torch.randn(2, 7, cfg.d_model, requires_grad=True)
    padding = torch.ones(2, 7, dtype=torch.bool)
    padding[1, 4:] = False                                            # row 1: 3 padded encoder tokens
    context = Context(enc, torch.arange(7)[None], MaskSpec(causal=False, key_padding=padding))
    inputs = AttnInputs(torch.arange(5)[None], MaskSpec(), plain=True)
    out = attn(x, inputs, context)
    expected = _by_hand(attn, x, enc, padding)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert enc.grad is not None and enc.grad[1, 4:].abs().max() == 0  # padded keys get no gradient
    with torch.no_grad():
        attn.k_proj.weight.add_(1.0)                                   # projected once: the cache is used
        again = attn(x, AttnInputs(torch.arange(5)[None], MaskSpec(), plain=True), context)
    torch.testing.assert_close(again, out.detach(), rtol=1e-6, atol=1e-6)


def test_a_decode_step_cross_attends_as_the_whole_sequence_does():
    cfg, attn = _attention({"attention.n_kv_heads": 2})
    x, enc = torch.randn(1, 6, cfg.d_model), torch.randn(1, 4, cfg.d_model)
    context = Context(enc, torch.arange(4)[None])
    whole = attn(x, AttnInputs(torch.arange(6)[None], MaskSpec(), plain=True), context)
    steps = [attn(x[:, i:i + 1], AttnInputs(torch.tensor([[i]]), MaskSpec()), context) for i in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-5, atol=1e-5)
