"""Training throughput of archlab's step against transformers' LlamaForCausalLM, same run, same config.

    .venv/bin/python benchmarks/train_throughput.py [--rounds 15] [--batch 8] [--seq 256] [--threads 2]

A ~14M-parameter LLaMA-style model (d 320, 8 layers, 5 heads, SwiGLU 768, vocab 8192, untied), AdamW,
grad clip 1.0, fp32 and bf16 autocast. Each side runs its own training loss path: ours
`model(x, targets=y)` (what `archlab train` runs: head and cross-entropy fused in row chunks),
transformers' `labels=` path (float32 logits, then cross-entropy). The machine may be shared, so throughput is measured
*interleaved*: one process holds a model per (implementation, dtype) and runs one training step of
each per round, in rotating order; each round gives ratios of steps taken moments apart
(archlab / transformers per dtype, bf16 / fp32 per implementation), and the reported ratios are
medians over rounds. tokens/s is from the median step,
best-case tokens/s from the fastest; MFU = training FLOPs per token x best tokens/s over the best-of
matmul FLOP/s measured in the same process for that dtype (both best-case, so load cancels).
Peak memory (CPU: peak RSS; CUDA: max allocated) is measured per (impl, dtype) in a fresh subprocess.

MFU has a ceiling below 1 that depends on the model, not the implementation: the weight matmuls of
this model (K = 320 or 768, M = batch x seq) run below the big square matmuls that set the peak.
The benchmark times them alone, with the layouts of a Linear's forward and backward, and prints the
MFU a step could reach if nothing else cost time (attention's FLOPs counted at the peak).

bf16 runs only where the device has bf16 matmul units (`--dtypes auto`, archlab.training.precision): a CPU
with AVX2 alone emulates bf16 at ~1/100 of its float32 matmul rate.

On CPU the allocator matters: glibc serves buffers over its mmap threshold (at most 32 MB) with fresh
pages, so a step that allocates (b*t) x v float32 logits page-faults them in on every step, while
archlab's chunked loss never allocates them. `--allocator no-mmap` removes that cost for both sides
(what jemalloc/tcmalloc or MALLOC_MMAP_MAX_=0 give); run both to see how much of a ratio is memory
behaviour and how much is arithmetic.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

D_MODEL, N_LAYERS, N_HEADS, D_FF, VOCAB = 320, 8, 5, 768, 8192
IMPLS = ("archlab", "transformers")
COMPILED: set[str] = set()   # implementations run under torch.compile (--compile)


def model_config():
    from archlab.config import ModelConfig

    return ModelConfig(name="bench-llama", vocab_size=VOCAB, d_model=D_MODEL, n_layers=N_LAYERS, max_seq_len=2048,
                       attention={"n_heads": N_HEADS}, mlp={"activation": "swiglu", "d_ff": D_FF},
                       norm={"kind": "rmsnorm", "eps": 1e-5}, position={"kind": "rope", "rope_theta": 10000.0})


def build(impl: str):
    import torch

    if impl == "archlab":
        from archlab.models.decoder import TransformerLM

        model = TransformerLM(model_config())
        return model, lambda x, y: model(x, targets=y).total      # the step `archlab train` runs
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=D_FF, num_hidden_layers=N_LAYERS,
                     num_attention_heads=N_HEADS, num_key_value_heads=N_HEADS, max_position_embeddings=2048,
                     rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                     mlp_bias=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf)
    # transformers' own loss path (logits upcast to float32, then cross-entropy); shift_labels: the
    # targets are already shifted, as ours are
    return model, lambda x, y: model(input_ids=x, labels=y, shift_labels=y, use_cache=False).loss


def make_step(impl: str, dtype: str, batch: int, seq: int, device):
    """A closure running one optimizer step (the same loop for both implementations), and the model."""
    import torch

    from archlab.eval.evaluate import autocast

    model, loss_fn = build(impl)
    model.to(device).train()
    if impl in COMPILED:  # torch.compile (inductor); the first steps pay the compilation
        model.compile()
    # fused AdamW on both sides, as archlab.training.trainer uses it (CPU and CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (batch, seq + 1), generator=gen).to(device)
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()   # as the data loader gives them

    def step():
        with autocast(device, dtype):
            loss = loss_fn(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step, model


def palm_flops_per_token(n_params: int, seq: int) -> float:
    """The common estimate 6N + 12 L d T (PaLM, Chowdhery et al. 2022, App. B; nanoGPT's estimate_mfu):
    N = all parameters, attention counted over the full T x T square. It over-counts this model:
    the input embedding is a lookup, not a matmul (2.6M of the 14.4M), and causal attention does half
    the square. Printed beside our exact count because published MFU figures use it."""
    return 6.0 * n_params + 12.0 * N_LAYERS * D_MODEL * seq


def speed_worker(dtypes: list[str], rounds: int, warmup: int, batch: int, seq: int, device: str) -> dict:
    """Every (implementation, dtype) in one process, steps interleaved; see the module docstring."""
    import torch

    from archlab.training.throughput import matmul_peak_flops, train_flops_per_token

    dev = torch.device(device)
    keys = [(impl, dtype) for dtype in dtypes for impl in IMPLS]
    steps = {key: make_step(*key, batch, seq, dev) for key in keys}
    for _ in range(warmup):
        for key in keys:
            steps[key][0]()
    times = {key: [] for key in keys}
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:   # rotate: no fixed neighbour
            t0 = time.perf_counter()
            steps[key][0]()
            times[key].append(time.perf_counter() - t0)
    out = {"rounds": rounds}
    for dtype in dtypes:
        peak = matmul_peak_flops(dev, dtype, seconds=3.0)
        ratios = [t / o for o, t in zip(times[("archlab", dtype)], times[("transformers", dtype)])]
        out[dtype] = {"matmul_peak": peak, "ratio": statistics.median(ratios), "ratios": ratios,
                      **mfu_ceiling(steps[("archlab", dtype)][1], batch * seq, seq, dev, dtype, peak)}
        for impl in IMPLS:
            n_params = sum(p.numel() for p in steps[(impl, dtype)][1].parameters())
            flops = train_flops_per_token(model_config(), seq)
            med, best = statistics.median(times[(impl, dtype)]), min(times[(impl, dtype)])
            out[dtype][impl] = {"params": n_params, "step_s": med, "tokens_per_s": batch * seq / med,
                                "best_tokens_per_s": batch * seq / best,
                                "mfu": flops * batch * seq / best / peak,
                                "mfu_6n": palm_flops_per_token(n_params, seq) * batch * seq / best / peak}
    if "float32" in dtypes and "bfloat16" in dtypes:
        for impl in IMPLS:   # bf16 speed-up, per round (adjacent steps)
            ratios = [f / b for f, b in zip(times[(impl, "float32")], times[(impl, "bfloat16")])]
            out[f"{impl}_bf16_speedup"] = statistics.median(ratios)
    return out


def mfu_ceiling(model, tokens: int, seq: int, device, dtype: str, peak: float) -> dict:
    """The MFU a step of this model could reach if only its weight matmuls cost time ("matmuls"), and
    if attention's FLOPs also ran at the peak ("step"): upper bounds that the measured MFU sits under."""
    from archlab.training.throughput import matmul_ceiling, matmul_weight_shapes, train_flops_per_token

    mm_flops, mm_seconds = matmul_ceiling(matmul_weight_shapes(model), tokens, device, dtype)
    step_flops = train_flops_per_token(model_config(), seq) * tokens
    return {"ceiling_matmuls": mm_flops / mm_seconds / peak,
            "ceiling_step": step_flops / (mm_seconds + (step_flops - mm_flops) / peak) / peak}


def memory_worker(impl: str, dtype: str, batch: int, seq: int, device: str) -> dict:
    import torch

    from archlab.training.throughput import peak_memory

    dev = torch.device(device)
    step, _ = make_step(impl, dtype, batch, seq, dev)
    for _ in range(2):
        step()
    return {"peak_memory_bytes": peak_memory(dev)}


def _run_worker(args, *worker_args) -> dict:
    cmd = [sys.executable, __file__, "--worker", *worker_args, "--rounds", str(args.rounds),
           "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq),
           "--device", args.device, "--threads", str(args.threads), "--compile", args.compile]
    env = os.environ.copy()
    if args.allocator == "no-mmap":   # glibc keeps freed memory for reuse: no page faults on big buffers
        env.update(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 40))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {worker_args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="timed steps per implementation "
                        "(the ratios drift a few %% with fewer on a shared machine)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--dtypes", default="auto", help="comma list of float32, bfloat16; 'auto': float32, "
                        "and bfloat16 where the device has bf16 matmul units (emulated bf16 is ~100x slower)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--compile", default="none", choices=["none", "archlab", "both"],
                        help="torch.compile ours (the trainer's `train.compile=true`) or both models; "
                        "use --warmup 3 or more so compilation is not timed")
    parser.add_argument("--allocator", default="default", choices=["default", "no-mmap"],
                        help="glibc malloc as the process gets it, or with mmap off and no trimming "
                        "(MALLOC_MMAP_MAX_=0): big short-lived buffers then reuse memory instead of "
                        "page-faulting fresh pages on every step")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    COMPILED.update({"none": [], "archlab": ["archlab"], "both": list(IMPLS)}[args.compile])
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    if args.worker:
        kind, *rest = args.worker
        if kind == "speed":
            result = speed_worker(rest, args.rounds, args.warmup, args.batch, args.seq, args.device)
        else:
            result = memory_worker(rest[0], rest[1], args.batch, args.seq, args.device)
        print(json.dumps(result))
        return 0

    import torch

    from archlab.runs.provenance import device_name, provenance_line
    from archlab.training.precision import auto_dtype

    print(f"device: {device_name(args.device)}", flush=True)
    print(provenance_line(args.device), flush=True)
    dtypes = args.dtypes.split(",")
    if args.dtypes == "auto":
        chosen, why = auto_dtype(args.device)
        print(f"train.dtype=auto chooses {chosen} here: {why}", flush=True)
        dtypes = ["float32"] + (["bfloat16"] if chosen == "bfloat16" else [])
        if chosen != "bfloat16":
            print("bfloat16 skipped (pass --dtypes float32,bfloat16 to time it anyway)", flush=True)
    speed = _run_worker(args, "speed", *dtypes)
    for dtype in dtypes:
        r = speed[dtype]
        for impl in IMPLS:
            s = r[impl]
            print(f"{impl:>12} {dtype:>8}: {s['tokens_per_s']:9,.0f} tok/s median (best {s['best_tokens_per_s']:,.0f})"
                  f"  step {s['step_s']:.3f}s  MFU {s['mfu']:.2f}  params {s['params']:,}")
        print(f"{'':>12} {dtype:>8}: matmul peak {r['matmul_peak'] / 1e9:.1f} GFLOP/s; per-round ratios "
              + " ".join(f"{x:.2f}" for x in r["ratios"]), flush=True)
    memory = {}
    if not args.no_memory:
        for dtype in dtypes:
            for impl in IMPLS:
                memory[(impl, dtype)] = _run_worker(args, "memory", impl, dtype)["peak_memory_bytes"]
    threads = args.threads or torch.get_num_threads()
    print(f"\nbatch {args.batch} x seq {args.seq}, {args.rounds} interleaved rounds, device {args.device}, "
          f"torch threads {threads}, compiled: {args.compile}, allocator: {args.allocator}")
    for dtype in dtypes:
        r = speed[dtype]
        line = (f"{dtype}: archlab / transformers tokens/s = {r['ratio']:.2f}x (median of rounds; target >= 1.1); "
                f"MFU {r['archlab']['mfu']:.2f} vs {r['transformers']['mfu']:.2f} (target >= 0.85; "
                f"6N+12LdT estimate {r['archlab']['mfu_6n']:.2f} vs {r['transformers']['mfu_6n']:.2f}); "
                f"matmul peak {r['matmul_peak'] / 1e9:.1f} GFLOP/s; MFU ceiling {r['ceiling_step']:.2f} "
                f"(this model's weight matmuls alone reach {r['ceiling_matmuls']:.2f} of the peak)")
        if memory:
            ours, ref = memory[("archlab", dtype)], memory[("transformers", dtype)]
            line += f"; peak memory {ours / 2**20:,.0f} vs {ref / 2**20:,.0f} MiB = {ours / ref:.2f} (target <= 1)"
        print(line)
    for impl in IMPLS:
        if f"{impl}_bf16_speedup" in speed:
            print(f"{impl} bf16 autocast / fp32 tokens/s = {speed[impl + '_bf16_speedup']:.2f}x (median of rounds)"
                  + (" (target >= 1.8)" if impl == "archlab" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
