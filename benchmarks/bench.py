"""What the benchmarks here share: how each one opens (its docstring as --help; its first output line, the
provenance of the machine the figures come from; torch's CPU threads), interleaved timing (a shared machine: the
sides' calls moments apart, the order rotating each round), and one LLaMA on both sides (built in transformers,
loaded into archlab through archlab.interop.load_hf).

    from bench import interleaved, parser, start
    ap = parser(__doc__)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    start(args)                 # prints `provenance: {...}` and sets torch.set_num_threads(args.threads)
    times = interleaved({"ours": run_ours, "theirs": run_theirs}, rounds=7)
"""
from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line: its module docstring, as written, for --help."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def start(args: argparse.Namespace, **extra: Any) -> None:
    """A benchmark's first output line, `provenance: {...}` (the machine, torch, args.threads and `extra`, such as
    device= or clock=), then torch's CPU threads set to args.threads."""
    from archlab.runs.provenance import provenance_line

    print(provenance_line(threads=args.threads, **extra), flush=True)
    torch.set_num_threads(args.threads)


def _timed(fn, clock=time.perf_counter) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def interleaved(fns: dict, rounds: int, warmup: int = 1, clock=time.perf_counter) -> dict[str, list[float]]:
    """Seconds per call of each fn, one call of each per round, the order rotating every round. clock:
    wall time by default; time.process_time counts only this process's CPU time (a shared machine's other
    tenants and descheduled stretches drop out)."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(_timed(fns[name], clock))
    return times


def llama_pair(hf_cfg: Any) -> tuple[Any, Any]:
    """(transformers' LlamaForCausalLM of `hf_cfg`, weights drawn from seed 0, EOS off so every call decodes its
    full length; the same weights loaded into archlab through archlab.interop.load_hf)."""
    import transformers

    from archlab.interop import load_hf

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.generation_config.eos_token_id = None
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder, safe_serialization=True)
        ours = load_hf(folder)
    return hf, ours
