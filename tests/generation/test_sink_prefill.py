"""StreamingLLM mode's prefill (generate(..., sink_window=N)): a prompt longer than the SinkKVCache goes in one forward
(SinkKVCache.stretch) and decodes exactly as feeding it token by token; models the one forward cannot score (a position
bias, windows of their own) still go token by token, without an error."""
import pytest
import torch

import archlab
from archlab import TransformerLM
from archlab.generation import stepper as stepper_module
from archlab.generation.stepper import Stepper, stretches
from archlab.nn.kv_cache import SinkKVCache

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SINKS, WINDOW, PROMPT, NEW = 4, 12, 37, 10
# preset -> whether one forward can take the prompt: llama3 (GQA), qwen2.5 (GQA, q/k/v biases), gemma2 (local/global
# windows), bloom (ALiBi)
FAMILIES = {"llama3-8b": True, "qwen2.5-0.5b": True, "gemma2-2b": False, "bloom-176b": False}


def _model(name):
    cfg = archlab.presets.tiny(name).with_overrides({"init.std": 0.2, "seed": 0})   # no argmax near-ties
    return TransformerLM(cfg).eval()


def _fed_one_at_a_time(model, ids):                                       # (b, t) -> cache, (b, v) last logits
    """The reference: every prompt token fed alone to a fresh SinkKVCache, as decoding feeds them."""
    b, t = ids.shape
    cache = SinkKVCache(model.config, b, sink_tokens=SINKS, window=WINDOW)
    for i in range(t):
        logits = model(ids[:, i:i + 1], positions=torch.full((b, 1), i), cache=cache)[:, -1]
    return cache, logits


def _greedy_one_at_a_time(model, ids, n):                                 # (b, t) -> (b, t + n)
    cache, logits = _fed_one_at_a_time(model, ids)
    out = ids
    for _ in range(n):
        token = logits.argmax(-1, keepdim=True)                          # (b, 1)
        out = torch.cat((out, token), 1)
        logits = model(token, positions=torch.full_like(token, out.shape[1] - 1), cache=cache)[:, -1]
    return out


@pytest.mark.parametrize("chunk", [8, stepper_module.STRETCH])
@pytest.mark.parametrize("name", FAMILIES)
def test_sink_prefill_equals_feeding_the_prompt_token_by_token(name, chunk, monkeypatch):
    monkeypatch.setattr(stepper_module, "STRETCH", chunk)       # 8: the cache's capacity, then chunks of 8 (and 5)
    model = _model(name)
    assert stretches(model) == FAMILIES[name]
    ids = torch.randint(0, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with torch.no_grad():
        stepper = Stepper(model, ids, torch.ones_like(ids, dtype=torch.bool), NEW, sink_tokens=SINKS,
                          sink_window=WINDOW)
        logits = stepper.prefill()
    hook.remove()
    # the capacity in one forward, then chunks where the model allows it, else a forward per token
    past = PROMPT - SINKS - WINDOW
    assert len(calls) == 1 + (-(-past // chunk) if FAMILIES[name] else past)
    with torch.no_grad():
        ref_cache, ref_logits = _fed_one_at_a_time(model, ids)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert len(stepper.cache) == len(ref_cache) == PROMPT
    for layer, ref in zip(stepper.cache.layers, ref_cache.layers, strict=True):     # the sinks + the last WINDOW
        torch.testing.assert_close(layer.k, ref.k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.v, ref.v, atol=1e-4, rtol=1e-4)
    out = archlab.generate(model, ids, NEW, sink_tokens=SINKS, sink_window=WINDOW)
    with torch.no_grad():
        assert torch.equal(out, _greedy_one_at_a_time(model, ids, NEW))


def test_sink_prefill_within_the_capacity_is_one_ordinary_forward():
    """A prompt the cache holds whole evicts nothing: the same greedy tokens as the full cache's decoding."""
    model = _model("llama3-8b")
    ids = torch.randint(0, model.config.vocab_size, (1, SINKS + WINDOW - NEW))
    assert torch.equal(archlab.generate(model, ids, NEW, sink_tokens=SINKS, sink_window=WINDOW),
                       archlab.generate(model, ids, NEW))
