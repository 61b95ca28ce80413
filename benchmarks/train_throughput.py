"""Training throughput of archlab's step against transformers' LlamaForCausalLM, same run, same config.

    .venv/bin/python benchmarks/train_throughput.py [--steps 5] [--batch 8] [--seq 256] [--device cpu]

For fp32 and bf16 autocast, each of (archlab, transformers) trains in a fresh subprocess (so peak RSS is
its own): AdamW, grad clip 1.0, a ~14M-parameter LLaMA-style model (d 320, 8 layers, 5 heads, SwiGLU 768,
vocab 8192, untied). Reported: tokens/s and the ratio archlab / transformers, peak memory (CUDA: max
allocated; CPU: peak RSS of the process), achieved FLOP/s = training FLOPs per token x tokens/s against
the matmul peak measured in the same worker for that dtype (MFU), and bf16 / fp32 speedup.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

D_MODEL, N_LAYERS, N_HEADS, D_FF, VOCAB = 320, 8, 5, 768, 8192


def model_config():
    from archlab.config import ModelConfig

    return ModelConfig(name="bench-llama", vocab_size=VOCAB, d_model=D_MODEL, n_layers=N_LAYERS, max_seq_len=2048,
                       attention={"n_heads": N_HEADS}, mlp={"activation": "swiglu", "d_ff": D_FF},
                       norm={"kind": "rmsnorm", "eps": 1e-5}, position={"kind": "rope", "rope_theta": 10000.0})


def build(impl: str):
    import torch

    if impl == "archlab":
        from archlab.model import TransformerLM

        model = TransformerLM(model_config())
        return model, lambda x: model(x)
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=D_FF, num_hidden_layers=N_LAYERS,
                     num_attention_heads=N_HEADS, num_key_value_heads=N_HEADS, max_position_embeddings=2048,
                     rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                     mlp_bias=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf)
    return model, lambda x: model(input_ids=x, use_cache=False).logits


def worker(impl: str, dtype: str, steps: int, warmup: int, batch: int, seq: int, device: str) -> dict:
    import torch
    import torch.nn.functional as F

    from archlab.evaluate import autocast
    from archlab.train import _peak_memory, matmul_peak_flops, train_flops_per_token

    dev = torch.device(device)
    model, forward = build(impl)
    model.to(dev).train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (batch, seq + 1), generator=gen).to(dev)
    inputs, targets = x[:, :-1], x[:, 1:]

    def step():
        with autocast(dev, dtype):
            logits = forward(inputs)                                          # (b, t, v)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    best = sorted(times)[len(times) // 2]   # median step: robust to other processes on a shared machine
    tps = batch * seq / best
    flops = train_flops_per_token(model_config(), seq, n_params)
    peak = matmul_peak_flops(dev, dtype, seconds=1.0, n=1024 if dev.type == "cpu" else None)
    return {"impl": impl, "dtype": dtype, "params": n_params, "tokens_per_s": tps, "step_s": best,
            "peak_memory_bytes": _peak_memory(dev), "flops_per_s": flops * tps, "matmul_peak": peak,
            "mfu": flops * tps / peak}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--worker", nargs=2, metavar=("IMPL", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps, args.warmup, args.batch, args.seq, args.device)))
        return 0

    results = {}
    for dtype in args.dtypes.split(","):
        for impl in ("archlab", "transformers"):
            cmd = [sys.executable, __file__, "--worker", impl, dtype, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq),
                   "--device", args.device]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results[(impl, dtype)] = r
            print(f"{impl:>12} {dtype:>8}: {r['tokens_per_s']:9,.0f} tok/s  step {r['step_s']:.3f}s  "
                  f"peak mem {r['peak_memory_bytes'] / 2**20:7,.0f} MiB  {r['flops_per_s'] / 1e9:7.1f} GFLOP/s  "
                  f"(matmul peak {r['matmul_peak'] / 1e9:.1f}, MFU {r['mfu']:.2f})  params {r['params']:,}",
                  flush=True)
    print(f"\nbatch {args.batch} x seq {args.seq}, {args.steps} timed steps (median), device {args.device}, "
          f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    for dtype in args.dtypes.split(","):
        ours, ref = results[("archlab", dtype)], results[("transformers", dtype)]
        print(f"{dtype}: archlab / transformers tokens/s = {ours['tokens_per_s'] / ref['tokens_per_s']:.2f}x "
              f"(target >= 1.1); peak memory ratio {ours['peak_memory_bytes'] / ref['peak_memory_bytes']:.2f} "
              f"(target <= 1); MFU {ours['mfu']:.2f} (target >= 0.85)")
    if ("archlab", "bfloat16") in results and ("archlab", "float32") in results:
        speed = results[("archlab", "bfloat16")]["tokens_per_s"] / results[("archlab", "float32")]["tokens_per_s"]
        print(f"archlab bf16 autocast / fp32 tokens/s = {speed:.2f}x (target >= 1.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
