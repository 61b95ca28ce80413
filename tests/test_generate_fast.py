"""FastDecoder (archlab.generation.fast_decode): every variant is either covered, with decode-step
logits equal to the model's own cached forward (padding, windows, GQA, biases included), or
refused with a reason; prepared weights follow in-place weight changes; hooks turn it off."""
import pytest
import torch
from variants import VARIANTS, variant

import archlab
from archlab import TransformerLM
from archlab.generation.fast_decode import FastDecoder
from archlab.generation.stepper import Stepper
from archlab.nn.kv_cache import StaticKVCache

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# the LLaMA-like family the fast path exists for: these must not silently fall back
COVERED = {"base", "gqa", "mqa", "head-dim", "window", "local-global", "rope-local-theta",
           "rope-local-nope-global", "rope-linear-scaling", "rope-llama3-scaling", "pos-none",
           "all-biases", "tied", "query-scalar", "norm-rmsnorm", "norm-rmsnorm_1p",
           "norm-layernorm", "act-swiglu", "act-geglu", "act-gelu", "no-final-norm", "d-ff-ratio"}


def _prompt(cfg, b=2, t=7):
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, :3] = False                       # row 1 left-padded: masks are needed
    return ids, mask


def _decode_logits(model, ids, mask, fast, steps=12):
    with torch.inference_mode():
        st = Stepper(model, ids, mask, steps, fast=fast)
        logits, out = st.prefill(), []
        for i in range(steps):
            tokens = (torch.arange(ids.shape[0]) * 7 + i * 3) % model.config.vocab_size
            logits = st.step(tokens)
            out.append(logits)
    return st, torch.stack(out, 1)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fast_step_equals_model_forward_or_refuses(name):
    model = TransformerLM(variant(name)).eval()
    cache = StaticKVCache(model.config, 2, 8)
    reason = FastDecoder.supports(model, cache)
    if name in COVERED:
        assert reason is None, f"{name} fell back: {reason}"
    if reason is not None:
        with pytest.raises(ValueError, match="does not cover"):
            FastDecoder(model, cache)
        return
    ids, mask = _prompt(model.config)
    ref_stepper, ref = _decode_logits(model, ids, mask, fast=False)
    fast_stepper, got = _decode_logits(model, ids, mask, fast=True)
    assert ref_stepper.fast is None and fast_stepper.fast is not None
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_greedy_generate_matches_model_path_with_padding_and_window():
    model = TransformerLM(variant("local-global").with_overrides({"attention.n_kv_heads": 2})).eval()
    ids, mask = _prompt(model.config)
    outs = []
    for fast in (False, True):
        with torch.inference_mode():
            st = Stepper(model, ids, mask, 20, fast=fast)
            logits, toks = st.prefill(), []
            for _ in range(20):
                toks.append(logits.argmax(-1))
                logits = st.step(toks[-1])
        outs.append(torch.stack(toks, 1))
    assert torch.equal(outs[0], outs[1])


def test_prepared_weights_follow_in_place_changes():
    model = TransformerLM(variant("gqa")).eval()
    ids, mask = _prompt(model.config)
    _decode_logits(model, ids, mask, fast=True)          # prepares (and keeps) fused weights
    with torch.no_grad():
        model.blocks[0].attn.k_proj.weight.mul_(3.0)
        model.blocks[1].mlp.down_proj.weight.add_(0.05)
    _, ref = _decode_logits(model, ids, mask, fast=False)
    _, got = _decode_logits(model, ids, mask, fast=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_hooks_and_training_mode_fall_back_to_the_model():
    model = TransformerLM(variant("base"))
    cache = StaticKVCache(model.config, 1, 8)
    assert "training" in FastDecoder.supports(model, cache)
    model.eval()
    handle = model.blocks[0].register_forward_hook(lambda *a: None)
    assert "hooks" in FastDecoder.supports(model, cache)
    handle.remove()
    assert FastDecoder.supports(model, cache) is None


def test_generate_uses_fast_path_and_agrees_with_uncached():
    model = TransformerLM(variant("gqa")).eval()
    prompt = torch.randint(0, 97, (3, 5))
    cached = archlab.generate(model, prompt, max_new_tokens=10)
    uncached = archlab.generate(model, prompt, max_new_tokens=10, use_cache=False)
    assert torch.equal(cached, uncached)


# ---- the modules' packed decode path (archlab.nn.fused.packing): models FastDecoder does not cover ----
def _module_decode_logits(model, ids, mask, pack: bool, steps=12):
    """Cached decode through the model's forward, within packing() or not."""
    from archlab.nn.fused import packing
    with torch.inference_mode(), packing(pack):
        st = Stepper(model, ids, mask, steps, fast=False)
        st.prefill()
        out = []
        for i in range(steps):
            tokens = (torch.arange(ids.shape[0]) * 7 + i * 3) % model.config.vocab_size
            out.append(st._model_logits(tokens[:, None], st.next_pos, st.cache))
            st.next_pos = st.next_pos + 1
    return torch.stack(out, 1)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_module_forward_through_packed_weights_equals_the_plain_forward(name):
    model = TransformerLM(variant(name)).eval()
    ids, mask = _prompt(model.config)
    plain = _module_decode_logits(model, ids, mask, pack=False)
    packed = _module_decode_logits(model, ids, mask, pack=True)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)


def test_packing_is_off_by_default_and_never_under_gradients():
    from archlab.nn import fused
    model = TransformerLM(variant("qk-norm-per-head")).eval()      # not a FastDecoder model: decodes via modules
    x = torch.randint(0, model.config.vocab_size, (1, 3))
    fused._PACKED.clear()
    with torch.no_grad():
        model(x)                                         # a user's no-grad forward: no weight copies
    assert len(fused._PACKED) == 0
    with fused.packing():
        model(x).sum().backward()                        # gradients: the plain Linears, even here
        assert len(fused._PACKED) == 0
        with torch.no_grad():
            model(x)
    assert model.blocks[0].attn.q_proj in fused._PACKED


def test_module_packed_weights_follow_in_place_changes_and_hooks_see_every_step():
    model = TransformerLM(variant("qk-norm-per-head")).eval()
    ids, mask = _prompt(model.config)
    _module_decode_logits(model, ids, mask, pack=True)
    with torch.no_grad():
        model.blocks[0].attn.v_proj.weight.mul_(2.0)
        model.lm_head.weight.add_(0.1) if model.lm_head is not None else model.embed.weight.add_(0.1)
    torch.testing.assert_close(_module_decode_logits(model, ids, mask, pack=True),
                               _module_decode_logits(model, ids, mask, pack=False), rtol=1e-5, atol=1e-5)
    calls = []
    model.blocks[0].mlp.down_proj.register_forward_hook(lambda *a: calls.append(1))
    _module_decode_logits(model, ids, mask, pack=True, steps=4)
    assert len(calls) == 5                               # a hooked Linear runs as its module: prefill + 4


def test_forward_hooks_on_a_block_fire_at_every_cached_decode_step():
    model = TransformerLM(variant("base")).eval()
    shapes = []
    model.blocks[0].register_forward_hook(lambda mod, args, out: shapes.append(tuple(out.shape)))
    prompt = torch.randint(0, model.config.vocab_size, (2, 5))
    out = archlab.generate(model, prompt, max_new_tokens=6)
    d = model.config.d_model
    assert shapes == [(2, 5, d)] + [(2, 1, d)] * 5            # the prefill, then each cached step
    assert torch.equal(out, archlab.generate(model, prompt, max_new_tokens=6, use_cache=False))


@pytest.mark.parametrize("name", ["base", "qk-norm-per-head", "rope-partial"])
def test_cached_decode_under_bf16_autocast_equals_the_full_forward(name):
    """RoPE tables follow q's dtype (bf16 under autocast), not the residual stream's (float32)."""
    model = TransformerLM(variant(name)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    from archlab.nn import attention_backends
    dtypes = set()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), \
            attention_backends.observe(lambda call: dtypes.add(call.q.dtype)):
        full = model(ids)
        cache = StaticKVCache(model.config, 2, 8)
        model(ids[:, :5], cache=cache)
        step = model(ids[:, 5:], cache=cache)
    assert dtypes == {torch.bfloat16}                    # queries rotated in bf16, as projected
    assert step.dtype == full.dtype == torch.bfloat16
    torch.testing.assert_close(step[:, 0].float(), full[:, 5].float(), rtol=2e-2, atol=2e-2)
