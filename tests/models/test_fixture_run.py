"""A run folder saved by an earlier layout of the model's modules loads and gives the same logits after every
slice: checkpoints, state-dict keys and the model's math stay compatible."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from archlab.runs.checkpoint import latest_checkpoint, verify_checkpoint
from archlab.runs.model_folder import load_run

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_v1"


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


def test_the_saved_optimizer_state_loads_under_todays_parameter_names():
    """Resuming reads the old run's optimizer state, by parameter name, through the same rename table as its
    weights (models/legacy_keys): every moment lands on the parameter it was saved for."""
    from archlab.models.legacy_keys import upgrade_keys, upgrade_optimizer_state
    from archlab.runs.checkpoint import load_checkpoint
    from archlab.runs.model_folder import read_run_config
    from archlab.training.config import TrainConfig
    from archlab.training.distributed import DistInfo, load_full_optimizer_state
    from archlab.training.optim import param_groups

    model, _ = load_run(FIXTURE)
    weights, state = load_checkpoint(latest_checkpoint(FIXTURE))
    old = state["optimizer"]
    assert "final_norm.weight" in old["state"]                   # the fixture holds the earlier names
    train = TrainConfig(**{k: v for k, v in read_run_config(FIXTURE)["train"].items() if k != "betas"})
    optimizer = torch.optim.AdamW(param_groups(model, train.optimizer.weight_decay, train.optimizer.no_decay))
    load_full_optimizer_state(model, optimizer, upgrade_optimizer_state(old, "decoder"), DistInfo())
    names = dict(model.named_parameters())
    moments = {name: s["exp_avg"] for name, s in upgrade_keys(old["state"], "decoder").items()}
    for param, saved in optimizer.state.items():
        name = next(n for n, p in names.items() if p is param)
        torch.testing.assert_close(saved["exp_avg"], moments[name], rtol=0, atol=0)
    assert len(optimizer.state) == len(names) == len(weights)
