"""A run folder saved by an earlier layout of the model's modules loads and gives the same logits after every
slice: checkpoints, state-dict keys and the model's math stay compatible."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from archlab.runs.checkpoint import latest_checkpoint, verify_checkpoint
from archlab.runs.model_folder import load_run

FIXTURE = Path(__file__).parent / "fixtures" / "run_v1"


def test_the_saved_run_loads_with_the_same_logits():
    verify_checkpoint(latest_checkpoint(FIXTURE), full=True)
    model, tok = load_run(FIXTURE)
    expected = load_file(str(FIXTURE / "expected_logits.safetensors"))
    with torch.no_grad():
        logits = model(expected["input_ids"])
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-5)
    assert tok is not None and tok.decode(tok.encode("fox")) == "fox"


def test_the_saved_run_decodes_with_the_cache_as_without():
    import archlab
    model, _ = load_run(FIXTURE)
    prompt = load_file(str(FIXTURE / "expected_logits.safetensors"))["input_ids"][0, :12]
    cached = archlab.generate(model, prompt, 20)
    uncached = archlab.generate(model, prompt, 20, use_cache=False)
    assert torch.equal(cached, uncached)
