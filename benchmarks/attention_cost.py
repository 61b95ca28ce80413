"""What attention costs against sequence length: a training step (forward + backward) of a small byte-level
model with full causal attention, sliding windows and a local/global pattern, beside `transformers`'
Mistral with the same window, and the loss by position that the window costs (speed is never reported
without quality).

    .venv/bin/python benchmarks/attention_cost.py [--lengths 1024,2048,4096,8192,16384,32768] [--rounds 3]
        [--window 256] [--hf-max 16384] [--quality-steps 300] [--kernels 1024,4096,16384] [--plot attention_cost.png]

The model: 2 layers, d_model 128, 4 heads, SwiGLU d_ff 256, RoPE, RMSNorm, vocabulary 256 (bytes),
batch 1, float32. Variants:
  full        causal attention over every earlier token (SDPA's flash kernel: the causal half only)
  window W    a sliding window of W tokens (the query and W-1 before it) on every layer
  window 512  the same with 512
  LG          window W on layer 0, full attention on layer 1 (a local/global pattern)
  strided     Sparse Transformer strided layers, l = 128: the 128 keys before, and every 128th beyond
  longformer  window W plus 16 global tokens (the first 16 positions see and are seen by all)
  mistral     transformers' MistralForCausalLM, sliding_window=W, its default (SDPA) attention: the window
              is a dense (n, n) mask, so its cost and memory stay quadratic; it is not run past --hf-max
              (its float mask needs n² x 4 bytes: 4 GiB at 32k per mask, and more in the backward)
Time: interleaved rounds (one step of each variant per round, the order rotating), medians, so load on a
shared machine falls on every variant alike; the ratios are medians of per-round ratios. Peak memory: each
(variant, n) steps once in a fresh subprocess: the peak RSS of the step (VmHWM, reset after the model is
built) minus the RSS before it.

Kernels (--kernels): attention alone (forward + backward, causal, 4 heads of 32, batch 1), peak memory of the
eager reference (the (t, t) scores), SDPA and the tiled kernel (nn/tiled_attention.py, O(n)) in fresh processes.

Quality (--quality-steps > 0): the full and the window-W model train the same steps on the same batches of
bytes of the local Python standard library at 4·W tokens, then report held-out loss (bits per byte) for
positions inside the window (< W, where the two see the same keys) and past it.
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time

import torch
from bench import interleaved, parser, start  # benchmarks/bench.py: one call of each per round, the order rotating

D_MODEL, N_LAYERS, N_HEADS, D_FF, VOCAB = 128, 2, 4, 256, 256
STRIDE = 128          # the strided pattern's l (Child et al. used l ~ sqrt(n): 128 at 16k)
GLOBAL_TOKENS = 16    # Longformer: the first 16 positions global, beside the window


def archlab_config(variant: str, window: int, max_len: int):
    from archlab.config import ModelConfig

    base = ModelConfig(name=f"cost-{variant}", vocab_size=VOCAB, d_model=D_MODEL, n_layers=N_LAYERS,
                       max_seq_len=max_len, attention={"n_heads": N_HEADS},
                       mlp={"activation": "swiglu", "d_ff": D_FF}, norm={"kind": "rmsnorm", "eps": 1e-5},
                       position={"kind": "rope", "rope_theta": 10000.0})
    if variant == "full":
        return base
    if variant == "LG":
        return base.with_overrides({"attention.window": window, "attention.layer_pattern": "LG"})
    if variant == "strided":
        return base.with_overrides({"attention.sparse": "strided", "attention.sparse_stride": STRIDE})
    if variant == "longformer":
        return base.with_overrides({"attention.window": window, "attention.global_tokens": GLOBAL_TOKENS})
    if variant.startswith("window"):
        size = int(variant.split()[1]) if " " in variant else window
        return base.with_overrides({"attention.window": size})
    raise ValueError(variant)


def build(variant: str, window: int, max_len: int):
    torch.manual_seed(0)
    if variant == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        cfg = MistralConfig(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=D_FF,
                            num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS, num_key_value_heads=N_HEADS,
                            max_position_embeddings=max_len, sliding_window=window, tie_word_embeddings=False,
                            attn_implementation="sdpa")
        return MistralForCausalLM(cfg)
    from archlab import TransformerLM

    return TransformerLM(archlab_config(variant, window, max_len))


def step_fn(variant: str, model, n: int):
    x = torch.randint(0, VOCAB, (1, n + 1))
    inputs, targets = x[:, :-1], x[:, 1:]

    def step():
        model.zero_grad(set_to_none=True)
        if variant == "mistral":
            loss = model(input_ids=inputs, labels=x[:, :-1]).loss   # shifts inside
        else:
            loss = model(inputs, targets=targets).total
        loss.backward()
    return step


def variants(window: int) -> list[str]:
    return ["full", f"window {window}", "window 512", "LG", "strided", "longformer", "mistral"]


def peak_memory(variant: str, n: int, window: int) -> float | None:
    """MiB above the RSS before the step, one step in a fresh process (None: it failed, e.g. out of memory)."""
    code = (f"import sys; sys.path.insert(0, {sys.path[0]!r}); import attention_cost as a; "
            f"print(a._one_step_peak({variant!r}, {n}, {window}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return float(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _one_step_peak(variant: str, n: int, window: int) -> float:
    torch.set_num_threads(2)
    model = build(variant, window, n + 1)
    step = step_fn(variant, model, n)
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:   # reset VmHWM (peak RSS) to the current RSS (Linux)
        f.write("5")
    step()
    return (_status_kib("VmHWM") - base) / 1024


def _status_kib(field: str) -> int:
    """A /proc/self/status figure in KiB: VmRSS now, VmHWM the peak (per address space, so unlike
    getrusage's ru_maxrss it does not inherit the parent's peak across fork + exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def timing(lengths: list[int], window: int, rounds: int, hf_max: int, memory: bool) -> dict:
    results: dict = {}
    for n in lengths:
        names = [v for v in variants(window) if v != "mistral" or n <= hf_max]
        fns = {v: step_fn(v, build(v, window, n + 1), n) for v in names}
        times = interleaved(fns, rounds, warmup=1)
        per_round = {v: times[v] for v in names}
        row = {v: statistics.median(t) for v, t in per_round.items()}
        ratios = {v: statistics.median(a / b for a, b in zip(per_round["full"], per_round[v])) for v in names}
        ratios_hf = ({v: statistics.median(a / b for a, b in zip(per_round["mistral"], per_round[v]))
                      for v in names} if "mistral" in names else {})
        mem = {v: peak_memory(v, n, window) for v in names} if memory else {}
        results[n] = {"seconds": row, "speedup_vs_full": ratios, "speedup_vs_mistral": ratios_hf, "peak_mib": mem}
        print(f"n={n:>6}  " + "  ".join(
            f"{v}: {row[v] * 1e3:8.1f} ms ({ratios[v]:.2f}x full"
            + (f", {ratios_hf[v]:.2f}x mistral" if ratios_hf else "") + ")"
            + (f" {mem[v]:.0f} MiB" if mem.get(v) is not None else "") for v in names), flush=True)
        del fns
    return results


def flatness(lengths: list[int], window: int, rounds: int) -> dict[int, float]:
    """Microseconds per token of the window-W model's step timed alone (best of `rounds`: no neighbour's
    cache or allocator state in the way), for the "flat in n" claim."""
    out = {}
    for n in lengths:
        step = step_fn(f"window {window}", build(f"window {window}", window, n + 1), n)
        step()
        best = min(interleaved({"w": step}, rounds, warmup=0)["w"])
        out[n] = best / n * 1e6
        print(f"window {window} alone, n={n:>6}: {out[n]:.1f} us/token", flush=True)
    lo, hi = min(out.values()), max(out.values())
    print(f"window {window} alone: time per token within {100 * (hi / lo - 1):.0f}% over {min(out)}..{max(out)}")
    return out


def quality(window: int, steps: int) -> dict:
    """Held-out bits per byte inside and past the window, full vs window-W, the same steps and batches each."""
    from streaming_llm import corpus_bytes  # benchmarks/streaming_llm.py: the standard library's bytes

    train_bytes, held_bytes = corpus_bytes()
    train = torch.frombuffer(bytearray(train_bytes), dtype=torch.uint8).long()
    held = torch.frombuffer(bytearray(held_bytes), dtype=torch.uint8).long()
    ctx, out = 4 * window, {}
    for variant in ("full", f"window {window}"):
        model = build(variant, window, ctx)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        gen, t0 = torch.Generator().manual_seed(0), time.perf_counter()
        for _ in range(steps):
            starts = torch.randint(0, len(train) - ctx - 1, (8,), generator=gen)
            x = torch.stack([train[s:s + ctx + 1] for s in starts])
            loss = model(x[:, :-1], targets=x[:, 1:]).total
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        seconds = time.perf_counter() - t0
        model.eval()
        starts = torch.arange(0, len(held) - ctx - 1, ctx)[:64]
        x = torch.stack([held[s:s + ctx + 1] for s in starts])
        with torch.no_grad():
            logits = model(x[:, :-1]).float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")   # (b, t)
        bits = nll / math.log(2)
        inside, past = float(bits[:, :window].mean()), float(bits[:, window:].mean())
        out[variant] = {"steps": steps, "seconds": seconds, "inside": inside, "past": past}
        print(f"quality {variant}: {steps} steps in {seconds:.0f} s, bits/byte inside the window {inside:.3f}, "
              f"past it {past:.3f}", flush=True)
    return out


def kernel_memory(lengths: list[int]) -> dict:
    """Attention-only peak MiB per (kernel, n), each in a fresh process."""
    out: dict = {}
    for n in lengths:
        out[n] = {}
        for kernel in ("eager", "sdpa", "tiled"):
            code = (f"import sys; sys.path.insert(0, {sys.path[0]!r}); import attention_cost as a; "
                    f"print(a._kernel_peak({kernel!r}, {n}))")
            run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            try:
                out[n][kernel] = float(run.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                out[n][kernel] = None
        print(f"attention alone, n={n:>6}: " + "  ".join(
            f"{k} {'failed' if v is None else f'{v:.0f} MiB'}" for k, v in out[n].items()), flush=True)
    return out


def _kernel_peak(kernel: str, n: int) -> float:
    from archlab.nn.attention_backends import BACKENDS, AttnCall
    from archlab.nn.masks import MaskSpec

    torch.set_num_threads(2)
    q, k, v = (torch.randn(1, N_HEADS, n, D_MODEL // N_HEADS, requires_grad=True) for _ in range(3))
    pos = torch.arange(n)[None]
    call = AttnCall(q, k, v, (D_MODEL // N_HEADS) ** -0.5, spec=MaskSpec(), q_pos=pos, k_pos=pos, aligned=True)
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out, _ = BACKENDS.get(kernel)(call)
    out.sum().backward()
    return (_status_kib("VmHWM") - base) / 1024


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lengths = sorted(results)
    names = list(results[lengths[0]]["seconds"])
    for v in names:
        xs = [n for n in lengths if v in results[n]["seconds"]]
        ax.plot(xs, [results[n]["seconds"][v] / n * 1e6 for n in xs], marker="o", label=v)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("training step time per token (µs)")
    ax.set_title("attention cost: forward + backward, 2 layers, d 128, fp32")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-max", type=int, default=16384, help="longest sequence for transformers' Mistral")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--quality-steps", type=int, default=300, help="0: skip the loss-by-position part")
    ap.add_argument("--kernels", default="1024,4096,16384",
                    help="lengths for the attention-only peak memory of eager / sdpa / tiled ('': skip)")
    ap.add_argument("--plot", default="attention_cost.png")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--flat-only", action="store_true",
                    help="only time the window-W model alone per length (time per token against n)")
    args = ap.parse_args()
    start(args)
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.flat_only:
        flatness(lengths, args.window, args.rounds)
        return
    results = timing(lengths, args.window, args.rounds, args.hf_max, not args.no_memory)
    if args.plot:
        plot(results, args.plot)
    report = {"timing": results}
    if args.kernels:
        report["kernels"] = kernel_memory([int(n) for n in args.kernels.split(",")])
    if args.quality_steps > 0:
        report["quality"] = quality(args.window, args.quality_steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
