"""Packing with document masks against padding per batch: fine-tuning throughput in real tokens per second.

    .venv/bin/python benchmarks/packing.py [--examples 64] [--seq 512] [--batch 8] [--rows 2] [--rounds 5]

Fine-tuning data is examples of mixed length (instructions and answers: many short, a few long). The same
examples are trained two ways, one AdamW step per batch (forward + backward + update), same model:

    padded   batches of --batch examples in data order, each padded to its longest example (right padding:
             a causal model needs no mask; padded labels ignored), what a plain collator does
    packed   whole examples packed first-fit into rows of --seq tokens, --rows rows a step, `document_ids` per
             row (no example attends to another, positions restart at each; archlab's document masks)

Each example is scored alike both ways (its next-token labels, its last token unscored). Real tokens per second
= the examples' tokens over the seconds an epoch over them takes; the two epochs are timed interleaved in one
process, the order alternating every round, and the ratio is the median of the rounds' ratios. On a shared
machine `--clock process` (the default) counts this process's CPU seconds only, so other tenants and
descheduled stretches drop out; `--clock wall` times wall seconds. Lengths are drawn
log-normally (median --median tokens, sigma --sigma), clipped to [8, --seq]. The model is a ~5M LLaMA-style
decoder (d 256, 4 layers, 4 heads, SwiGLU 688, vocab 4096), float32.
"""
from __future__ import annotations

import math
import statistics
import time

import torch
from bench import parser, start  # benchmarks/bench.py: the opening every benchmark shares

D_MODEL, N_LAYERS, N_HEADS, D_FF, VOCAB = 256, 4, 4, 688, 4096


def lengths(n: int, median: float, sigma: float, seq: int, seed: int = 0) -> list[int]:
    """n example lengths, log-normal around `median`, clipped to [8, seq]."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.randn(n, generator=g) * sigma + math.log(median)
    return [int(min(seq, max(8, round(math.exp(float(x)))))) for x in draws]


def examples(lens: list[int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]


def padded_batches(docs: list[torch.Tensor], batch: int) -> list[dict]:
    """Batches of `batch` examples in order, right-padded to each batch's longest; labels -100 on padding and on
    each example's last token."""
    out = []
    for i in range(0, len(docs), batch):
        group = docs[i:i + batch]
        t = max(len(d) for d in group)
        ids = torch.zeros(len(group), t, dtype=torch.long)
        labels = torch.full((len(group), t), -100)
        for r, d in enumerate(group):
            ids[r, :len(d)] = d
            labels[r, :len(d) - 1] = d[1:]
        out.append({"input_ids": ids, "targets": labels})
    return out


def pack_rows(docs: list[torch.Tensor], seq: int) -> list[list[int]]:
    """First-fit: each example (by index, in order) into the first row with room for it, else a new row."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, d in enumerate(docs):
        for r, free in enumerate(room):
            if len(d) <= free:
                rows[r].append(i)
                room[r] -= len(d)
                break
        else:
            rows.append([i])
            room.append(seq - len(d))
    return rows


def packed_batches(docs: list[torch.Tensor], seq: int, rows_per_step: int) -> list[dict]:
    """Rows of `seq` slots holding whole examples, `document_ids` per slot (-1 on the rows' unused tail)."""
    rows = pack_rows(docs, seq)
    out = []
    for i in range(0, len(rows), rows_per_step):
        group = rows[i:i + rows_per_step]
        ids = torch.zeros(len(group), seq, dtype=torch.long)
        labels = torch.full((len(group), seq), -100)
        doc_ids = torch.full((len(group), seq), -1)
        for r, members in enumerate(group):
            at = 0
            for j, k in enumerate(members):
                d = docs[k]
                ids[r, at:at + len(d)], doc_ids[r, at:at + len(d)] = d, j
                labels[r, at:at + len(d) - 1] = d[1:]
                at += len(d)
        out.append({"input_ids": ids, "targets": labels, "document_ids": doc_ids})
    return out


def epoch_fn(batches: list[dict], device: torch.device):
    """One optimizer step per batch over all of them: a fresh model and AdamW (fused, as the trainer's)."""
    from archlab.config import ModelConfig
    from archlab.models.decoder import TransformerLM

    cfg = ModelConfig(name="bench-llama", vocab_size=VOCAB, d_model=D_MODEL, n_layers=N_LAYERS, max_seq_len=2048,
                      attention={"n_heads": N_HEADS}, mlp={"activation": "swiglu", "d_ff": D_FF})
    model = TransformerLM(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches]

    def run():
        for b in batches:
            model(**b).total.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return run


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--examples", type=int, default=64)
    ap.add_argument("--median", type=float, default=96.0, help="median example length, tokens")
    ap.add_argument("--sigma", type=float, default=0.8, help="log-normal spread of the lengths")
    ap.add_argument("--seq", type=int, default=512, help="packed row length (and the longest example)")
    ap.add_argument("--batch", type=int, default=8, help="examples per padded batch")
    ap.add_argument("--rows", type=int, default=2, help="packed rows per step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("process", "wall"), default="process")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    start(args, device=device, clock=args.clock)
    lens = lengths(args.examples, args.median, args.sigma, args.seq)
    docs = examples(lens)
    padded, packed = padded_batches(docs, args.batch), packed_batches(docs, args.seq, args.rows)
    real = sum(lens)
    padded_slots = sum(b["input_ids"].numel() for b in padded)
    packed_slots = sum(b["input_ids"].numel() for b in packed)
    print(f"{len(docs)} examples, {real} tokens: length median {statistics.median(lens):.0f}, mean "
          f"{real / len(docs):.0f}, max {max(lens)}")
    print(f"padded: {len(padded)} steps of {args.batch} examples, {real / padded_slots:.0%} of the slots real")
    print(f"packed: {len(packed)} steps of {args.rows} rows x {args.seq}, {real / packed_slots:.0%} of the slots "
          "real", flush=True)
    fns = {"padded": epoch_fn(padded, device), "packed": epoch_fn(packed, device)}
    for fn in fns.values():                                 # warm-up: one epoch each
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(args.rounds):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = clock()
            fns[name]()
            times[name].append(clock() - t0)
        print(f"round {r + 1}: padded {real / times['padded'][-1]:,.0f} tok/s, packed "
              f"{real / times['packed'][-1]:,.0f} tok/s", flush=True)
    ratio = statistics.median(p / q for p, q in zip(times["padded"], times["packed"]))
    for name in fns:
        print(f"{name}: {real / statistics.median(times[name]):,.0f} real tokens/s (median epoch "
              f"{statistics.median(times[name]):.2f} s, {args.clock} clock)")
    print(f"packed / padded: {ratio:.2f}x real tokens/s (median of {args.rounds} interleaved rounds)")


if __name__ == "__main__":
    main()
