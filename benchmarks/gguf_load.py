"""How long loading a GGUF model takes: archlab's `archlab convert --from-gguf` (header, dequantization, the
tokenizer rebuilt, the run folder written) and `archlab.interop.load_gguf` (the model alone) against transformers'
GGUF loader (`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` and its tokenizer), interleaved in one
process on a packaged real model (the `models` extra). Target: archlab's convert in at most half transformers' time.

    .venv/bin/python benchmarks/gguf_load.py [--model smollm2-135m-instruct] [--rounds 3] [--threads 2]

Reports the median and best seconds of each and the median of per-round ratios; wall time (process time with
--cpu-time, which drops the other tenants of a shared machine).
"""
from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench import interleaved, parser, start  # benchmarks/bench.py: one call of each per round, the order rotating


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a packaged model (archlab.interop.gguf)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true", help="time this process's CPU time, not wall time")
    args = ap.parse_args()
    start(args)

    import transformers

    from archlab.interop.convert import convert_from_gguf
    from archlab.interop.gguf import load_gguf, packaged_model

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = packaged_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        def ours_convert():
            convert_from_gguf(path, Path(tmp) / "run", overwrite=True)

        def theirs():
            transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

        times = interleaved({"archlab convert --from-gguf": ours_convert,
                             "archlab load_gguf (model only)": lambda: load_gguf(path),
                             "transformers (model + tokenizer)": theirs},
                            args.rounds, warmup=0, clock=time.process_time if args.cpu_time else time.perf_counter)
    print(f"{path.name} ({path.stat().st_size / 1e6:.0f} MB), {args.rounds} interleaved rounds, "
          f"{'CPU' if args.cpu_time else 'wall'} time")
    for name, seconds in times.items():
        print(f"{name:34s} median {statistics.median(seconds):6.1f} s  best {min(seconds):6.1f} s")
    ratio = statistics.median(a / b for a, b in zip(times["archlab convert --from-gguf"],
                                                     times["transformers (model + tokenizer)"]))
    print(f"archlab convert / transformers: {ratio:.2f}x (target <= 0.5)")


if __name__ == "__main__":
    main()
