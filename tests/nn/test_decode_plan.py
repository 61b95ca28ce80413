"""A model's decode plan (nn/fused.DecodePlan): built by the model, held by the sessions that decode it and
released with it. Greedy tokens and logits equal the plain module path for several families; the direct call path
skips nn.Module.__call__ without changing any module or class; decoding leaves nothing at module level; two models
decoding interleaved each use their own plan."""
import copy
import gc
import sys
import weakref

import pytest
import torch
from torch import nn
from variants import variant

import archlab
from archlab import TransformerLM
from archlab.generation.stepper import Stepper
from archlab.nn import fused

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# GQA (LLaMA 3), sandwich norms + softcaps + sqrt(d) embeddings (Gemma 2), routed experts (Mixtral),
# QK-norm (Qwen 3), post-sublayer norms (OLMo 2), learned positions and biases (GPT-2)
FAMILIES = ["llama3-8b", "gemma2-2b", "mixtral-8x7b", "qwen3-8b", "olmo2-7b", "gpt2"]


def _model(preset: str, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(archlab.presets.tiny(preset)).eval()


def _greedy(model, prompt, fast: bool, steps: int = 10):
    """Greedy tokens and the logits each was chosen from, through a Stepper (fast: the plan's session)."""
    with torch.inference_mode():
        st = Stepper(model, prompt, torch.ones_like(prompt, dtype=torch.bool), steps, fast=fast)
        logits, tokens, seen = st.prefill(), [], []
        for _ in range(steps):
            seen.append(logits)
            tokens.append(logits.argmax(-1))
            logits = st.step(tokens[-1])
    return torch.stack(tokens, 1), torch.stack(seen, 1)


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_and_logits_through_the_plan_equal_the_plain_path(preset, batch):
    model = _model(preset)
    prompt = torch.randint(0, model.config.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(1))
    plain_tokens, plain_logits = _greedy(model, prompt, fast=False)
    tokens, logits = _greedy(model, prompt, fast=True)
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-5)
    assert len(model.decode_plan().packs) > 0          # the fast path did run through packed weights


def test_encoder_decoder_generates_the_same_through_its_plan():
    torch.manual_seed(0)
    model = archlab.build_model(archlab.presets.tiny("t5-11b")).eval()
    source = torch.randint(0, model.config.vocab_size, (2, 7))
    plain = archlab.generate(model, source, max_new_tokens=8, fast_decode=False)
    assert torch.equal(archlab.generate(model, source, max_new_tokens=8), plain)
    assert len(model.decode_plan().packs) > 0


def _refuse_module_call(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("went through nn.Module.__call__")
    monkeypatch.setattr(nn.Module, "_call_impl", refuse)


def _module_state(model) -> list:
    """Each module's class and instance attributes: what a class swap or an instance patch would change."""
    return [(type(m), sorted(vars(m))) for m in model.modules()]


def test_generate_calls_modules_straight_into_forward_and_changes_no_module():
    model = TransformerLM(variant("gqa")).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 4))
    expected = archlab.generate(model, prompt, max_new_tokens=6, fast_decode=False)
    before = _module_state(model)
    with pytest.MonkeyPatch.context() as patch:
        _refuse_module_call(patch)
        assert torch.equal(archlab.generate(model, prompt, max_new_tokens=6), expected)
        tokens = archlab.generation.stream(model, prompt, max_new_tokens=6)
        next(tokens)
        assert _module_state(model) == before             # mid-stream: every module and class as it was
        tokens.close()
        with pytest.raises(AssertionError, match="nn.Module.__call__"):
            archlab.generate(model, prompt, max_new_tokens=2, fast_decode=False)   # the plain path: modules
    assert _module_state(model) == before


@pytest.mark.parametrize("hook", ["module", "global"])
def test_a_hook_anywhere_turns_the_direct_path_off_and_fires(hook):
    model = TransformerLM(variant("base")).eval()
    fired = []
    if hook == "module":
        handle = model.blocks[1].mlp.register_forward_pre_hook(lambda *a: fired.append(1))
    else:
        handle = nn.modules.module.register_module_forward_pre_hook(lambda *a: fired.append(1))
    try:
        assert fused.decode_session(model).views is None
        archlab.generate(model, torch.randint(0, model.config.vocab_size, (1, 3)), max_new_tokens=4)
    finally:
        handle.remove()
    assert fired and fused.decode_session(model).views == {}


def _archlab_containers() -> dict:
    """Every dict, list, set and weak mapping held at module level by an imported archlab module."""
    kinds = (dict, list, set, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)
    return {(name, attr): value for name, mod in list(sys.modules.items())
            if name == "archlab" or name.startswith("archlab.")
            for attr, value in vars(mod).items() if isinstance(value, kinds)}


def _holds(container, objects: set[int]) -> bool:
    items = container.items() if hasattr(container, "items") else ((x, None) for x in container)
    return any(id(k) in objects or id(v) in objects for k, v in items)


def test_decoding_leaves_no_module_level_state():
    """A second model decoded (generate, a stream, the server's session) adds nothing to any archlab module's
    globals and none of them refers to its modules: its plan is its own."""
    warm = TransformerLM(variant("gqa")).eval()   # the first decode of a config may import and make constants
    prompt = torch.randint(0, warm.config.vocab_size, (2, 4))
    archlab.generate(warm, prompt, max_new_tokens=4)
    before = {key: (id(value), len(value)) for key, value in _archlab_containers().items()}
    model = TransformerLM(variant("gqa")).eval()
    archlab.generate(model, prompt, max_new_tokens=4)
    stream = archlab.generation.stream(model, prompt, max_new_tokens=4)
    next(stream)
    stream.close()
    session = fused.decode_session(model)
    with torch.no_grad():
        model(prompt, session=session)
    after = _archlab_containers()
    assert {key: (id(value), len(value)) for key, value in after.items() if key in before} == before
    ours = {id(m) for m in model.modules()} | {id(p) for p in model.parameters()} | {id(model.decode_plan())}
    assert not [key for key, value in after.items() if _holds(value, ours)]
    assert not hasattr(fused, "_PACKED") and not hasattr(fused, "_DIRECT")


def test_the_plan_is_the_models_and_is_released_with_it():
    model = TransformerLM(variant("gqa")).eval()
    archlab.generate(model, torch.randint(0, model.config.vocab_size, (1, 4)), max_new_tokens=4)
    plan = model.decode_plan()
    assert plan is model.decode_plan() and model.blocks[0].attn.q_proj in plan.packs
    assert not any("plan" in key for key in model.state_dict())   # no checkpoint key
    twin = copy.deepcopy(model)                                     # a copy starts its own, empty plan
    assert twin.decode_plan() is not plan and len(twin.decode_plan().packs) == 0
    model_ref, plan_ref = weakref.ref(model), weakref.ref(plan)
    del model, plan
    gc.collect()
    assert model_ref() is None and plan_ref() is None


def test_a_replaced_weight_is_repacked_and_the_old_copy_dropped():
    model = TransformerLM(variant("base")).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 4))
    archlab.generate(model, prompt, max_new_tokens=3)
    plan = model.decode_plan()
    old = model.blocks[0].mlp.down_proj
    model.blocks[0].mlp.down_proj = nn.Linear(old.in_features, old.out_features, bias=False)
    expected = archlab.generate(model, prompt, max_new_tokens=5, fast_decode=False)
    assert torch.equal(archlab.generate(model, prompt, max_new_tokens=5), expected)
    del old
    gc.collect()
    assert model.blocks[0].mlp.down_proj in plan.packs
    assert all(key in set(model.modules()) for key in plan.packs.keys())   # the replaced Linear's copy went with it


def test_two_models_decoding_interleaved_do_not_interfere():
    """Two families' streams advanced alternately, token by token: each gives its plain greedy tokens, and each
    model's plan holds its own modules only."""
    first, second = _model("llama3-8b", seed=1), _model("gemma2-2b", seed=2)
    prompt = torch.randint(0, 256, (2, 5))
    expected = [archlab.generate(m, prompt, max_new_tokens=8, fast_decode=False) for m in (first, second)]
    streams = [archlab.generation.stream(m, prompt, max_new_tokens=8) for m in (first, second)]
    got: list[list] = [[], []]
    for _ in range(8):
        for i, stream in enumerate(streams):
            got[i].append(next(stream))
    for i, model in enumerate((first, second)):
        tokens = torch.cat([torch.as_tensor(t).reshape(2, -1) for t in got[i]], 1)
        assert torch.equal(tokens, expected[i][:, -8:])
        assert set(model.decode_plan().packs.keys()) <= set(model.modules())
