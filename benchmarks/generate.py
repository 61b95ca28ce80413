"""Decode throughput of archlab.generate against transformers' generate on the same weights, and
against archlab's own uncached loop; measured KV-cache bytes against the analytic estimate.

    .venv/bin/python benchmarks/generate.py [--threads 1] [--new 128] [--prompt 32] [--repeats 3]

A ~15M-parameter LLaMA config (random weights) is built in transformers, saved, and loaded into
archlab through archlab.interop.load_hf. Both sides run greedy decoding with EOS disabled, so both
produce exactly --new tokens; tokens/s counts batch x new tokens over the whole call (prefill
included, as a user sees it). Ratios come from the same run; the best of --repeats is kept.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch


def _best(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--uncached-new", type=int, default=64, help="tokens for the (slow) uncached loop")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    import archlab
    from archlab.accounting import kv_cache_bytes
    from archlab.interop import load_hf
    from archlab.nn.kv_cache import StaticKVCache

    hf_cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688,
                                      num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.generation_config.eos_token_id = None
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder, safe_serialization=True)
        ours = load_hf(folder)
    n_params = ours.num_params()
    print(f"model: LLaMA-like {n_params / 1e6:.1f}M params, 6 layers, d=256, GQA 8/4; "
          f"torch threads={args.threads}; prompt {args.prompt}, new {args.new} tokens")

    for batch in (1, 8):
        prompt = torch.randint(0, hf_cfg.vocab_size, (batch, args.prompt))
        mask = torch.ones_like(prompt)

        def run_hf(new=args.new):
            with torch.inference_mode():
                return hf.generate(prompt, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                   pad_token_id=0)

        def run_ours(new=args.new, use_cache=True):
            return archlab.generate(ours, prompt, max_new_tokens=new, use_cache=use_cache)

        same = torch.equal(run_hf(16), run_ours(16))
        t_hf, t_ours = float("inf"), float("inf")
        for _ in range(args.repeats):  # interleaved: load changes on a shared machine hit both
            t_hf, t_ours = min(t_hf, _best(run_hf, 1)), min(t_ours, _best(run_ours, 1))
        t_unc = _best(lambda: run_ours(args.uncached_new, use_cache=False), 1)
        tps = lambda t, n=args.new: batch * n / t  # noqa: E731
        print(f"batch {batch}: archlab {tps(t_ours):8.1f} tok/s | transformers {tps(t_hf):8.1f} tok/s"
              f" | archlab uncached {tps(t_unc, args.uncached_new):8.1f} tok/s ({args.uncached_new} new)"
              f" | ratio vs transformers {t_hf / t_ours:.2f}x, vs uncached "
              f"{tps(t_ours) / tps(t_unc, args.uncached_new):.2f}x | greedy tokens equal: {same}")

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


if __name__ == "__main__":
    main()
