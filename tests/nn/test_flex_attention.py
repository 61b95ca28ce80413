"""The FlexAttention backend (nn/flex_attention.py, "flex") equals the eager reference, forward only on CPU
(torch 2.13 has no CPU FlexAttention backward): the block-local patterns (windows that do not divide the
length, dilation, global tokens, strided and fixed patterns, prefix-LM, key and left padding, segments),
GQA/MQA, soft-capping, sinks, ALiBi and T5 biases, direct callers' mask and bias tensors, whole models."""
import warnings

import pytest
import torch
from test_local_attention import _ran
from variants import variant

from archlab import TransformerLM
from archlab.models import presets
from archlab.nn import attention_backends as backends
from archlab.nn.attention_backends import AttnCall, forced
from archlab.nn.masks import AttnInputs, MaskSpec

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

FLEX, EAGER = backends.BACKENDS.get("flex"), backends.BACKENDS.get("eager")


def _specs(causal: bool, b: int, t: int) -> dict[str, MaskSpec]:
    padding = torch.ones(b, t, dtype=torch.bool)
    padding[1, 8:10] = False                           # row 1: a hole
    padding[2, -3:] = False                            # row 2 right-padded
    segments = (torch.arange(t)[None] >= torch.tensor([[7], [0], [12]])).long()   # (b, t): packed documents
    return {
        "full": MaskSpec(causal=causal),
        "window-padding": MaskSpec(causal=causal, key_padding=padding).with_window(6),
        "window-prefix": MaskSpec(causal=causal, prefix_lengths=torch.tensor([5, 0, 9])).with_window(3),
        "dilated": MaskSpec(causal=causal, key_padding=padding, dilation=3).with_window(4),
        "global": MaskSpec(causal=causal, key_padding=padding, global_indices=(0, 3)).with_window(3),
        "fixed": MaskSpec(causal=causal, key_padding=padding, pattern="fixed", block_size=3, summary=2),
        "strided": MaskSpec(causal=causal, pattern="strided", block_size=5),
        "segments": MaskSpec(causal=causal, segment_ids=segments).with_window(8),
    }


@pytest.mark.parametrize("causal", [True, False])
def test_flex_equals_eager_over_the_block_local_patterns(causal):
    """Direct calls, GQA (4 query heads on 2 kv heads), 19 positions against 128-wide tiles; soft-cap and
    sinks on every other spec; row 1 left-padded (positions -1, whose rows see every key, as eager's)."""
    torch.manual_seed(0)
    b, h, kv, t, e = 3, 4, 2, 19, 8
    q = torch.randn(b, h, t, e)
    k, v = (torch.randn(b, kv, t, e) for _ in range(2))
    pos = torch.arange(t).repeat(b, 1)
    pos[1] = torch.arange(t) - 4                       # row 1: 4 pad tokens on the left
    pos[1, :4] = -1
    for i, (name, spec) in enumerate(_specs(causal, b, t).items()):
        extras = {"softcap": 4.0, "sinks": torch.randn(h)} if i % 2 else {}
        call = AttnCall(q, k, v, e ** -0.5, spec=spec, q_pos=pos, k_pos=pos, **extras)
        assert FLEX.supports(call) is None
        ref = EAGER(call)[0]
        assert torch.isfinite(ref).all(), name
        torch.testing.assert_close(FLEX(call)[0], ref, rtol=1e-5, atol=1e-5, msg=name)


def test_direct_callers_mask_bias_and_causal_with_a_cache_offset():
    torch.manual_seed(0)
    b, h, t, s, e = 2, 4, 5, 7, 8
    q, k, v = torch.randn(b, h, t, e), torch.randn(b, 1, s, e), torch.randn(b, 1, s, e)   # MQA
    mask = torch.rand(b, 1, t, s) > 0.3
    mask[..., 0] = True
    bias = torch.randn(1, h, t, s)
    for kw in ({"mask": mask}, {"mask": mask, "bias": bias}, {"is_causal": True}, {"bias": bias, "softcap": 2.0}):
        call = AttnCall(q, k, v, e ** -0.5, **kw)
        torch.testing.assert_close(FLEX(call)[0], EAGER(call)[0], rtol=1e-5, atol=1e-5, msg=str(list(kw)))


CASES = {   # over the windowed base model (window 5 of 23 tokens); the patterns one by one above
    "alibi-gqa": {"position.kind": "alibi", "attention.n_kv_heads": 2},
    "softcap-sinks": {"attention.logit_softcap": 5.0, "attention.learned_sinks": True},
    "lg-prefix-lm": {"attention.layer_pattern": "LG", "attention.prefix_lm": True},
    "dilated-alibi": {"attention.dilation": 2, "position.kind": "alibi"},
    "global-tokens-t5": {"attention.global_tokens": 2, "position.kind": "t5"},
    "strided": {"attention.window": None, "attention.sparse": "strided", "attention.sparse_stride": 4},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_model_on_flex_gives_eager_logits(name, monkeypatch):
    cfg = variant("base").with_overrides({"attention.window": 5, **CASES[name]})
    model = TransformerLM(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 23))
    kw = {"prefix_lengths": torch.tensor([7, 2])} if cfg.attention.prefix_lm else {}
    ran = _ran(monkeypatch)
    with torch.no_grad():
        with forced("eager"):
            ref = model(x, **kw)
        ran.clear()
        with forced("flex"):
            got = model(x, **kw)
    assert ran == ["flex"] * cfg.n_layers, ran
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["mistral-7b", "gemma2-2b"])
def test_a_tiny_windowed_preset_on_flex_gives_eager_logits_and_a_cached_prefill_too(preset, monkeypatch):
    """A whole model (Gemma 2: soft-capping, local/global layers); then a left-padded prefill into a KV cache
    (empty slots at -1, padded rows included) and a decode step after it."""
    from archlab.generation.stepper import positions_from_mask
    from archlab.nn.kv_cache import StaticKVCache

    cfg = presets.tiny(preset, window=6)
    model = TransformerLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 21))
    ran = _ran(monkeypatch)
    with torch.no_grad():
        with forced("eager"):
            ref = model(ids)
        with forced("flex"):
            got = model(ids)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        mask = torch.ones(2, 21, dtype=torch.bool)
        mask[1, :6] = False
        pos = positions_from_mask(mask)
        logits = {}
        for name in ("eager", "flex"):
            cache = StaticKVCache(cfg, 2, 24)
            with forced(name):
                prefill = model(ids, positions=pos, cache=cache)
                step = model(ids[:, -1:], positions=pos[:, -1:] + 1, cache=cache)
            logits[name] = torch.cat((prefill, step), 1)
    assert ran.count("flex") == 3 * cfg.n_layers and ran.count("eager") == 3 * cfg.n_layers, ran
    torch.testing.assert_close(logits["flex"], logits["eager"], rtol=1e-5, atol=1e-5)


def test_cross_attention_over_a_padded_context(monkeypatch):
    from archlab.nn.attention import Attention
    from archlab.nn.masks import Context
    from archlab.nn.position import build_attention_position

    cfg = variant("base").with_overrides({"attention.n_kv_heads": 2})
    spec = cfg.layer_spec(0, "decoder")
    attn = Attention(cfg.d_model, cfg.attention, spec, build_attention_position(cfg, spec), bias=cfg.bias,
                     norm=cfg.norm)
    x, enc = torch.randn(2, 5, cfg.d_model), torch.randn(2, 7, cfg.d_model)
    padding = torch.ones(2, 7, dtype=torch.bool)
    padding[1, 4:] = False                                            # row 1: 3 padded encoder tokens
    out = {}
    ran = _ran(monkeypatch)
    with torch.no_grad():
        for name in ("eager", "flex"):
            context = Context(enc, torch.arange(7)[None], MaskSpec(causal=False, key_padding=padding))
            with forced(name):
                out[name] = attn(x, AttnInputs(torch.arange(5)[None], MaskSpec(), plain=True), context)
    assert ran == ["eager", "flex"]
    torch.testing.assert_close(out["flex"], out["eager"], rtol=1e-5, atol=1e-5)


def test_one_block_mask_per_spec_and_forward(monkeypatch):
    from archlab.nn import flex_attention
    built = []
    create = flex_attention.create_block_mask
    monkeypatch.setattr(flex_attention, "create_block_mask", lambda *a, **kw: built.append(a[1:]) or create(*a, **kw))
    model = TransformerLM(variant("base").with_overrides({"attention.window": 3, "n_layers": 4,
                                                         "attention.layer_pattern": "LLLG"}))
    with torch.no_grad(), forced("flex"):
        model(torch.randint(0, 97, (2, 9)))
    assert built == [(None, None, 9, 9)] * 2          # the window's, shared by 3 layers; the global layer's


def test_refusals_and_the_usual_choice():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    pos = torch.arange(4)[None]
    call = AttnCall(q, q, q, 1.0, spec=MaskSpec().with_window(2), q_pos=pos, k_pos=pos,
                    inputs=AttnInputs(pos, plain=True), aligned=True)
    assert FLEX.supports(call) == "torch 2.13 has no CPU FlexAttention backward (forward under torch.no_grad() only)"
    with torch.no_grad():
        assert FLEX.supports(call) is None
        assert not FLEX.prefers(call)                                   # CPU: forced only
        assert backends.choose(call).name != "flex"
        with forced("flex"):
            assert backends.choose(call).name == "flex"
        for kw in ({"keep_probs": True}, {"dropout": 0.1}):
            assert "no kept probabilities or dropout" in FLEX.supports(AttnCall(q, q, q, 1.0, is_causal=True, **kw))
    model = TransformerLM(variant("window"))
    with forced("flex"):
        model(torch.randint(0, 97, (1, 6))).sum().backward()            # training on CPU falls back: no error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the compiled kernel, chosen by default")
def test_cuda_compiled_flex_is_chosen_and_equals_eager_with_gradients(monkeypatch):
    warnings.filterwarnings("ignore")
    ran = _ran(monkeypatch)
    cfg = variant("base").with_overrides({"attention.window": 5, "attention.n_kv_heads": 2,
                                          "attention.logit_softcap": 5.0, "attention.head_dim": 16})
    model = TransformerLM(cfg).cuda()
    x = torch.randint(0, cfg.vocab_size, (2, 200), device="cuda")
    grads = {}
    for name in ("eager", None):
        model.zero_grad()
        with forced(name):
            logits = model(x)
        logits.float().square().mean().backward()
        grads[name] = (logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert ran[cfg.n_layers:] == ["flex"] * cfg.n_layers, ran          # the usual choice on CUDA
    torch.testing.assert_close(grads[None][0], grads["eager"][0], rtol=1e-4, atol=1e-4)
    for got, ref in zip(grads[None][1], grads["eager"][1]):
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-4)


class _LooksCuda(torch.Tensor):
    """A CPU tensor that answers is_cuda (supports() reads the flag; nothing runs on it)."""

    @property
    def is_cuda(self):
        return True


def test_a_head_dimension_below_16_is_refused_on_cuda():
    """The compiled kernel's lowering refuses E < 16 ("NYI", seen on an H200): the chooser must skip it there."""
    pos = torch.arange(4)[None]
    for e, refused in ((8, True), (16, False)):
        q = torch.Tensor._make_subclass(_LooksCuda, torch.randn(1, 2, 4, e))
        with torch.no_grad():
            why = FLEX.supports(AttnCall(q, q, q, 1.0, spec=MaskSpec().with_window(2), q_pos=pos, k_pos=pos,
                                         aligned=True))
        assert (why is not None and "at least 16" in why) == refused, (e, why)


def test_a_kernel_torch_cannot_build_runs_eager_once_warned_then_the_shape_goes_elsewhere(monkeypatch):
    from torch._inductor.exc import InductorError

    from archlab.nn import flex_attention
    monkeypatch.setattr(flex_attention, "_UNBUILDABLE", {})
    tried = []

    def unbuildable(device):
        def kernel(*a, **kw):
            tried.append(a[0].shape)
            raise InductorError(RuntimeError("LoweringException: NoValidChoicesError: No choices to select"), None)
        return kernel
    monkeypatch.setattr(flex_attention, "_kernel", unbuildable)
    model = TransformerLM(variant("window")).eval()
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        with forced("eager"):
            ref = model(x)
        ran = _ran(monkeypatch)
        with forced("flex"), pytest.warns(RuntimeWarning, match="could not build a kernel .*NoValidChoicesError"):
            first = model(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with forced("flex"):
                second = model(x)
    assert len(tried) == 1                                  # one attempt; the second layer's call is refused
    assert ran[0] == "flex" and "flex" not in ran[1:], ran
    torch.testing.assert_close(first, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, ref, rtol=1e-5, atol=1e-5)
    call_shape = next(iter(flex_attention._UNBUILDABLE))
    assert call_shape[1] == torch.float32 and "NoValidChoicesError" in flex_attention._UNBUILDABLE[call_shape]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the compiled kernel's limits")
def test_cuda_small_heads_and_mqa_in_fp32_train_equal_to_eager():
    """Seen on an H200 (torch 2.11): E=8 failed to lower and fp32 MQA with gradients found no kernel; both now
    run (on another backend, or eager once with a warning) and equal the reference."""
    warnings.filterwarnings("ignore")
    for overrides in ({"d_model": 32}, {"d_model": 64, "attention.n_kv_heads": 1}):
        cfg = variant("window").with_overrides(overrides)
        model = TransformerLM(cfg).cuda()
        x = torch.randint(0, cfg.vocab_size, (2, 40), device="cuda")
        out = {}
        for name in ("eager", None):
            model.zero_grad()
            with forced(name):
                logits = model(x)
            logits.float().square().mean().backward()
            out[name] = (logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
        torch.testing.assert_close(out[None][0], out["eager"][0], rtol=1e-4, atol=1e-4)
        for got, ref in zip(out[None][1], out["eager"][1]):
            torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-4)
