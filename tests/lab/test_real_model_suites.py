"""The real-model suites' machinery on a tiny random model (the real figures come from SmolLM2: docs/lab_report):
the model is left as it was, the quantization schemes are the ones nn/quantize and nn/int8 define, and a cache
that evicts nothing scores as the full one."""
from __future__ import annotations

import copy

import pytest
import torch

import archlab
from archlab.eval.perplexity import perplexity
from archlab.lab import real_model
from archlab.nn.int8 import quantize_int8


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = archlab.presets.tiny("llama2-7b").with_overrides({"max_seq_len": 128})
    model = archlab.TransformerLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (97,))
    return model, ids


def test_quantization_suite_measures_each_scheme_and_restores_the_model(tiny):
    model, ids = tiny
    with torch.no_grad():
        before = model(ids[None, :16])
    result = real_model.quantization(model, ids, seq_len=32)
    ppl = result["measured"]["ppl"]
    assert ppl["float"] == pytest.approx(perplexity(model, ids, 32))
    assert ppl["int8 weight-only"] == pytest.approx(perplexity(quantize_int8(copy.deepcopy(model)), ids, 32))
    assert all(ppl[k] != ppl["float"] for k in ("W8A8 per-tensor", "W8A8 per-token", "int8 weight-only"))
    # a random tiny model has no |x| >= 6: the outlier split is per-token W8A8 on every column
    assert ppl["LLM.int8 outlier split (6.0)"] == pytest.approx(ppl["W8A8 per-token"], rel=1e-6)
    with torch.no_grad():
        assert torch.equal(model(ids[None, :16]), before)                  # forwards restored
    assert [v["verdict"] in ("held", "did not hold") for v in result["verdicts"]] == [True] * 4


def test_streaming_caches_agree_when_nothing_is_evicted(tiny):
    model, ids = tiny
    ppl = real_model.streaming(model, ids, window=32, length=20)["measured"]["ppl_past_window"]
    # nothing past the window to score (window >= length): all three score the same empty slice as nan
    assert all(v != v for v in ppl.values())
    ppl = real_model.streaming(model, ids, window=8, length=20)["measured"]["ppl_past_window"]
    assert ppl["full"] != ppl["window (first tokens dropped)"]


def test_massive_activation_suite_zeroes_what_it_found(tiny, tmp_path):
    model, ids = tiny
    result = real_model.massive_activations(model, ids, seq_len=32)
    m = result["measured"]
    assert m["ppl"] == pytest.approx(perplexity(model, ids, 32))
    assert len(m["ppl_random_zeroed"]) == 3 and len(m["ratios"]) == model.config.n_layers
    path = real_model.write_report("massive_activations", result, tmp_path, {"model": "tiny", "seconds": 1.0})
    assert "| claim | measured | bar | verdict |" in path.read_text()
