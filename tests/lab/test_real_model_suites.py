"""The real-model suites' measurements on a tiny random model (the real figures come from SmolLM2: docs/lab_report):
the model is left as it was, the quantization schemes are the ones nn/quantize and nn/int8 define, the full cache's
one forward equals decoding through a full cache, and a cache that evicts nothing scores as the full one."""
from __future__ import annotations

import copy

import pytest
import torch

import archlab
from archlab.eval.perplexity import perplexity
from archlab.lab import real_model
from archlab.nn.int8 import quantize_int8
from archlab.nn.kv_cache import SinkKVCache, StaticKVCache


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = archlab.presets.tiny("llama2-7b").with_overrides({"max_seq_len": 128})
    model = archlab.TransformerLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (97,))
    return model, ids


def test_quantization_measures_each_scheme_and_restores_the_model(tiny):
    model, ids = tiny
    with torch.no_grad():
        before = model(ids[None, :16])
    ppl = {s: real_model.quantization(model, ids, scheme=s, seq_len=32)["ppl"] for s in real_model.SCHEMES}
    assert ppl["float"] == pytest.approx(perplexity(model, ids, 32))
    assert ppl["int8_weight_only"] == pytest.approx(perplexity(quantize_int8(copy.deepcopy(model)), ids, 32))
    assert all(ppl[k] != ppl["float"] for k in ("w8a8_per_tensor", "w8a8_per_token", "int8_weight_only"))
    # a random tiny model has no |x| >= 6: the outlier split is per-token W8A8 on every column
    assert ppl["outlier_split"] == pytest.approx(ppl["w8a8_per_token"], rel=1e-6)
    with torch.no_grad():
        assert torch.equal(model(ids[None, :16]), before)                  # forwards restored
    with pytest.raises(ValueError, match="scheme"):
        real_model.quantization(model, ids, scheme="int4")


def test_the_full_caches_forward_equals_decoding_through_a_full_cache(tiny):
    model, ids = tiny
    batch = ids[:90].view(2, 45)
    with torch.no_grad():
        one_pass = real_model._token_nll(model, batch, None)
        decoded = real_model._token_nll(model, batch, StaticKVCache(model.config, 2, 45), stepwise=True)
    assert one_pass.shape == decoded.shape == (2, 44)
    torch.testing.assert_close(one_pass, decoded, atol=1e-4, rtol=1e-4)


def test_streaming_caches_agree_until_something_is_evicted(tiny):
    model, ids = tiny
    full = real_model.streaming(model, ids, cache="full", window=8, scored=10, rows=3)
    assert full["scored_tokens"] == 30
    window = real_model.streaming(model, ids, cache="window", window=8, scored=10, rows=3)["ppl"]
    sinks = real_model.streaming(model, ids, cache="sinks", window=8, scored=10, rows=3)["ppl"]
    assert len({full["ppl"], window, sinks}) == 3
    # the scored targets all come after an eviction: their nll differs from the full cache's at the first one already
    row = ids[:19][None]
    with torch.no_grad():
        nll = real_model._token_nll(model, row, SinkKVCache(model.config, 1, sink_tokens=0, window=8), stepwise=True)
        ref = real_model._token_nll(model, row, None)
    torch.testing.assert_close(nll[:, :8], ref[:, :8], atol=1e-4, rtol=1e-4)    # targets 1..8: nothing evicted
    assert not torch.allclose(nll[:, 8], ref[:, 8], atol=1e-4)                 # target 9: token 0 is gone
    with pytest.raises(ValueError, match="rows"):
        real_model.streaming(model, ids, cache="full", window=64, scored=64, rows=2)


@pytest.mark.parametrize("cache, sinks", [("window", 4), ("sinks", 4), ("sinks", 1)])
def test_streaming_scores_in_one_forward_what_decoding_token_by_token_scores(tiny, cache, sinks):
    model, ids = tiny
    window, scored, rows = 9, 12, 3                     # targets 1 .. 21: the cache fills at 9 and evicts from 10 on
    kept = sinks if cache == "sinks" else 0

    def made():
        return SinkKVCache(model.config, rows, sink_tokens=kept, window=window - kept)
    batch = ids[:rows * (window + 1 + scored)].view(rows, -1)
    with torch.no_grad():
        once = real_model._token_nll(model, batch, made())
        stepwise = real_model._token_nll(model, batch, made(), stepwise=True)
        past = real_model._token_nll(model, batch, made(), start=window)
    torch.testing.assert_close(once, stepwise, atol=1e-5, rtol=1e-5)           # every target, the boundary included
    torch.testing.assert_close(past, stepwise[:, window:], atol=1e-5, rtol=1e-5)
    measured = real_model.streaming(model, ids, cache=cache, window=window, scored=scored, rows=rows, sinks=sinks)
    assert measured["ppl"] == pytest.approx(float(stepwise[:, window:].mean().exp()), rel=1e-4)


def test_massive_activation_measure_zeroes_what_it_found(tiny):
    model, ids = tiny
    none = real_model.massive_activations(model, ids, zeroed="none", seq_len=32)
    assert none["ppl"] == pytest.approx(perplexity(model, ids, 32)) and none["n_zeroed"] == 0
    assert len(none["ratios"]) == model.config.n_layers
    random = real_model.massive_activations(model, ids, zeroed="random", seq_len=32)
    assert len(random["ppl_draws"]) == real_model.RANDOM_DRAWS and random["n_zeroed"] == none["n_massive"]
    assert random["peak_ratio"] == none["peak_ratio"]                    # the same probe
