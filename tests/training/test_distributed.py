"""Data parallelism under torchrun (2 CPU processes, gloo): DDP and FSDP2 give the single-process losses
for the same global batch, and every rank ends with the same parameters (and MoE expert biases)."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from archlab.config import ModelConfig
from archlab.data.prepare import prepare
from archlab.training.trainer import TrainConfig, read_metrics, train

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()

WORKER = textwrap.dedent('''
    import os, sys, torch
    from archlab.training import distributed as du
    from archlab.config import ModelConfig
    from archlab.training.trainer import TrainConfig, train

    data, out, model_yaml, train_yaml = sys.argv[1:5]
    original = du.full_model_state

    def capture(model, info):   # every rank: its own (gathered) parameters at each checkpoint
        raw = du.unwrap(model)
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
                  for n, p in [*raw.named_parameters(), *raw.named_buffers()]
                  if n in dict(raw.named_parameters()) or n.endswith("expert_bias")}
        torch.save(params, os.path.join(out + "-ranks", f"rank{info.rank}.pt"))
        return original(model, info)

    du.full_model_state = capture
    os.makedirs(out + "-ranks", exist_ok=True)
    train(ModelConfig.from_yaml(open(model_yaml).read()), TrainConfig.from_yaml(open(train_yaml).read()),
          data, out, progress=False)
''')


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(30)]
    prepare(docs, "bytes", root / "data", num_workers=0, progress=False)
    model = ModelConfig(vocab_size=257, d_model=32, n_layers=2, max_seq_len=64, attention={"n_heads": 4})
    cfg = TrainConfig(batch_size=8, seq_len=16, grad_accum=2, budget=6, warmup_steps=2, lr=3e-3,
                      eval_every=3, eval_batches=3, log_every=1, sample_every=-1, checkpoint_every=3,
                      device="cpu")
    torch.set_num_threads(1)
    try:
        single = train(model, cfg, root / "data", root / "single", progress=False)
    finally:
        torch.set_num_threads(os.cpu_count() or 1)
    (root / "model.yaml").write_text(model.to_yaml())
    (root / "worker.py").write_text(WORKER)
    return root, cfg, read_metrics(single.metrics_path)


@pytest.mark.parametrize("strategy,overrides", [
    ("ddp", {"dist_strategy": "ddp"}),
    pytest.param("fsdp", {"dist.strategy": "fsdp"}, marks=pytest.mark.slow),   # `--set dist.strategy=fsdp`; ~16 s
    pytest.param("fsdp-recompute", {"dist_strategy": "fsdp", "activation_checkpointing": True}, marks=pytest.mark.slow),
])
def test_two_process_run_matches_single_process(setup, strategy, overrides):
    root, cfg, reference = setup
    assert_two_processes_match(root, "model.yaml", cfg.with_overrides(overrides), strategy, reference)


@pytest.mark.slow
def test_expert_biases_move_alike_on_every_rank(setup):
    """MoE balance=bias under DDP: each rank counts its own half of the batch, the counts are summed, so both ranks
    move their biases alike, and the losses stay the single process's."""
    root, cfg, _ = setup
    model = ModelConfig.from_yaml((root / "model.yaml").read_text()).with_overrides(
        {"mlp.moe": {"n_experts": 4, "top_k": 2, "balance": "bias", "bias_update_rate": 0.01}})
    (root / "moe.yaml").write_text(model.to_yaml())
    torch.set_num_threads(1)
    try:
        single = train(model, cfg, root / "data", root / "moe-single", progress=False)
    finally:
        torch.set_num_threads(os.cpu_count() or 1)
    ranks = assert_two_processes_match(root, "moe.yaml", cfg.with_overrides({"dist_strategy": "ddp"}), "moe-ddp",
                                       read_metrics(single.metrics_path))
    biases = [k for k in ranks[0] if k.endswith("expert_bias")]
    assert len(biases) == 2 and any(ranks[0][k].abs().sum() > 0 for k in biases)
    # DDP broadcasts rank 0's buffers, so the ranks agree either way; the single process's biases show that the
    # counts were summed over both halves of the batch (rank 0's half alone moves them otherwise)
    from archlab.runs.checkpoint import latest_checkpoint, load_checkpoint
    alone, _ = load_checkpoint(latest_checkpoint(root / "moe-single"))
    assert all(torch.equal(ranks[0][k], alone[k]) for k in biases)


def assert_two_processes_match(root, model_yaml: str, cfg: TrainConfig, strategy: str, reference: list) -> list:
    """Run `cfg` on 2 processes; its logged losses equal `reference`'s, every rank's parameters (and expert biases)
    are equal and the checkpoint holds them. Returns each rank's tensors."""
    (root / f"{strategy}.yaml").write_text(cfg.to_yaml())
    out = root / strategy
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(root / "worker.py"), str(root / "data"), str(out), str(root / model_yaml),
         str(root / f"{strategy}.yaml")],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in reference]
    for a, b in zip(got, reference):
        key = "loss" if "loss" in b else "val_loss"
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a, b)
    ranks = [torch.load(out.parent / f"{strategy}-ranks" / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys()
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    from archlab.runs.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
    assert len(list_checkpoints(out)) == 2          # rank 0 alone wrote them
    saved, _ = load_checkpoint(latest_checkpoint(out))
    assert all(torch.equal(saved[k], ranks[0][k]) for k in ranks[0])
    return ranks


def test_an_optimizer_state_loads_without_a_parameter_that_never_stepped_and_is_frozen_now():
    """A checkpoint's optimizer held a parameter that never got a gradient (so no state: a reward model's LM head
    before it was frozen); an optimizer without it reads the checkpoint, the others' state intact. One that had
    state is still refused."""
    from archlab.training.distributed import DistInfo, full_optimizer_state, load_full_optimizer_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    old = torch.optim.AdamW(model.parameters(), lr=0.1)
    model[0](torch.randn(2, 3)).sum().backward()               # only the first layer gets gradients
    old.step()
    saved = full_optimizer_state(model, old, DistInfo())
    assert set(saved["state"]) == {"0.weight", "0.bias"} and "1.weight" in saved["param_groups"][0]["params"]
    model[1].requires_grad_(False)
    new = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    load_full_optimizer_state(model, new, saved, DistInfo())
    assert torch.equal(new.state[model[0].weight]["exp_avg"], old.state[model[0].weight]["exp_avg"])
    model[1].requires_grad_(True)
    model[0].requires_grad_(False)
    other = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(ValueError, match="parameter groups differ"):
        load_full_optimizer_state(model, other, saved, DistInfo())
