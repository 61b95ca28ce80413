"""StreamingLLM mode's prefill of a prompt longer than the cache (`archlab generate --sink-window N`): the cache's
capacity in one forward, then chunks of generation.stepper.STRETCH tokens each scored in one forward as decoding
would (SinkKVCache.stretch: what generate does where every layer allows it), against the capacity in one forward
then one forward per token (what it did before, and still does for models with a position bias or windows of their
own); beside them, the full cache's prefill of the same prompt (one causal forward, no eviction) for scale.

    .venv/bin/python benchmarks/sink_prefill.py [--threads 1] [--prompt 2048] [--sinks 4] [--window 252]
                                                [--rounds 5] [--clock cpu] [--model FOLDER] [--chunks 64,128,256]

The model: the decode benchmark's LLaMA shape (8 layers, d_model 256, GQA 8:2, vocabulary 4,096, random weights;
only shapes matter for time), or --model FOLDER (a run or HF folder, e.g. SmolLM2-135M-Instruct). The prompt is
--prompt random ids, batch 1. Each side is generation.stepper.Stepper's own prefill (the token-by-token side with
`stretches` answering False, the path a refused model takes); the time runs from the Stepper's construction to the
first token's logits. The two run in interleaved rounds (the order alternating); the ratio is the median of the
per-round ratios. Checked once: the last logits within 1e-3 and the greedy tokens of `archlab.generate` (8 new) equal.
--chunks: the chunked prefill's time at other STRETCH sizes too (how the default was chosen).
"""
from __future__ import annotations

import statistics
import time
from unittest import mock

import torch
from bench import _timed, interleaved, parser, start  # benchmarks/bench.py

import archlab
from archlab.generation import stepper as stepper_module


def prefill(model, ids: torch.Tensor, sinks: int, window: int, one_forward: bool) -> torch.Tensor:   # -> (1, v)
    """The Stepper's prefill; one_forward=False: the path a model SinkKVCache.stretch refuses takes."""
    with torch.no_grad(), mock.patch.object(stepper_module, "stretches",
                                            stepper_module.stretches if one_forward else (lambda model: False)):
        step = stepper_module.Stepper(model, ids, torch.ones_like(ids, dtype=torch.bool), 1, sink_tokens=sinks,
                                      sink_window=window)
        return step.prefill()


def load(args):
    if args.model:
        from archlab.runs.model_folder import load_model_and_tokenizer
        model, _ = load_model_and_tokenizer(args.model, "cpu", purpose="generate")
        return model.eval()
    cfg = archlab.presets.tiny("llama3-8b", vocab_size=4096, d_model=256, max_seq_len=2048).with_overrides(
        {"n_layers": 8, "attention.n_heads": 8, "attention.n_kv_heads": 2, "mlp.d_ff": 688})
    return archlab.TransformerLM(cfg).eval()


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=252)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", default="", help="comma-separated STRETCH sizes to time as well, e.g. 64,128,256")
    ap.add_argument("--model", help="a run or HF folder (default: random weights of the decode benchmark's shape)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this process's CPU time (a shared machine's other tenants drop out)")
    args = ap.parse_args()
    start(args)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model = load(args)
    if not stepper_module.stretches(model):
        raise SystemExit("this model's layers refuse the one forward (a position bias or windows of their own)")
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    once, stepwise = (prefill(model, ids, args.sinks, args.window, flag) for flag in (True, False))
    err = float((once - stepwise).abs().max() / stepwise.abs().max())
    assert err < 1e-3, f"the one forward's logits differ from token by token's by {err:.2e} (relative)"
    new = {flag: None for flag in (True, False)}
    for flag in new:
        with mock.patch.object(stepper_module, "stretches",
                               stepper_module.stretches if flag else (lambda model: False)):
            new[flag] = archlab.generate(model, ids, 8, sink_tokens=args.sinks, sink_window=args.window)
    assert torch.equal(new[True], new[False]), "greedy tokens differ"
    with torch.no_grad():
        times = interleaved({"chunks": lambda: prefill(model, ids, args.sinks, args.window, True),
                             "stepwise": lambda: prefill(model, ids, args.sinks, args.window, False),
                             "full": lambda: model(ids, return_hidden=True)},
                            args.rounds, warmup=0, clock=clock)
    ratios = [s / o for o, s in zip(times["chunks"], times["stepwise"])]
    cap, med = args.sinks + args.window, {name: statistics.median(t) for name, t in times.items()}
    print(f"prompt {args.prompt} tokens, cache {args.sinks} sinks + {args.window} recent ({cap} slots), batch 1, "
          f"{args.clock} clock, median of {args.rounds} interleaved rounds; last logits differ by {err:.1e} "
          "(relative), greedy tokens equal")
    print(f"  {cap} in one forward + chunks of {stepper_module.STRETCH} (SinkKVCache.stretch): {med['chunks']:8.3f} s")
    print(f"  {cap} in one forward + {args.prompt - cap} one at a time:{' ' * 18}{med['stepwise']:8.3f} s")
    print(f"  the full cache's prefill (one causal forward, for scale):   {med['full']:8.3f} s")
    print(f"  speed-up {statistics.median(ratios):.1f}x (per-round {min(ratios):.1f}-{max(ratios):.1f}x)")
    for chunk in (int(c) for c in args.chunks.split(",") if c):
        with mock.patch.object(stepper_module, "STRETCH", chunk):
            spent = [_timed(lambda: prefill(model, ids, args.sinks, args.window, True), clock) for _ in range(3)]
        print(f"  chunks of {chunk}: {min(spent):.3f} s (least of 3)")


if __name__ == "__main__":
    main()
