"""The CUDA paths in one short run, for a session that is lent a GPU: does every attention backend equal the
eager reference there (fp32 with TF32 off, gradients too, FlexAttention's compiled kernel included), how far
bf16 autocast moves each one, what each kernel costs as the sequence grows, and what training and decoding
reach against transformers on the same card.

    python benchmarks/gpu_check.py --out DIR [--budget 420] [--sections equality,bf16,documents,kernels,generate,train]

Each section has a time budget and stops early rather than running the whole call past its limit; every
result goes to DIR/gpu_check.json as soon as it is measured, so a run cut short keeps what it found. The
variants are tests/variants.py's (every registered switch on a tiny model); equality is the unit tests'
criterion moved to CUDA. Timings: CUDA-synchronised wall clock, median of repeats after warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

RESULTS: dict = {}
OUT = Path(".")
DEV = "cuda"
SECTIONS: list[str] = []


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def save() -> None:
    (OUT / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def section(name: str, seconds: float):
    """Runs fn(deadline) under a budget; an exception is recorded, not raised (the next section still runs)."""
    def wrap(fn):
        def run():
            t0 = time.perf_counter()
            print(f"\n== {name} (budget {seconds:.0f} s)", flush=True)
            try:
                RESULTS[name] = fn(t0 + seconds)
            except Exception as e:   # noqa: BLE001 - a device check reports every failure and goes on
                traceback.print_exc()
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}"}
            RESULTS.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
            save()
        run.name = name
        return run
    return wrap


def timed(fn, repeats: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def logits_and_grads(model, x, backend, **kw):
    from archlab.nn.attention_backends import forced

    model.zero_grad()
    with forced(backend):
        logits = model(x, **kw)
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def ran_backends(monkeypatch_target, wanted: str):
    """Wrap attention_backends.choose to record which backend ran and whether `wanted` supported the call."""
    from archlab.nn import attention_backends as backends

    record: list[tuple[str, str | None]] = []
    original = backends.choose

    def counted(call):
        chosen = original(call)
        record.append((chosen.name, backends.BACKENDS.get(wanted).supports(call)))
        return chosen
    backends.choose = counted
    return record, lambda: setattr(backends, "choose", original)


FIRST = ["window", "local-global", "softcap", "pos-alibi", "pos-t5", "learned-sinks", "gqa", "mqa", "head-dim",
         "rope-local-nope-global", "query-scalar", "base"]


def variant_order():
    from variants import VARIANTS

    return [v for v in FIRST if v in VARIANTS] + sorted(v for v in VARIANTS if v not in FIRST)


def equality(deadline: float) -> dict:
    """Every backend vs eager on CUDA, fp32 (TF32 off), logits and gradients, over the variants."""
    from variants import variant

    from archlab import TransformerLM
    from archlab.nn import attention_backends as backends

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    others = [n for n in backends.BACKENDS.names() if n != "eager"]
    rows, failures, skipped = [], [], []
    for name in variant_order():
        if time.perf_counter() > deadline:
            skipped.append(name)
            continue
        cfg = variant(name).with_overrides({"attention.dropout": 0.0, "d_model": 64})   # head_dim 16: flex's minimum
        torch.manual_seed(0)
        model = TransformerLM(cfg).to(DEV).train()
        x = torch.randint(0, cfg.vocab_size, (2, 40), device=DEV)
        ref, ref_grads = logits_and_grads(model, x, "eager")
        for backend in others:
            record, restore = ran_backends(None, backend)
            try:
                got, grads = logits_and_grads(model, x, backend)
            except Exception as e:   # noqa: BLE001 - a kernel that cannot be built is a finding, not the end
                rows.append(row := {"variant": name, "backend": backend, "error": str(e).splitlines()[0][:300]})
                failures.append(row)
                print("ERROR", row, flush=True)
                continue
            finally:
                restore()
            ran = sorted({r for r, _ in record})
            refused = sorted({why for _, why in record if why})
            d_logits = max_diff(got, ref)
            d_grads = max(max_diff(grads[k], ref_grads[k]) for k in ref_grads)
            ok = d_logits <= 1e-4 + 1e-4 * float(ref.abs().max()) and d_grads <= 1e-4 + 1e-3 * max(
                float(g.abs().max()) for g in ref_grads.values())
            row = {"variant": name, "backend": backend, "ran": ran, "refused": refused[:1],
                   "logits": d_logits, "grads": d_grads, "ok": ok}
            rows.append(row)
            if not ok:
                failures.append(row)
                print("MISMATCH", row, flush=True)
        print(f"{name}: " + ", ".join(f"{r['backend']}={'/'.join(r['ran'])} {r['logits']:.1e}"
                                      for r in rows if r["variant"] == name and "ran" in r), flush=True)
    return {"rows": len(rows), "failures": failures, "skipped_for_time": skipped,
            "ran_flex": sorted({r["variant"] for r in rows if r["backend"] == "flex" and "flex" in r.get("ran", [])}),
            "table": rows}


def bf16(deadline: float) -> dict:
    """Under bf16 autocast: each backend's logits vs fp32 eager, relative to the logits' spread."""
    from variants import variant

    from archlab import TransformerLM
    from archlab.nn import attention_backends as backends
    from archlab.nn.attention_backends import forced

    out = []
    for name in ["base", "window", "softcap", "pos-alibi", "gqa", "learned-sinks"]:
        if time.perf_counter() > deadline:
            break
        cfg = variant(name).with_overrides({"attention.dropout": 0.0, "d_model": 128, "n_layers": 4,
                                            "max_seq_len": 512})
        torch.manual_seed(0)
        model = TransformerLM(cfg).to(DEV).eval()
        x = torch.randint(0, cfg.vocab_size, (2, 300), device=DEV)
        with torch.no_grad():
            with forced("eager"):
                ref32 = model(x).float()
            spread = float(ref32.std())
            for backend in backends.BACKENDS.names():
                with torch.autocast(DEV, dtype=torch.bfloat16), forced(backend):
                    got = model(x).float()
                out.append({"variant": name, "backend": backend,
                            "vs_fp32_rel": max_diff(got, ref32) / spread})
        print(name, " ".join(f"{r['backend']} {r['vs_fp32_rel']:.3f}" for r in out if r["variant"] == name),
              flush=True)
    return {"rows": out}


def documents(deadline: float) -> dict:
    """A packed row with document_ids gives each document's logits run alone, on every backend, on CUDA."""
    from variants import variant

    from archlab import TransformerLM
    from archlab.nn import attention_backends as backends
    from archlab.nn.attention_backends import forced

    torch.backends.cuda.matmul.allow_tf32 = False
    out = []
    for name in ["base", "window", "pos-alibi", "pos-t5", "learned-offset", "local-global"]:
        if time.perf_counter() > deadline:
            break
        cfg = variant(name).with_overrides({"attention.dropout": 0.0, "max_seq_len": 256, "d_model": 64})
        torch.manual_seed(0)
        model = TransformerLM(cfg).to(DEV).eval()
        lengths = [37, 90, 1, 64]
        x = torch.randint(0, cfg.vocab_size, (1, sum(lengths)), device=DEV)
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).to(DEV)[None]
        with torch.no_grad():
            alone, start = [], 0
            with forced("eager"):
                for n in lengths:
                    alone.append(model(x[:, start:start + n]))
                    start += n
            alone_t = torch.cat(alone, dim=1)
            for backend in backends.BACKENDS.names():
                with forced(backend):
                    got = model(x, document_ids=doc)
                out.append({"variant": name, "backend": backend, "max_diff": max_diff(got, alone_t)})
        print(name, " ".join(f"{r['backend']} {r['max_diff']:.1e}" for r in out if r["variant"] == name), flush=True)
    return {"rows": out, "worst": max((r["max_diff"] for r in out), default=None)}


def kernels(deadline: float) -> dict:
    """Attention alone, forward + backward, bf16, 8 heads x 64: ms per call by backend, causal and window 256."""
    from archlab.nn.attention_backends import BACKENDS, AttnCall
    from archlab.nn.masks import MaskSpec

    out = []
    for n in (1024, 4096, 16384, 32768) if DEV == "cuda" else (256,):
        for window in (None, 256):
            spec = MaskSpec() if window is None else MaskSpec().with_window(window)
            for backend in BACKENDS.names():
                if time.perf_counter() > deadline:
                    return {"rows": out, "cut_short": True}
                if backend == "eager" and n > 16384:
                    continue
                q, k, v = (torch.randn(1, 8, n, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                pos = torch.arange(n, device=DEV)[None]
                call = AttnCall(q, k, v, 64 ** -0.5, spec=spec, q_pos=pos, k_pos=pos, aligned=True,
                                is_causal=window is None)
                impl = BACKENDS.get(backend)
                why = impl.supports(call)
                if why:
                    out.append({"n": n, "window": window, "backend": backend, "refused": why})
                    continue

                def step(impl=impl, call=call, q=q, k=k, v=v):
                    o, _ = impl(call)
                    o.sum().backward()
                try:
                    if DEV == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    ms = timed(step, repeats=5, warmup=2) * 1e3
                    peak = torch.cuda.max_memory_allocated() / 2**20 if DEV == "cuda" else 0.0
                    out.append({"n": n, "window": window, "backend": backend, "ms": ms, "peak_mib": peak})
                    print(f"n={n:>6} window={window} {backend:>8}: {ms:8.2f} ms  peak {peak:8.0f} MiB", flush=True)
                except torch.OutOfMemoryError:
                    out.append({"n": n, "window": window, "backend": backend, "oom": True})
                del q, k, v
                if DEV == "cuda":
                    torch.cuda.empty_cache()
    return {"rows": out}


def generate(deadline: float) -> dict:
    """Greedy decoding, bf16, a ~110M LLaMA-like model: archlab.generate vs transformers' generate, same weights."""
    import transformers
    from bench import llama_pair  # benchmarks/bench.py: one LLaMA in transformers and archlab

    import archlab

    hf_cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                      num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                                      max_position_embeddings=2048, tie_word_embeddings=False)
    hf, ours = llama_pair(hf_cfg)
    hf = hf.to(DEV, torch.bfloat16)
    ours = ours.to(DEV, torch.bfloat16).eval()
    out = []
    for batch in (1, 16):
        if time.perf_counter() > deadline:
            break
        prompt = torch.randint(0, hf_cfg.vocab_size, (batch, 64), device=DEV)
        new = 128

        def run_hf(prompt=prompt, new=new):
            with torch.inference_mode():
                return hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                   do_sample=False, pad_token_id=0)

        def run_ours(prompt=prompt, new=new):
            return archlab.generate(ours, prompt, max_new_tokens=new)

        a, b = run_ours(), run_hf()
        agree = (a == b).all(dim=0).long()
        first_diff = int(agree.argmin()) if not bool(agree.all()) else None
        t_ours, t_hf = timed(run_ours, repeats=3, warmup=1), timed(run_hf, repeats=3, warmup=1)
        row = {"batch": batch, "new": new, "archlab_tok_s": batch * new / t_ours, "hf_tok_s": batch * new / t_hf,
               "ratio": t_hf / t_ours, "first_differing_position": first_diff}
        out.append(row)
        print(row, flush=True)
    return {"model_params": ours.num_params(), "rows": out}


def train(deadline: float) -> dict:
    """benchmarks/train_throughput.py on CUDA (fp32 and bf16, compiled and not), then archlab train end to end."""
    out: dict = {}
    budget = max(30, deadline - time.perf_counter() - (100 if "e2e" in SECTIONS else 5))
    cmd = [sys.executable, str(ROOT / "benchmarks/train_throughput.py"), "--device", DEV, "--dtypes",
           "float32,bfloat16", "--compile", "both", "--rounds", "8", "--batch", "16", "--seq", "1024",
           "--no-memory"]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=budget, env=env())
        out["throughput"] = run.stdout[-4000:] + run.stderr[-2000:]
    except subprocess.TimeoutExpired as e:
        out["throughput"] = f"timed out after {budget:.0f} s: " + (e.stdout or b"")[-3000:].decode(errors="replace")
    print(out["throughput"], flush=True)
    data = ROOT / ".gpu/data"
    if "e2e" in SECTIONS and data.exists() and time.perf_counter() < deadline - 60:
        run_dir = Path("/tmp/gpu_train")
        cmd = [sys.executable, "-m", "archlab", "train", "--preset", "tiny:llama2-7b", "--data", str(data),
               "--out", str(run_dir), "--no-progress",
               "--set", "d_model=512", "--set", "n_layers=8", "--set", "attention.n_heads=8",
               "--set", "max_seq_len=1024", "--set", "train.seq_len=1024", "--set", "train.batch_size=32",
               "--set", "train.budget=200", "--set", "train.eval_every=100", "--set", "train.dtype=auto",
               "--set", "train.compile=true", "--set", "train.lr=1e-3", "--set", "train.warmup_steps=20",
               "--set", "train.checkpoint_every=0", "--set", "train.sample_every=-1"]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, deadline - time.perf_counter()),
                                 env=env())
            out["archlab_train"] = {"rc": run.returncode, "tail": (run.stdout + run.stderr)[-4000:]}
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists():
                out["archlab_train"]["last_metrics"] = metrics.read_text().splitlines()[-3:]
        except subprocess.TimeoutExpired as e:
            out["archlab_train"] = {"timed_out": True, "tail": (e.stdout or b"")[-3000:].decode(errors="replace")}
        print(out["archlab_train"], flush=True)
    return out


def env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}",
            "PYTHONUNBUFFERED": "1"}


def flex_unit_test(deadline: float) -> dict:
    """The repository's own CUDA test (skipped on CPU machines)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/nn/test_flex_attention.py", "-k", "cuda", "-o", "addopts="],
                         capture_output=True, text=True, cwd=ROOT, env=env(),
                         timeout=max(20, deadline - time.perf_counter()))
    print(run.stdout[-2000:], run.stderr[-1000:], flush=True)
    return {"rc": run.returncode, "tail": run.stdout[-2000:]}


def main() -> None:
    global OUT, DEV, SECTIONS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for all sections together")
    ap.add_argument("--cpu-dry-run", action="store_true", help="check the script itself on a CPU (tiny sizes)")
    ap.add_argument("--sections", default="environment,flex_test,equality,documents,bf16,kernels,generate,train,e2e")
    args = ap.parse_args()
    OUT = Path(args.out)
    OUT.mkdir(parents=True, exist_ok=True)
    if args.cpu_dry_run:
        DEV = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device")
    share = {"environment": 0.02, "flex_test": 0.08, "equality": 0.25, "documents": 0.05, "bf16": 0.05,
             "kernels": 0.15, "generate": 0.12, "train": 0.28}
    props = torch.cuda.get_device_properties(0) if DEV == "cuda" else None
    RESULTS["environment"] = {"device": props.name if props else "cpu",
                              "memory_gib": props.total_memory / 2**30 if props else None,
                              "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    print(RESULTS["environment"], flush=True)
    fns = {"flex_test": flex_unit_test, "equality": equality, "documents": documents, "bf16": bf16,
           "kernels": kernels, "generate": generate, "train": train}
    SECTIONS = args.sections.split(",")
    for name in SECTIONS:
        if name in fns:
            section(name, args.budget * share[name])(fns[name])()
    save()
    print("\nwrote", OUT / "gpu_check.json")


if __name__ == "__main__":
    main()
