"""Decode throughput of archlab.generate against transformers' generate on the same weights, and
against archlab's own uncached loop; measured KV-cache bytes against the analytic estimate; and the same
model decoded through its modules with its decode plan (packed weight copies, direct calls: the default)
against the plain module path (fast_decode=False).

    .venv/bin/python benchmarks/generate.py [--threads 1] [--new 128] [--prompt 32] [--rounds 7] [--clock cpu]
    .venv/bin/python benchmarks/generate.py --model demo-post-training    # the post-training demo's sizes

A ~8.5M-parameter LLaMA config (random weights) is built in transformers, saved, and loaded into
archlab through archlab.interop.load_hf (--model demo-post-training: a LLaMA of the post-training demo's sizes,
2 layers, d 128, 4 heads, SwiGLU 512, vocabulary 260; the demo's own model has learned positions, which no
transformers family pairs with RMSNorm and SwiGLU, so RoPE stands in). archlab decodes eagerly and through its
compiled step (`compile=True`, nn/compiled_step.py), compiled in the first call (its seconds printed).
Both sides run greedy decoding with EOS disabled, so both
produce exactly --new tokens; tokens/s counts batch x new tokens over the whole call (prefill
included, as a user sees it). The machine may be shared, so the calls are *interleaved*: each
round runs archlab then transformers (order alternating between rounds) moments apart, and the
reported ratio is the median of the per-round ratios; tokens/s is from the median call. The
greedy tokens of both are compared on the full --new tokens.
"""
from __future__ import annotations

import statistics
import time

import torch
from bench import interleaved, llama_pair, parser, start  # benchmarks/bench.py


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per batch size")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--uncached-new", type=int, default=32, help="tokens for the (slow) uncached loop")
    ap.add_argument("--uncached-rounds", type=int, default=3)
    ap.add_argument("--model", choices=sorted(SHAPES), default="bench")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (a shared machine's other tenants drop out)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="leave out the compiled step")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    start(args)

    import transformers

    import archlab
    from archlab.models.accounting import kv_cache_bytes
    from archlab.nn.kv_cache import StaticKVCache

    hf_cfg = transformers.LlamaConfig(max_position_embeddings=1024, tie_word_embeddings=False, **SHAPES[args.model])
    hf, ours = llama_pair(hf_cfg)
    n_params = ours.num_params()
    print(f"model: LLaMA-like {n_params / 1e6:.2f}M params, {hf_cfg.num_hidden_layers} layers, d={hf_cfg.hidden_size}, "
          f"heads {hf_cfg.num_attention_heads}/{hf_cfg.num_key_value_heads}; torch threads={torch.get_num_threads()}; "
          f"prompt {args.prompt}, new {args.new} tokens; {args.rounds} interleaved rounds, {args.clock} clock")

    for batch in (int(b) for b in args.batches.split(",")):
        prompt = torch.randint(0, hf_cfg.vocab_size, (batch, args.prompt))
        mask = torch.ones_like(prompt)

        def run_hf(new=args.new, prompt=prompt, mask=mask):
            with torch.inference_mode():
                return hf.generate(prompt, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                   pad_token_id=0)

        def run_ours(new=args.new, use_cache=True, prompt=prompt, compile=False):
            return archlab.generate(ours, prompt, max_new_tokens=new, use_cache=use_cache, compile=compile)

        same = torch.equal(run_hf(), run_ours())
        fns = {"archlab": run_ours, "transformers": run_hf}
        if args.compile:
            fns["compiled"] = lambda: run_ours(compile=True)
            t0 = time.perf_counter()
            same_compiled = torch.equal(fns["compiled"](), run_ours())
            print(f"batch {batch}: compiled step: first call {time.perf_counter() - t0:.1f} s wall (compiling "
                  f"{ours.decode_plan().step.compile_seconds:.1f} s in all so far) | greedy tokens equal to eager: "
                  f"{same_compiled}", flush=True)
        times = interleaved(fns, args.rounds, clock=clock)
        ratios = [t / o for o, t in zip(times["archlab"], times["transformers"])]
        if args.compile:
            rc = [t / c for c, t in zip(times["compiled"], times["transformers"])]
            re = [e / c for c, e in zip(times["compiled"], times["archlab"])]
            print(f"batch {batch}: compiled {batch * args.new / statistics.median(times['compiled']):8.1f} tok/s | "
                  f"ratio vs transformers {statistics.median(rc):.2f}x (median; rounds "
                  + " ".join(f"{r:.2f}" for r in rc) + f") | vs archlab eager {statistics.median(re):.2f}x", flush=True)
        unc = interleaved({"cached": lambda: run_ours(args.uncached_new),
                           "uncached": lambda: run_ours(args.uncached_new, use_cache=False)},
                          args.uncached_rounds, warmup=0)
        unc_ratio = statistics.median(u / c for c, u in zip(unc["cached"], unc["uncached"]))
        tps = lambda ts, n=args.new, batch=batch: batch * n / statistics.median(ts)  # noqa: E731
        print(f"batch {batch}: archlab {tps(times['archlab']):8.1f} tok/s | transformers "
              f"{tps(times['transformers']):8.1f} tok/s | ratio vs transformers "
              f"{statistics.median(ratios):.2f}x (median; rounds "
              + " ".join(f"{r:.2f}" for r in ratios) + ")"
              f" | uncached {tps(unc['uncached'], args.uncached_new):7.1f} tok/s, cached/uncached "
              f"{unc_ratio:.2f}x ({args.uncached_new} new) | greedy tokens equal: {same}", flush=True)

    seq = args.prompt + args.new
    for name, cfg in (("llama (global)", ours.config),
                      ("window 64 LLLG", ours.config.with_overrides(
                          {"attention.window": 64, "attention.layer_pattern": "LLLG"}))):
        cache = StaticKVCache(cfg, 8, seq, dtype=torch.float32)
        model = archlab.TransformerLM(cfg).eval()
        with torch.inference_mode():
            model(torch.randint(0, cfg.vocab_size, (8, seq)), cache=cache)
        analytic = kv_cache_bytes(cfg, seq, batch=8, dtype="float32")
        print(f"KV cache {name}: measured {cache.nbytes:,} B, analytic {analytic:,} B, "
              f"ratio {cache.nbytes / analytic:.3f}")
    packed_weights(ours, args)


SHAPES = {   # transformers LlamaConfig sizes per --model
    "bench": dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4),
    "demo-post-training": dict(vocab_size=260, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4),
}


def packed_weights(model, args) -> None:
    """The model's cached decode with the packed weight copies and direct module calls (archlab.nn.fused,
    the default) against without them (fast_decode=False), interleaved: what the copies buy."""
    import archlab

    for batch in (int(b) for b in args.batches.split(",")):
        prompt = torch.randint(0, model.config.vocab_size, (batch, args.prompt))
        runs = {"packed": lambda p=prompt: archlab.generate(model, p, max_new_tokens=args.new),
                "plain": lambda p=prompt: archlab.generate(model, p, max_new_tokens=args.new, fast_decode=False)}
        same = torch.equal(runs["packed"](), runs["plain"]())
        times = interleaved(runs, args.rounds)
        ratio = statistics.median(p / q for q, p in zip(times["packed"], times["plain"]))
        tps = batch * args.new / statistics.median(times["packed"])
        print(f"LLaMA model, batch {batch}: packed weights {tps:8.1f} tok/s, {ratio:.2f}x the plain module "
              f"path (median) | greedy tokens equal: {same}", flush=True)


if __name__ == "__main__":
    main()
