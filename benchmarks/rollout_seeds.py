"""What a seed per prompt costs an RL rollout: training/methods/rollout.py's `rollout` with one generator for the
whole batch (seed=INT) against one per prompt (seed=[...], generation.sampling.GroupGenerators: each group's tokens
drawn by its own torch.multinomial call, so a prompt samples the same on any rank). GRPO and PPO sample with the
latter, so that N data-parallel ranks each sampling 1/N of the prompts sample what one process does.

    .venv/bin/python benchmarks/rollout_seeds.py [--threads 1] [--prompts 8] [--group 8] [--new 8] [--rounds 9]

The model is the post-training demo's (training/recipes.reverse_words: 2 layers, d_model 128, untrained weights, EOS
off so every call decodes --new tokens); the defaults are its GRPO step (8 prompts x 8 completions, 8 new tokens).
Reported: the median over interleaved rounds of (per-prompt seconds / one-generator seconds), CPU time of this process.
"""
from __future__ import annotations

import statistics
import time

import torch
from bench import interleaved, parser, start  # benchmarks/bench.py: one call of each per round, the order rotating

from archlab.models import build_model
from archlab.training.methods.rollout import rollout
from archlab.training.recipes import reverse_words


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    start(args)
    torch.manual_seed(0)
    model = build_model(reverse_words(quick=False)["model"]).eval()
    prompts = [torch.randint(1, 250, (args.prompt_len,)).tolist() for _ in range(args.prompts)]
    kw = dict(group=args.group, max_new_tokens=args.new, eos_ids=[259], pad_id=259, temperature=1.0,
              vocab_limit=258)   # 259 never sampled: every row decodes --new tokens
    runs = {"one generator": lambda: rollout(model, prompts, seed=1, **kw),
            "a generator per prompt": lambda: rollout(model, prompts, seed=list(range(args.prompts)), **kw)}
    times = interleaved(runs, args.rounds, clock=time.process_time)
    base = times["one generator"]
    ratio = statistics.median(t / b for t, b in zip(times["a generator per prompt"], base))
    print(f"{args.prompts} prompts x {args.group} completions, {args.new} new tokens: one generator "
          f"{statistics.median(base) * 1e3:.1f} ms, a generator per prompt "
          f"{statistics.median(times['a generator per prompt']) * 1e3:.1f} ms; ratio {ratio:.3f} (median of "
          f"{args.rounds} interleaved rounds, process CPU time)")


if __name__ == "__main__":
    main()
