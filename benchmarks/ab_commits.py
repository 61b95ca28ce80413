"""Two commits of archlab, timed in one process, interleaved: is a refactor free?

Each commit is checked out into its own git worktree and imported under its own copy of the `archlab`
modules (sys.modules is swapped between the imports), so both models live side by side and every round
times one after the other on the same warm machine. Measures a training step (forward + backward +
AdamW, fp32, the 14M LLaMA of train_throughput.py by default), cached greedy decoding at batch 1 and 8
(the model of generate.py) and the server's batched decode over its slot cache (8 rows scattered over 16, each
holding --history tokens). Prints after/before ratios (median over rounds; > 1 = the later commit is
faster).

    python benchmarks/ab_commits.py --before HEAD~1 --after HEAD --rounds 9
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import interleaved  # benchmarks/bench.py: one call of each per round, the order rotating

ROOT = Path(__file__).resolve().parents[1]


def checkout(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(into), rev], check=True,
                   capture_output=True)
    return into / "src"


def import_archlab(src: Path):
    """A fresh `archlab` package from `src` with every submodule imported, and its module map: `activate`
    puts the map back into sys.modules before a copy runs, so its lazy imports find its own modules."""
    import pkgutil

    for name in [m for m in sys.modules if m == "archlab" or m.startswith("archlab.")]:
        del sys.modules[name]
    sys.path.insert(0, str(src))
    try:
        module = importlib.import_module("archlab")
        for info in pkgutil.walk_packages(module.__path__, "archlab."):
            skip = info.name.startswith(("archlab.cli", "archlab.serve", "archlab.lab")) or "__main__" in info.name
            if not skip:                        # entry points and optional-extra packages are not imported
                importlib.import_module(info.name)
        return module, {m: sys.modules[m] for m in sys.modules if m == "archlab" or m.startswith("archlab.")}
    finally:
        sys.path.remove(str(src))


def activate(modules: dict) -> None:
    for name in [m for m in sys.modules if m == "archlab" or m.startswith("archlab.")]:
        del sys.modules[name]
    sys.modules.update(modules)


def train_step_fn(archlab, torch, batch: int, seq: int):
    cfg = archlab.ModelConfig(vocab_size=32000, d_model=320, n_layers=8, max_seq_len=seq,
                              attention={"n_heads": 8}, mlp={"activation": "swiglu", "d_ff": 864})
    model = archlab.TransformerLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32000, (batch, seq + 1), generator=gen)

    def step():
        out = model(x[:, :-1], targets=x[:, 1:])
        out.total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def decode_model(archlab, torch, max_seq_len: int = 1024, overrides: dict | None = None):
    """benchmarks/generate.py's model: LLaMA-like, 8.5M parameters, 6 layers, d=256, GQA 8/4, untied head."""
    cfg = archlab.ModelConfig(vocab_size=8192, d_model=256, n_layers=6, max_seq_len=max_seq_len,
                              tie_embeddings=False, attention={"n_heads": 8, "n_kv_heads": 4},
                              mlp={"activation": "swiglu", "d_ff": 688})
    if overrides:   # e.g. attention.qk_norm=per_head: a variant of the decode model
        cfg = cfg.with_overrides(overrides)
    torch.manual_seed(0)
    return archlab.TransformerLM(cfg).eval()


def decode_fn(archlab, torch, batch: int, new: int, overrides: dict | None = None, prompt_len: int = 32):
    model = decode_model(archlab, torch, max(1024, prompt_len + new), overrides=overrides)
    prompt = torch.randint(0, 8192, (batch, prompt_len), generator=torch.Generator().manual_seed(1))

    def run():
        return archlab.generate(model, prompt, max_new_tokens=new)
    return run


def slots_fn(archlab, torch, batch: int, history: int, steps: int):
    """The server's batched decode over its slot cache (archlab.nn.kv_cache.SlotKVCache): `batch` rows scattered
    over twice as many (rows 1, 3, 5, ...), each holding `history` tokens, decode `steps` tokens together; each call
    crops the rows back to `history` first. generate.py's model; returns the greedy tokens (batch, steps)."""
    from archlab.nn.kv_cache import SlotKVCache

    model = decode_model(archlab, torch, max(1024, history + steps))
    slots = SlotKVCache(model.config, rows=2 * batch, capacity=history + steps)
    rows = list(range(1, 2 * batch, 2))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for row in rows:
            ids = torch.randint(0, model.config.vocab_size, (1, history), generator=gen)
            model(ids, positions=torch.arange(history)[None], cache=slots.view([row]))
    first = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen)

    @torch.no_grad()
    def run():
        for row in rows:
            slots.crop(row, history)
        last, out = first, []
        for _ in range(steps):
            positions = torch.tensor([[slots.length[r]] for r in rows])                  # (b, 1)
            last = model(last, positions=positions, cache=slots.view(rows))[:, -1:].argmax(-1)   # (b, 1)
            out.append(last)
        return torch.cat(out, 1)
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="HEAD~1")
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--new", type=int, default=64, help="decoded tokens per generate call")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens of the decode workloads")
    ap.add_argument("--only", choices=("train", "decode", "slots"), help="time one kind of workload")
    ap.add_argument("--history", type=int, default=900, help="tokens each slot row holds (the slots workload)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per call (the slots workload)")
    ap.add_argument("--decode-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a dotted override of the decode model (repeatable), e.g. attention.qk_norm=per_head")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or this process's CPU time (steadier on a shared machine)")
    args = ap.parse_args()
    import time

    import torch
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        workloads: dict[str, dict] = {}
        copies: dict[str, dict] = {}
        for label, rev in (("before", args.before), ("after", args.after)):
            archlab, copies[label] = import_archlab(checkout(rev, Path(tmp) / label))
            overrides = dict(item.split("=", 1) for item in args.decode_set)
            workloads[label] = {"train step": train_step_fn(archlab, torch, args.batch, args.seq),
                                "decode b=1": decode_fn(archlab, torch, 1, args.new, overrides, args.prompt),
                                "decode b=8": decode_fn(archlab, torch, 8, args.new, overrides, args.prompt),
                                "slots b=8": slots_fn(archlab, torch, 8, args.history, args.steps)}
        from archlab.runs.provenance import provenance_line  # the "after" copy is the one imported last
        print(provenance_line(threads=args.threads), flush=True)
        outputs = {}
        for label in ("before", "after"):
            activate(copies[label])
            outputs[label] = workloads[label]["decode b=1"]()
        print(f"greedy tokens equal before/after: {torch.equal(outputs['before'], outputs['after'])}")
        if args.only in (None, "slots"):
            slot_tokens = [(activate(copies[label]), workloads[label]["slots b=8"]())[1] for label in outputs]
            print(f"slot-cache decode tokens equal before/after: {torch.equal(*slot_tokens)}")
        for name in workloads["after"]:
            if args.only is not None and not name.startswith(args.only):
                continue
            def in_copy(label: str, fn):     # each copy runs with its own modules in sys.modules
                return lambda: (activate(copies[label]), fn())
            clock = time.process_time if args.clock == "cpu" else time.perf_counter
            seconds = interleaved({label: in_copy(label, workloads[label][name]) for label in ("before", "after")},
                                  args.rounds, clock=clock)
            ratios = [b / a for b, a in zip(seconds["before"], seconds["after"])]
            print(f"{name:11s}: after/before speed {statistics.median(ratios):.3f}x "
                  f"(rounds {min(ratios):.3f}-{max(ratios):.3f}, {args.rounds} interleaved, {args.clock} time)",
                  flush=True)
        for label in ("before", "after"):
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / label)],
                           capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
