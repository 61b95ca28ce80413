"""Step times of a suite's variants measured side by side, for its speed claims.

A run's own tokens/s is measured while it trains, minutes apart from the other variants' runs; on a
shared machine the load drifts between them (the recorded step times of identical setups differed by
up to 40%), so "RMSNorm's step is faster" came out inconclusive whatever the truth. Here one process
builds a fresh model per variant and runs their training steps (forward, backward, clipping, AdamW)
in rotating order, so each round compares steps taken moments apart, as benchmarks/ does. Rounds
are dealt to the seeds in turn (round r to seed r mod seeds), so each seed gets its own median and the
spread over seeds reflects the timing noise that the verdict rules weigh.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

METRIC = "paired_step_s"       # the `extra` key the runner records and speed rules read


def _step_fn(run, seq_len: int | None = None) -> Callable[[], None]:
    """One training step of a fresh model with `run`'s configs, on fixed random tokens (seq_len: one
    sequence of that many tokens instead of the run's batch)."""
    from archlab.eval.evaluate import autocast
    from archlab.models.decoder import TransformerLM
    from archlab.training.placement import device_kind

    cfg, train = run.model, run.train
    batch, length = (train.batch_size, train.seq_len) if seq_len is None else (1, seq_len)
    if length > cfg.max_seq_len:
        cfg = cfg.with_overrides({"max_seq_len": length})
    device = torch.device(device_kind(train.device))
    torch.manual_seed(run.seed)
    model = TransformerLM(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(run.seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, length + 1), generator=gen).to(device)
    x, y = ids[:, :-1], ids[:, 1:]                                  # (b, t) each

    def step() -> None:
        with autocast(device, train.dtype):
            loss = model(x, targets=y).total
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def paired_step_times(runs: list, rounds_per_seed: int = 10, warmup: int = 3,
                      progress: bool = False, seq_len: int | None = None) -> dict[tuple[str, int], float]:
    """{(variant name, seed): median step seconds} for every (variant, seed) among `runs`
    (PlannedRun), the variants' steps interleaved in one process (seq_len: at batch 1 and that length,
    where a claim is about cost against length)."""
    variants: dict[str, object] = {}
    seeds: list[int] = sorted({run.seed for run in runs})
    for run in runs:
        variants.setdefault(run.variant.name, run)
    steps = {name: _step_fn(run, seq_len) for name, run in variants.items()}
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    rounds = rounds_per_seed * len(seeds)
    bar = None
    if progress:
        from archlab.progress import progress_bar
        bar = progress_bar(total=rounds, desc="paired step times", unit="round")
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:   # rotate: no fixed neighbour
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return {(name, seed): statistics.median(times[name][i::len(seeds)])
            for name in names for i, seed in enumerate(seeds)}
