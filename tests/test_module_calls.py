"""archlab.nn.calls.call: a child module's forward without nn.Module.__call__'s bookkeeping, where nothing
can tell the difference; every hook still fires, in training and during cached decoding."""
import pytest
import torch
from torch import nn
from variants import variant

import archlab
from archlab import TransformerLM
from archlab.nn.calls import call

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _refuse_call_impl(monkeypatch):
    """Make nn.Module.__call__ raise: whatever still works did not go through it."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("went through nn.Module.__call__")
    monkeypatch.setattr(nn.Module, "_call_impl", refuse)


def test_call_without_hooks_runs_forward_directly(monkeypatch):
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    expected = lin(x)
    _refuse_call_impl(monkeypatch)
    torch.testing.assert_close(call(lin, x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["forward", "pre", "global"])
def test_call_with_a_hook_goes_through_module_call(kind):
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    if kind == "forward":
        handle = lin.register_forward_hook(lambda m, args, out: out * 0)
    elif kind == "pre":
        handle = lin.register_forward_pre_hook(lambda m, args: (args[0] * 0,))
    else:
        handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: out * 0)
    try:
        out = call(lin, x)
    finally:
        handle.remove()
    expected = torch.zeros(2, 3) if kind == "forward" or kind == "global" else lin.bias.expand(2, 3)
    torch.testing.assert_close(out, expected)


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
    with torch.no_grad():
        plain = model(prompt)
        handle = model.blocks[0].mlp_norm.register_forward_hook(lambda m, args, out: out * 3)
        hooked = model(prompt)
        handle.remove()
    assert not torch.allclose(plain, hooked)
