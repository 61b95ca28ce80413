"""Cached decoding runs through the model's own modules: given a DecodeSession (what generate passes to each
forward) every variant's decode-step logits equal the plain module forward's (padding, windows, GQA, biases
included); packed weights follow in-place weight changes; hooks fire at every step; the session travels with the
forward, so two threads decoding two models each use their own."""
import pytest
import torch
from torch import nn
from variants import VARIANTS, variant

import archlab
from archlab import TransformerLM
from archlab.generation.stepper import Stepper
from archlab.nn import fused
from archlab.nn.fused import DecodeSession
from archlab.nn.kv_cache import StaticKVCache

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _prompt(cfg, b=2, t=7):
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (b, t))
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, :3] = False                       # row 1 left-padded: masks are needed
    return ids, mask


def _decode_logits(model, ids, mask, fast, steps=12):
    with torch.inference_mode():
        st = Stepper(model, ids, mask, steps, fast=fast)
        logits, out = st.prefill(), []                # fast: the model's plan, direct module calls
        for i in range(steps):
            tokens = (torch.arange(ids.shape[0]) * 7 + i * 3) % model.config.vocab_size
            logits = st.step(tokens)
            out.append(logits)
    return st, torch.stack(out, 1)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_session_decode_steps_equal_the_plain_module_forward(name):
    """fast=True: packed weights (one DecodeSession) and direct module calls; fast=False: the plain forward."""
    model = TransformerLM(variant(name)).eval()
    ids, mask = _prompt(model.config)
    _, ref = _decode_logits(model, ids, mask, fast=False)
    _, got = _decode_logits(model, ids, mask, fast=True)
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


def test_hooks_inside_a_block_fire_at_every_cached_decode_step():
    model = TransformerLM(variant("qk-norm-per-head")).eval()      # decodes through its modules
    seen = {"attn_norm": 0, "mlp": 0}
    model.blocks[0].attn_norm.register_forward_hook(lambda *a: seen.__setitem__("attn_norm", seen["attn_norm"] + 1))
    model.blocks[1].mlp.register_forward_pre_hook(lambda *a: seen.__setitem__("mlp", seen["mlp"] + 1))
    prompt = torch.randint(0, model.config.vocab_size, (2, 5))
    cached = archlab.generate(model, prompt, max_new_tokens=6)
    assert seen == {"attn_norm": 6, "mlp": 6}                       # prefill + 5 cached steps
    assert torch.equal(cached, archlab.generate(model, prompt, max_new_tokens=6, use_cache=False))


def test_a_hook_that_changes_a_norm_changes_decoding():
    model = TransformerLM(variant("base")).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 4))
    plain = archlab.generate(model, prompt, max_new_tokens=8)
    handle = model.blocks[0].mlp_norm.register_forward_hook(lambda m, args, out: out * 30)
    hooked = archlab.generate(model, prompt, max_new_tokens=8)
    handle.remove()
    assert not torch.equal(plain, hooked)
    assert torch.equal(plain, archlab.generate(model, prompt, max_new_tokens=8))


def _session_modules(session: DecodeSession) -> set:
    """The modules a session holds decode weights for (keys: a module, a tuple of Linears, ("head", owner))."""
    keys = [part for key in session.packs for part in (key if isinstance(key, tuple) else (key,))]
    return {part for part in keys if isinstance(part, nn.Module)}


@pytest.mark.parametrize("worker_leaves_first", [True, False])
def test_two_threads_decode_two_models_each_in_its_own_session(worker_leaves_first):
    """A server's engine thread and a user's generate overlapping: while one thread is in the middle of its
    model's forward, the other decodes a hooked model. Each forward uses its own session's packed weights only
    (none lands in the other's), the hooked model's hooks fire, and both give
    the logits they give alone, whichever thread finishes first."""
    import threading

    model, other = TransformerLM(variant("base")).eval(), TransformerLM(variant("base")).eval()
    x = torch.randint(0, model.config.vocab_size, (1, 3))
    fired = []
    other.blocks[0].attn_norm.register_forward_hook(lambda *a: fired.append(1))
    with torch.no_grad():
        expected, expected_other = model(x), other(x)
    fired.clear()
    mine, theirs = DecodeSession(), DecodeSession()
    inside, release, left = threading.Event(), threading.Event(), threading.Event()
    mlp = model.blocks[1].mlp

    def paused(h, session=None):                           # the worker stops in the middle of its forward
        inside.set()
        release.wait(10)
        return type(mlp).forward(mlp, h, session)
    mlp.forward = paused                                   # an instance attribute: nn.Module.__call__ finds it
    got = {}

    def worker_loop():
        with torch.no_grad():
            got["worker"] = model(x, session=mine)
        left.set()

    worker = threading.Thread(target=worker_loop)
    worker.start()
    try:
        assert inside.wait(10)
        with torch.no_grad():
            got["first"] = other(x, session=theirs)       # hooked, and not the worker's model: hooks fire
            if worker_leaves_first:
                release.set()
                assert left.wait(10)
            got["second"] = other(x, session=theirs)
    finally:
        release.set()
        worker.join()
    assert fired == [1, 1]
    for key, want in (("worker", expected), ("first", expected_other), ("second", expected_other)):
        torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-5)
    assert _session_modules(mine) and _session_modules(mine) <= set(model.modules())
    assert _session_modules(theirs) and _session_modules(theirs) <= set(other.modules())


def test_unpadded_rows_decode_without_building_a_mask(monkeypatch):
    """The Stepper gives an unpadded batch positions=None: steps skip the mask predicate and its host sync;
    a padded batch still masks its padding."""
    from archlab.nn.masks import MaskSpec

    model = TransformerLM(variant("base")).eval()
    ids, mask = _prompt(model.config)
    built = []
    allows = MaskSpec.allows
    monkeypatch.setattr(MaskSpec, "allows", lambda *a: built.append(1) or allows(*a))
    for padded in (False, True):
        with torch.inference_mode():
            st = Stepper(model, ids, mask if padded else torch.ones_like(mask), 3)
            st.prefill()
            built.clear()
            st.step(torch.zeros(2, dtype=torch.long))
        assert st.implied is not padded and bool(built) is padded


def test_cached_generate_agrees_with_uncached():
    model = TransformerLM(variant("gqa")).eval()
    prompt = torch.randint(0, 97, (3, 5))
    cached = archlab.generate(model, prompt, max_new_tokens=10)
    uncached = archlab.generate(model, prompt, max_new_tokens=10, use_cache=False)
    assert torch.equal(cached, uncached)


# ---- packed weights, module by module ----
def _module_decode_logits(model, ids, mask, pack: bool, steps=12):
    """Cached decode through the model's forward, given a session that checked no model (packed weights, every
    call checked for hooks) or none."""
    session = DecodeSession() if pack else None
    with torch.inference_mode():
        st = Stepper(model, ids, mask, steps, fast=False)
        st.prefill()
        out = []
        for i in range(steps):
            tokens = (torch.arange(ids.shape[0]) * 7 + i * 3) % model.config.vocab_size
            out.append(model(tokens[:, None], positions=st.next_pos, cache=st.cache, session=session)[:, -1])
            st.next_pos = st.next_pos + 1
    return torch.stack(out, 1)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_module_forward_through_packed_weights_equals_the_plain_forward(name):
    model = TransformerLM(variant(name)).eval()
    ids, mask = _prompt(model.config)
    plain = _module_decode_logits(model, ids, mask, pack=False)
    packed = _module_decode_logits(model, ids, mask, pack=True)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)


def test_packed_weights_only_in_a_session_and_never_under_gradients():
    model = TransformerLM(variant("qk-norm-per-head")).eval()
    x = torch.randint(0, model.config.vocab_size, (1, 3))
    plan = model.decode_plan()
    with torch.no_grad():
        model(x)                                         # a user's no-grad forward: no weight copies
    assert len(plan.packs) == 0
    session = fused.decode_session(model)
    assert session.plan is plan
    model(x, session=session).sum().backward()           # gradients: the plain Linears, even in a session
    assert len(plan.packs) == 0 and not session.packs
    with torch.no_grad():
        model(x, session=session)
    assert model.blocks[0].attn.q_proj in plan.packs


def test_module_packed_weights_follow_in_place_changes_and_hooks_see_every_step():
    model = TransformerLM(variant("qk-norm-per-head")).eval()
    ids, mask = _prompt(model.config)
    _module_decode_logits(model, ids, mask, pack=True)
    with torch.no_grad():
        model.blocks[0].attn.v_proj.weight.mul_(2.0)
        model.lm_head.weight.add_(0.1) if model.lm_head.weight is not None else model.embed.weight.add_(0.1)
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


