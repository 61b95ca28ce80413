"""The compiled decode step (archlab.nn.compiled_step) against the eager step: the traced function run eagerly over
the whole-buffer cache (fast), the fallbacks, and the compiled graph itself (slow: inductor compiles for ~30 s)."""
import contextlib
import gc
import warnings
import weakref

import pytest
import torch

import archlab
from archlab.generation.stepper import Stepper
from archlab.nn.attention_backends import forced
from archlab.nn.compiled_step import CompiledStep, compilable
from archlab.nn.int8 import quantize_int8
from archlab.nn.kv_cache import StaticKVCache


def _model(**overrides):
    torch.manual_seed(0)
    cfg = archlab.presets.tiny("llama2-7b").with_overrides(overrides)
    return archlab.TransformerLM(cfg).eval()


def _prompt(model, b=2, t=7):
    ids = torch.randint(0, model.config.vocab_size, (b, t))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :3] = False                                        # row 1 left-padded
    return ids, mask


@pytest.mark.parametrize("backend", [None, "decode"], ids=["chosen", "decode"])
@pytest.mark.parametrize("overrides", [{}, {"attention.window": 4, "attention.layer_pattern": "LG"}],
                         ids=["global", "window"])
@torch.inference_mode()
def test_slot_writes_step_equals_the_eager_step(overrides, backend):
    """The function that is compiled, run eagerly: every slot returned (empty ones at -1), written at a tensor
    slot. Its logits equal the eager decode's step by step, padded rows and sliding windows included; also with
    its attention on the decode backend, which a compiled step chooses (masked empty slots and padding)."""
    model = _model(**overrides)
    ids, mask = _prompt(model)
    pos = torch.where(mask, mask.long().cumsum(-1) - 1, -1)
    plain = StaticKVCache(model.config, 2, 20)                # the eager path: a rolling buffer where windowed
    whole = StaticKVCache(model.config, 2, 20, rolling=False)
    model(ids, positions=pos, cache=plain)
    model(ids, positions=pos, cache=whole)
    step = CompiledStep(model)
    tok, nxt = ids[:, -1:], pos[:, -1:] + 1
    for _ in range(10):                                       # past the window of 4
        ref = model(tok, positions=nxt, cache=plain)[:, -1]
        with forced(backend):
            got = step.eager(*step.arguments(tok, nxt, whole))   # the slots read: 16, then all but the last
        whole.advance(1)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        tok, nxt = ref.argmax(-1, keepdim=True), nxt + 1
    assert len(whole) == len(plain) == 17


@torch.inference_mode()
def test_a_step_into_the_last_slot_runs_eagerly():
    """The graph is traced for fewer slots than the cache holds (a view): a step that fills a cache's last slot
    (a cache without the generation's spare slot) runs the same function eagerly, equal to the eager decode."""
    model = _model()
    ids, mask = _prompt(model)
    pos = torch.where(mask, mask.long().cumsum(-1) - 1, -1)
    plain, full = StaticKVCache(model.config, 2, 8), StaticKVCache(model.config, 2, 8, rolling=False)
    model(ids, positions=pos, cache=plain)
    model(ids, positions=pos, cache=full)
    step = CompiledStep(model)

    def traced(*args):
        raise AssertionError("the graph ran")
    step.compiled = traced
    tok, nxt = ids[:, -1:], pos[:, -1:] + 1
    torch.testing.assert_close(step(tok, nxt, full, first=True), model(tok, positions=nxt, cache=plain)[:, -1],
                               atol=1e-5, rtol=1e-5)
    assert len(full) == 8 and step.failed is None


def test_stale_after_a_weight_changes_in_place():
    model = _model()
    step = CompiledStep(model)
    assert not step.stale(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(2) if hasattr(model.lm_head, "weight") else next(model.parameters()).mul_(2)
    assert step.stale(model)


def test_a_compile_failure_decodes_eagerly_with_one_warning():
    model = _model()
    ids, mask = _prompt(model)
    ref = archlab.generate(model, ids, 6, attention_mask=mask)
    step = model.decode_plan().step = CompiledStep(model)

    def broken(*args):
        raise RuntimeError("no compiler here")
    step.compiled = broken
    with pytest.warns(UserWarning, match="failed to compile.*no compiler here"):
        out = archlab.generate(model, ids, 6, attention_mask=mask, compile=True)
    assert torch.equal(out, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                         # once per model: the next call stays quiet
        assert torch.equal(archlab.generate(model, ids, 6, attention_mask=mask, compile=True), ref)


def test_what_the_compiled_step_does_not_take_decodes_eagerly():
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    assert compilable(model) is None
    assert "floating-point" in compilable(quantize_int8(_model()))
    ref = archlab.generate(model, ids, 5, sink_window=8)
    with pytest.warns(UserWarning, match="decoding eagerly"):
        out = archlab.generate(model, ids, 5, sink_window=8, compile=True)
    assert torch.equal(out, ref)
    with pytest.warns(UserWarning, match="decoding eagerly"):
        assert torch.equal(archlab.generate(model, ids, 5, use_cache=False, compile=True),
                           archlab.generate(model, ids, 5, use_cache=False))


@pytest.mark.slow
def test_compiled_decode_equals_eager_and_does_not_recompile_for_another_length():
    """Inductor's graph: logits within float tolerance of the eager step, greedy tokens identical (a left-padded
    batch, then another prompt length and more new tokens through the same graph), beams and a chat's kept cache
    too."""
    model = _model(max_seq_len=256)
    ids, mask = _prompt(model)
    # as generate does: the cache made outside inference mode, the steps inside (a graph traced over inference
    # tensors is another graph: dynamo guards on the kind of tensor)
    eager, compiled = (Stepper(model, ids, mask, 8, compile=c) for c in (False, True))
    with torch.inference_mode():
        a, b = eager.prefill(), compiled.prefill()
        for _ in range(6):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
            tok = a.argmax(-1)
            a, b = eager.step(tok), compiled.step(tok)
    step = model.decode_plan().step
    assert step is not None and step.failed is None and len(step.graphs) == 1
    seconds = step.compile_seconds
    assert seconds > 0
    with torch._dynamo.config.patch(error_on_recompile=True):    # a recompile fails the step (step.failed)
        for t, new in ((7, 12), (4, 60), (3, 2)):   # 6 to 65 slots (one spare), 5 to 64 of them read
            got = archlab.generate(model, ids[:, -t:], new, attention_mask=mask[:, -t:], compile=True)
            assert torch.equal(got, archlab.generate(model, ids[:, -t:], new, attention_mask=mask[:, -t:]))
    assert step.failed is None and len(step.graphs) == 1 and step.compile_seconds == seconds
    beams = ids[1:, 3:]                                   # one prompt, 2 beams: the batch-2 graph again
    assert torch.equal(archlab.generate(model, beams, 6, num_beams=2, compile=True),
                       archlab.generate(model, beams, 6, num_beams=2))
    assert len(step.graphs) == 1
    caches = {c: archlab.generation.PrefixCache() for c in (False, True)}    # a chat's turns: the cache kept
    turn = ids[1:, :4]
    for _ in range(2):
        outs = [archlab.generate(model, turn, 10, prefix_cache=caches[c], compile=c) for c in (False, True)]
        assert torch.equal(outs[0], outs[1])
        turn = torch.cat((outs[0], ids[1:, 4:]), dim=1)
    assert caches[True].reused == caches[False].reused > 0
    assert step.failed is None
    one = Stepper(model, turn, torch.ones_like(turn, dtype=torch.bool), 4, compile=True)   # batch 1, as a chat
    with torch.inference_mode():
        tok = one.prefill().argmax(-1)
        one.step(tok)
        with torch.profiler.profile() as prof:
            one.step(tok)
    ran = {event.key for event in prof.key_averages()}
    assert any(name.startswith("## Call CompiledFxGraph") for name in ran), ran     # the compiled graph ran
    # no copy of a matmul's (1, d) input (a stride-0 view), no extern SDPA call: attention is one fused kernel
    assert not any("clone" in name or "copy" in name or "scaled_dot_product" in name for name in ran), ran


@contextlib.contextmanager
def _no_cycle_collector():
    """Only reference counts free anything inside (the collector's pending cycles gathered first)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_a_model_holding_its_compiled_step_is_freed_without_the_cycle_collector():
    """The plan holds the compiled step, which holds the model and the plan weakly: `del model` frees the model
    and its weights by reference counts alone."""
    model = _model()
    plan = model.decode_plan()
    step = plan.step = CompiledStep(model, plan)
    whole = StaticKVCache(model.config, 1, 8, rolling=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 1))
    with torch.inference_mode():
        step.eager(*step.arguments(ids, torch.zeros_like(ids), whole))          # the session's packs filled
    assert step.session.packs
    del plan, step
    refs = [weakref.ref(model), weakref.ref(next(model.parameters()))]
    with _no_cycle_collector():
        del model
        assert all(r() is None for r in refs)


@pytest.mark.slow
def test_a_model_that_decoded_through_its_compiled_graph_is_freed_without_the_cycle_collector():
    """As above after a compiled generation: nothing dynamo keeps holds the model or its weights."""
    model = _model(max_seq_len=64)
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    assert torch.equal(archlab.generate(model, ids, 4, compile=True), archlab.generate(model, ids, 4))
    assert model.decode_plan().step.graphs
    refs = [weakref.ref(model), weakref.ref(next(model.parameters()))]
    with _no_cycle_collector():
        del model
        assert all(r() is None for r in refs)


def test_compile_with_a_draft_says_the_checks_decode_eagerly():
    """With a draft most forwards check k + 1 tokens, which the one-token compiled step does not take: `generate
    --compile --draft prompt-lookup` compiled nothing on a repetitive text and said nothing."""
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (1, 5)).repeat(1, 3)
    ref = archlab.generate(model, ids, 8)
    step = model.decode_plan().step = CompiledStep(model)
    step.compiled = step.eager                                 # the traced function, run eagerly (no inductor)
    with pytest.warns(UserWarning, match="the forwards that check the drafts run eagerly"):
        out = archlab.generate(model, ids, 8, draft="prompt_lookup", draft_tokens=3, compile=True)
    assert torch.equal(out, ref)
