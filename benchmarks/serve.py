"""Continuous batching: N concurrent requests against the same N one after another, through the server's
Engine (archlab.serve), on the model of benchmarks/generate.py (LLaMA-like, 6 layers, d=256, GQA 8/4,
random weights, a byte tokenizer). Prints total wall time, generated tokens/s and the speed-up, with the
rows each batched decode step carried.

    python benchmarks/serve.py --requests 8 --new 64 --threads 2
"""
from __future__ import annotations

import statistics
import threading
import time

import torch
from bench import parser, start  # benchmarks/bench.py: the opening every benchmark shares

import archlab
from archlab.serve import CompletionRequest, Engine
from archlab.tokenizer import Tokenizer


def build_engine(max_batch: int) -> Engine:
    cfg = archlab.ModelConfig(vocab_size=257, d_model=256, n_layers=6, max_seq_len=512,
                              attention={"n_heads": 8, "n_kv_heads": 4}, mlp={"activation": "swiglu", "d_ff": 688})
    torch.manual_seed(0)
    model = archlab.TransformerLM(cfg).eval()
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    return Engine(model, tokenizer, "bench", max_batch=max_batch)


def run(engine: Engine, prompts: list[str], new: int, concurrent: bool) -> float:
    def ask(prompt: str) -> None:
        for _ in engine.complete(CompletionRequest(prompt, max_tokens=new, temperature=0)):
            pass
    start = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for p in prompts:
            ask(p)
    return time.perf_counter() - start


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    start(args)
    engine = build_engine(max_batch=args.requests)
    prompts = [f"request {i}: " + "lorem ipsum " * (1 + i % 4) for i in range(args.requests)]
    run(engine, prompts[:2], 8, concurrent=True)                    # warm-up
    times: dict[str, list[float]] = {"sequential": [], "concurrent": []}
    for _ in range(args.rounds):
        for mode in times:
            times[mode].append(run(engine, prompts, args.new, concurrent=mode == "concurrent"))
    tokens = args.requests * args.new
    for mode, ts in times.items():
        t = statistics.median(ts)
        print(f"{mode:10s}: {args.requests} requests x {args.new} tokens in {t:6.2f} s = {tokens / t:7.1f} tokens/s")
    print(f"concurrent / sequential throughput: "
          f"{statistics.median(times['sequential']) / statistics.median(times['concurrent']):.2f}x; "
          f"rows per decode step: {dict(sorted(engine.rows_per_step.items()))}")


if __name__ == "__main__":
    main()
