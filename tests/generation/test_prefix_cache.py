"""archlab.generation.PrefixCache: a KV cache kept across generate calls prefills only what a prompt adds to the
tokens it holds, and decodes exactly what a fresh prefill decodes: turns that extend the conversation, a turn that
changes earlier text (a template rewriting history, dropped turns), sampling with a seed, speculative decoding."""
import pytest
import torch

import archlab
from archlab import TransformerLM
from archlab.generation import PrefixCache

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _model(name: str) -> TransformerLM:
    cfg = archlab.presets.tiny(name, vocab_size=128, window=6, max_seq_len=128)
    return TransformerLM(cfg.with_overrides({"init.std": 0.2, "seed": 0})).eval()


@pytest.mark.parametrize("family", ["llama3-8b", "gpt2", "gemma2-2b"])
def test_turns_through_the_cache_equal_fresh_prefills(family):
    model = _model(family)
    g = torch.Generator().manual_seed(0)
    cache = PrefixCache()
    history = torch.randint(0, 128, (10,), generator=g).tolist()
    held = 0
    for turn in range(5):
        out = archlab.generate(model, history, 8, prefix_cache=cache)
        assert torch.equal(out, archlab.generate(model, history, 8)), turn
        if turn == 3:                          # the turn after an earlier token changed: prefilled from there on
            assert cache.reused == 3
        elif turn:                             # the last prompt and the answer's fed tokens are held
            assert cache.reused == held and cache.prefilled == len(history) - held
        assert cache.ids == out.tolist()[:-1]  # every token fed, the last new one not yet
        held = len(out) - 1
        history = out.tolist() + torch.randint(0, 128, (5,), generator=g).tolist()
        if turn == 2:
            history[3] = (history[3] + 1) % 128


def test_cached_prefill_logits_equal_a_fresh_prefill():
    model = _model("gemma2-2b")                # windows and softcaps: the cropped cache keeps every slot
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = PrefixCache()
    archlab.generate(model, ids[:, :25], 6, prefix_cache=cache)
    from archlab.generation.stepper import Stepper
    with torch.inference_mode():
        continued = Stepper(model, ids, torch.ones_like(ids, dtype=torch.bool), 4, prefix=cache).prefill()
        fresh = Stepper(model, ids, torch.ones_like(ids, dtype=torch.bool), 4).prefill()
    assert cache.reused == 25 and cache.prefilled == 15
    torch.testing.assert_close(continued, fresh, rtol=0, atol=1e-4)


def test_sampling_and_speculation_through_the_cache():
    model = _model("llama3-8b")
    cache = PrefixCache()
    first = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    out = archlab.generate(model, first, 10, temperature=0.8, top_k=20, seed=3, prefix_cache=cache)
    assert torch.equal(out, archlab.generate(model, first, 10, temperature=0.8, top_k=20, seed=3))
    second = out.tolist() + first[:6]
    spec = archlab.generate(model, second, 12, draft="prompt_lookup", draft_tokens=4, prefix_cache=cache)
    assert torch.equal(spec, archlab.generate(model, second, 12))
    assert cache.reused == len(out) - 1
    assert cache.ids == spec.tolist()[:len(cache.ids)] and len(cache.ids) == len(spec) - 1   # drafts rolled back


def test_another_model_starts_afresh_and_bad_uses_are_refused():
    a, b = _model("llama3-8b"), _model("gpt2")
    cache = PrefixCache()
    ids = [1, 2, 3, 4, 5]
    archlab.generate(a, ids, 4, prefix_cache=cache)
    assert torch.equal(archlab.generate(b, ids, 4, prefix_cache=cache), archlab.generate(b, ids, 4))
    assert cache.reused == 0
    with pytest.raises(ValueError, match="one unpadded row"):
        archlab.generate(a, [[1, 2, 3], [4, 5]], 4, prefix_cache=cache)
    with pytest.raises(ValueError, match="prefix_cache"):
        archlab.generate(a, ids, 4, num_beams=2, prefix_cache=cache)


def test_a_continued_prefill_turns_its_mask_into_sdpas_form_once_for_every_layer():
    """A prefill over held keys needs a (t, s) mask; SDPA would turn the bool mask into its additive form in every
    layer: it is turned once per forward (nn/attention_backends._additive), and the output is SDPA's on the bool."""
    import torch.nn.functional as F

    from archlab.nn import attention_backends
    model = _model("llama3-8b")
    cache = PrefixCache()
    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    archlab.generate(model, ids[:20], 1, prefix_cache=cache)
    calls: list = []
    with attention_backends.observe(calls.append):
        archlab.generate(model, ids, 1, prefix_cache=cache)
    prefill = [c for c in calls if c.q.shape[2] == 10]
    assert len(prefill) == model.config.n_layers and attention_backends.choose(prefill[0]).name == "sdpa"
    shared = prefill[0].inputs.shared
    assert len([key for key in shared if key[0] == "additive"]) == 1
    with torch.no_grad():
        mask, _ = prefill[-1].dense()
        want = F.scaled_dot_product_attention(prefill[-1].q, prefill[-1].k, prefill[-1].v, attn_mask=mask,
                                              scale=prefill[-1].scale, enable_gqa=True)
        assert torch.equal(attention_backends.run(prefill[-1])[0], want)


def _long_model(name: str) -> TransformerLM:
    cfg = archlab.presets.tiny(name, vocab_size=128, window=6, max_seq_len=1024)
    return TransformerLM(cfg.with_overrides({"init.std": 0.2, "seed": 0})).eval()


def _growing_conversation(model, compile: bool = False, ahead: bool = False) -> list[int]:
    """Five turns of ~100 tokens through one PrefixCache, each equal to a fresh prefill's tokens; the capacity after
    each turn. ahead: after each turn the cache grows for a next turn as long (PrefixCache.ahead, as the chat does),
    and no turn after the first grows inside its own call."""
    g = torch.Generator().manual_seed(5)
    cache = PrefixCache()
    history = torch.randint(0, 128, (20,), generator=g).tolist()
    sizes = []
    for turn in range(5):
        before = None if cache.cache is None else cache.cache.max_len
        out = archlab.generate(model, history, 8, prefix_cache=cache, compile=compile)
        assert torch.equal(out, archlab.generate(model, history, 8)), turn
        assert cache.reused == (0 if turn == 0 else len(history) - 1 - 100)
        assert cache.cache is not None
        if ahead:
            assert turn == 0 or cache.cache.max_len == before, turn          # grown before the call, not in it
            cache.ahead(100 + 8)
        sizes.append(cache.cache.max_len)
        history = out.tolist() + torch.randint(0, 128, (100,), generator=g).tolist()
    return sizes


@pytest.mark.parametrize("family", ["llama3-8b", "gemma2-2b"])
def test_the_cache_grows_by_doubling_and_turns_across_growths_equal_fresh_prefills(family):
    """A first turn holds what it needs (128 slots, not the model's 1,024); turns that cross 128, 256 and 512 copy
    the held keys into a doubled cache and decode exactly what a fresh prefill decodes (windows included)."""
    assert _growing_conversation(_long_model(family)) == [128, 256, 256, 512, 512]


def test_growing_ahead_between_turns_keeps_the_growth_out_of_the_next_call_and_its_tokens_equal():
    """PrefixCache.ahead after each turn: the growths across 256 and 512 happen between calls (the cache holds what a
    next turn as long needs), every turn still equal to a fresh prefill's tokens."""
    assert _growing_conversation(_long_model("llama3-8b"), ahead=True) == [256, 256, 512, 512, 1024]
    cache = PrefixCache()
    cache.ahead(100)                                   # nothing held yet: nothing to grow
    assert cache.cache is None


def test_capacity_doubles_up_to_the_context():
    from archlab.generation.prefix import capacity
    assert [capacity(n, 8192) for n in (1, 128, 129, 300, 8000)] == [128, 128, 256, 512, 8192]
    assert capacity(300, 8192, have=512) == 512 and capacity(600, 8192, have=512) == 1024
    assert capacity(5000, 3000) == 3000 and capacity(10, 64) == 64


@pytest.mark.slow
def test_the_compiled_step_decodes_through_a_growing_cache():
    """The compiled decode step (its capacity dimension dynamic) reads the grown buffers: every turn's tokens equal
    a fresh eager prefill's, one graph for all capacities."""
    model = _long_model("llama3-8b")
    assert _growing_conversation(model, compile=True) == [128, 256, 256, 512, 512]
    step = model.decode_plan().step
    assert step is not None and step.failed is None and len(step.graphs) == 1
