"""Time to first token across a chat's turns, with the conversation's KV cache kept between turns (PrefixCache, as
`archlab chat` does) and without it (every turn prefills the whole history).

    .venv/bin/python benchmarks/chat_cache.py [--threads 1] [--turns 10] [--rounds 5] [--user 60] [--answer 60]

The model: the decode benchmark's LLaMA shape (8 layers, d_model 256, GQA 8:2, random weights; only shapes matter
for time). A turn appends --user tokens to the history, streams an answer of --answer tokens (greedy, EOS off) and
appends it; the time to first token is from the call to the first streamed token, the prefill included. Both
conversations run in interleaved rounds (one whole conversation each per round, the order alternating); each turn's
figure is the median over rounds, and the answers of both are asserted identical.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import archlab
from archlab.generation import PrefixCache, stream


def conversation(model, users: list[list[int]], answer: int, cached: bool) -> tuple[list[float], list[int]]:
    """(seconds to the first token of each turn, the final history)."""
    cache = PrefixCache() if cached else None
    history: list[int] = []
    ttft = []
    for user in users:
        history = history + user
        start = time.perf_counter()
        tokens = stream(model, history, answer, eos_token_id=[], prefix_cache=cache)
        first = next(tokens)
        ttft.append(time.perf_counter() - start)
        history = history + [int(first[0])] + [int(t[0]) for t in tokens]
    return ttft, history


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--user", type=int, default=60, help="tokens each user turn adds")
    ap.add_argument("--answer", type=int, default=60, help="tokens of each answer")
    args = ap.parse_args()
    from archlab.runs.provenance import provenance_line
    print(provenance_line(threads=args.threads), flush=True)
    torch.set_num_threads(args.threads)
    cfg = archlab.presets.tiny("llama3-8b", vocab_size=4096, d_model=256, max_seq_len=2048).with_overrides(
        {"n_layers": 8, "attention.n_heads": 8, "attention.n_kv_heads": 2, "mlp.d_ff": 688})
    model = archlab.TransformerLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    users = [torch.randint(0, cfg.vocab_size, (args.user,), generator=g).tolist() for _ in range(args.turns)]
    conversation(model, users[:2], 4, True)                                         # warm-up
    times: dict[bool, list[list[float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for cached in ((True, False) if r % 2 == 0 else (False, True)):
            ttft, history = conversation(model, users, args.answer, cached)
            times[cached].append(ttft)
            if cached:
                kept = history
            else:
                assert history == kept, "the cached conversation decoded different answers"
    med = {c: [statistics.median(t[i] for t in times[c]) for i in range(args.turns)] for c in (True, False)}
    print(f"time to first token (ms), median of {args.rounds} interleaved rounds; {args.user} user + {args.answer} "
          f"answer tokens a turn")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>8} {'fresh':>8}")
    for i in range(args.turns):
        print(f"{i + 1:>4} {(i + 1) * args.user + i * args.answer:>7} {1e3 * med[True][i]:>8.1f} "
              f"{1e3 * med[False][i]:>8.1f}")
    last = args.turns - 1
    print(f"turn {args.turns} / turn 1: cached {med[True][last] / med[True][0]:.2f}x, "
          f"fresh {med[False][last] / med[False][0]:.2f}x; at turn {args.turns} the cache is "
          f"{med[False][last] / med[True][last]:.1f}x faster to the first token")


if __name__ == "__main__":
    main()
