"""StreamingLLM (Xiao et al. 2023, arXiv 2309.17453) on a tiny byte-level model: perplexity past the
training length with attention sinks stays flat; plain window attention (sinks evicted) and dense
attention past the trained context do worse.

    .venv/bin/python benchmarks/streaming_llm.py [--train-seconds 60] [--eval-len 768] [--bos]

Trains a small RoPE model on bytes of the local Python standard library for --train-seconds at
context --ctx, then decodes held-out files token by token with three caches and reports
perplexity on the tokens past 2 x ctx:
  dense       StaticKVCache, every token, positions beyond anything trained
  window      SinkKVCache(sink_tokens=0, window=ctx): recent tokens only, in-cache positions
  sinks       SinkKVCache(sink_tokens=4, window=ctx-4): StreamingLLM
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
from bench import parser, start  # benchmarks/bench.py: the opening every benchmark shares
from tqdm import tqdm

import archlab
from archlab.nn.kv_cache import SinkKVCache, StaticKVCache


def corpus_bytes() -> tuple[bytes, bytes]:
    root = Path(os.__file__).parent
    files = sorted(p for p in root.glob("*.py"))
    train = b"".join(p.read_bytes() for p in files[: len(files) * 9 // 10])
    held = b"".join(p.read_bytes() for p in files[len(files) * 9 // 10:])
    return train, held


BOS = 256  # a start-of-sequence id outside the bytes (--bos)


def windows(data: torch.Tensor, starts: torch.Tensor, ctx: int, bos: bool):
    """(x, y) training windows; with bos every window starts with BOS, as documents do for LLMs."""
    n = ctx - 1 if bos else ctx
    x = torch.stack([data[i:i + n] for i in starts])
    y = torch.stack([data[i + 1:i + n + 1] for i in starts])
    if bos:
        first = torch.full((len(starts), 1), BOS)
        x = torch.cat((first, x), 1)
        y = torch.cat((data[starts][:, None], y), 1)
    return x, y


def train(cfg, data: torch.Tensor, seconds: float, batch: int, seed: int = 0, bos: bool = False):
    torch.manual_seed(seed)
    model = archlab.TransformerLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.1, betas=(0.9, 0.95))
    ctx = cfg.max_seq_len
    start, step = time.time(), 0
    bar = tqdm(desc="train", unit="step")
    while time.time() - start < seconds:
        idx = torch.randint(0, len(data) - ctx - 1, (batch,))
        x, y = windows(data, idx, ctx, bos)
        loss = model.loss(x, y).total
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    return model.eval(), step, loss.item()


@torch.inference_mode()
def token_by_token_nll(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """(b, L) -> (b, L-1) NLL of each next token, decoding one token at a time through `cache`."""
    b, length = ids.shape
    nll = torch.zeros(b, length - 1)
    for i in range(length - 1):
        pos = torch.full((b, 1), i)
        logits = model(ids[:, i:i + 1], positions=pos, cache=cache)[:, 0].float()
        nll[:, i] = torch.nn.functional.cross_entropy(logits, ids[:, i + 1], reduction="none")
    return nll


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--train-seconds", type=float, default=60)
    ap.add_argument("--ctx", type=int, default=32)
    ap.add_argument("--eval-len", type=int, default=384)
    ap.add_argument("--eval-rows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bos", action="store_true",
                    help="start every training window and eval text with a BOS token (as LLM documents do); "
                    "without it windows start at arbitrary bytes and a first-token sink has less reason to form")
    args = ap.parse_args()
    start(args)

    train_bytes, held = corpus_bytes()
    data = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8).long()
    cfg = archlab.ModelConfig(vocab_size=257 if args.bos else 256, d_model=96, n_layers=3, max_seq_len=args.ctx,
                              attention={"n_heads": 4}, mlp={"d_ff": 256})
    model, steps, loss = train(cfg, data, args.train_seconds, batch=16, bos=args.bos)
    print(f"trained {steps} steps in {args.train_seconds:.0f}s, last train loss {loss:.3f} nats/byte "
          f"(ctx {args.ctx}, {model.num_params() / 1e6:.2f}M params)")

    held_t = torch.frombuffer(bytearray(held), dtype=torch.uint8).long()
    gap = (len(held_t) - args.eval_len) // args.eval_rows
    ids = torch.stack([held_t[i * gap:i * gap + args.eval_len] for i in range(args.eval_rows)])
    if args.bos:
        ids = torch.cat((torch.full((len(ids), 1), BOS), ids[:, :-1]), 1)
    b, ctx = ids.shape[0], args.ctx
    caches = {
        "dense": StaticKVCache(cfg, b, args.eval_len),
        "window (no sinks)": SinkKVCache(cfg, b, sink_tokens=0, window=ctx),
        "sinks (4 + window)": SinkKVCache(cfg, b, sink_tokens=4, window=ctx - 4),
    }
    inside = slice(ctx // 2, ctx - 1)          # targets inside the trained context
    past = slice(2 * ctx, args.eval_len - 1)   # targets well past it
    print(f"perplexity (bytes), {b} held-out texts of {args.eval_len} bytes, decoded token by token:")
    for name, cache in caches.items():
        nll = token_by_token_nll(model, ids, cache)
        ppl_in = math.exp(nll[:, inside].mean())
        ppl_past = math.exp(nll[:, past].mean())
        quarters = [math.exp(q.mean()) for q in nll[:, past].chunk(4, dim=1)]
        print(f"  {name:20s} inside ctx {ppl_in:6.3f} | past 2x ctx {ppl_past:7.3f} | "
              f"by quarter {' '.join(f'{q:.3f}' for q in quarters)}")


if __name__ == "__main__":
    main()
