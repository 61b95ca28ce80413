"""`archlab ablate SUITE_OR_YAML` (run a suite of training runs) and `archlab report DIR`."""
from __future__ import annotations

import argparse

ABLATE_EXAMPLE = """\
examples:
  archlab ablate --list
  archlab ablate activation --out sweeps/activation                 # small scale: 2 CPU cores, <= 15 min
  archlab ablate norm_position --scale large --out sweeps/norms     # GPU budget
  archlab ablate my_suite.yaml --budget 2e6 --budget-unit tokens --seeds 3 --data data/shakespeare-bytes
  archlab ablate activation --executor local --workers 2           # 2 runs at a time on this machine
  archlab ablate activation --executor ray --workers 8             # Ray tasks on a local Ray instance
  archlab ablate activation --executor ray --address HEAD:6379     # an existing Ray cluster (shared folder)
  archlab report sweeps/activation
  archlab ablate quantization --report                             # a real model (SmolLM2), none trained
  archlab ablate streaming --model ~/models/qwen2.5-0.5b-q8_0.gguf --out sweeps/streaming-qwen

Each variant x seed is one training run under OUT/runs/; rows go to OUT/results.sqlite. Re-running the
same command resumes: finished (done / diverged) runs are skipped, crashed ones are run again.
Whatever the executor, every run trains with --threads torch threads (so its losses equal the serial
run's bit for bit) and the driver alone writes the table; paired timings run on the driver.
Without --data the suite's corpus (Shakespeare, or the generated addition problems of `emergence`) is
prepared once with the byte tokenizer into OUT/data. The real-model suites (massive_activations, quantization,
streaming) train nothing: they convert the --model GGUF once into OUT/models/ and measure it on Hamlet in its
own tokenizer (default: SmolLM2-135M-Instruct from the `models` extra).
"""

REPORT_EXAMPLE = """\
examples:
  archlab report sweeps/activation          # one sweep folder (holds results.sqlite)
  archlab report sweeps                     # every sweep folder below sweeps/
writes DIR/report/report.md, report.html (open from disk), verdicts.json and img/*.png.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    ablate = subparsers.add_parser(
        "ablate", help="run an ablation suite (variants x seeds) into a results table",
        description="Run a built-in suite (one per claim of the architecture lecture) or a YAML suite: "
        "a base config times axes of dotted overrides, optionally matched in parameters or FLOPs. "
        "Example: archlab ablate activation --out sweeps/activation",
        epilog=ABLATE_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ablate.add_argument("suite", nargs="?", metavar="SUITE_OR_YAML", help="built-in suite name or a YAML file")
    ablate.add_argument("--list", action="store_true", help="list the built-in suites and exit")
    ablate.add_argument("--out", metavar="DIR", help="sweep folder (default sweeps/<suite>)")
    ablate.add_argument("--scale", default="small", help="budget preset: small (CPU) or large (GPU)")
    ablate.add_argument("--budget", type=float, help="override the scale's budget per run")
    ablate.add_argument("--budget-unit", choices=["steps", "tokens", "minutes"], help="unit of --budget")
    ablate.add_argument("--seeds", type=int, help="seeds per variant (default: the suite's)")
    ablate.add_argument("--data", metavar="DIR", help="a prepared data folder (archlab data prepare)")
    ablate.add_argument("--corpus", default=None,
                        help="corpus when --data is not given (default: the suite's own, else shakespeare)")
    ablate.add_argument("--tokenizer", default="bytes", help="tokenizer when --data is not given")
    ablate.add_argument("--set", action="append", default=[], metavar="train.KEY=VALUE",
                        help="extra TrainConfig override for every run (repeatable)")
    ablate.add_argument("--device", choices=["auto", "cpu", "cuda"], help="training device")
    ablate.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; 0 = torch default)")
    ablate.add_argument("--executor", choices=["serial", "local", "ray"], default="serial",
                        help="where runs execute: here one by one (default), N local processes, or Ray tasks")
    ablate.add_argument("--workers", type=int, metavar="N",
                        help="runs at once (local: default cores // threads; ray: what the cluster holds)")
    ablate.add_argument("--address", metavar="ADDR", help="Ray cluster address (default: start a local Ray)")
    ablate.add_argument("--model", metavar="NAME|FILE.gguf|RUN",
                        help="real-model suites: a packaged model (smollm2-135m-instruct, gemma-3-270m), a .gguf "
                             "file or a converted run folder (default: the suite's, SmolLM2)")
    ablate.add_argument("--report", action="store_true", help="write the report when the sweep ends")
    ablate.add_argument("--quiet", action="store_true", help="no progress bar")
    ablate.set_defaults(func=run_ablate)

    report = subparsers.add_parser(
        "report", help="Markdown/HTML report with plots and computed verdicts of sweeps",
        description="Build the report of one or more sweep folders. Example: archlab report sweeps/activation",
        epilog=REPORT_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("dir", metavar="DIR", help="a sweep folder, or a folder of sweep folders")
    report.add_argument("--out", metavar="DIR", help="report folder (default DIR/report, rewritten each time; a "
                        "given folder that exists and is not empty needs --overwrite)")
    report.add_argument("--overwrite", action="store_true", help="write into an existing non-empty --out folder")
    report.set_defaults(func=run_report)


def run_ablate(args: argparse.Namespace) -> int:
    from archlab.config import ConfigError
    from archlab.errors import UserError
    from archlab.lab import runner, suites
    from archlab.lab.report import build_report

    if args.list:
        for s in suites.BUILTIN.values():
            n = len(s.expand())
            sc = s.scale("small")
            what = "a real model, none trained" if s.runs == "real_model" else f"small: {sc['budget']:g} {sc['unit']}"
            print(f"{s.name:15s} {n:2d} variants x {s.seeds} seeds, {what}  {s.claim}")
        return 0
    if not args.suite:
        raise UserError("give a SUITE_OR_YAML (see --list)")
    try:
        suite = suites.load(args.suite)
        suite.scale(args.scale)                  # an unknown scale fails now, before any data work
        overrides = {}
        for item in args.set:
            if "=" not in item:
                raise ConfigError(f"--set {item!r} must be KEY=VALUE")
            key, value = item.split("=", 1)
            overrides[key[len("train."):] if key.startswith("train.") else key] = value
        if overrides:
            from archlab.runs.train_section import current_key
            from archlab.training.trainer import TrainConfig
            TrainConfig().with_overrides(overrides)  # validate names and values early
            typed = TrainConfig().with_overrides(overrides).to_dict()        # nested: sections as mappings
            overrides = {k: _dotted(typed, current_key(k, v)[0]) for k, v in overrides.items()}
        out = args.out or f"sweeps/{suite.name}"
        rows = runner.run_suite(
            suite, out, scale=args.scale, seeds=args.seeds, budget=args.budget, budget_unit=args.budget_unit,
            data_dir=args.data, corpus=args.corpus, tokenizer=args.tokenizer, train_overrides=overrides,
            device=args.device, progress=not args.quiet, threads=args.threads or None,
            executor=args.executor, workers=args.workers, address=args.address, model=args.model,
        )
    except ValueError as exc:                    # ConfigError / LabError are UserErrors already
        raise exc if isinstance(exc, UserError) else UserError(str(exc)) from exc
    counts = {s: sum(r.status == s for r in rows) for s in ("done", "diverged", "failed")}
    tally = ", ".join(f"{v} {k}" for k, v in counts.items())
    print(f"{suite.name}: {len(rows)} runs ({tally}) -> {out}/results.sqlite")
    if args.report:
        paths = build_report(out)
        print(f"report: {paths['md']} and {paths['html']}")
    return 1 if counts["failed"] else 0


def run_report(args: argparse.Namespace) -> int:
    from archlab.lab.report import build_report
    from archlab.runs.outputs import check_output

    if args.out:                            # the default, DIR/report, is the sweep's own and is rewritten
        check_output(args.out, inputs=(), overwrite=args.overwrite)
    paths = build_report(args.dir, args.out)
    print(f"wrote {paths['md']}, {paths['html']}, {paths['json']}")
    return 0


def _dotted(tree: dict, key: str):
    """The value at a dotted key of a nested mapping. Example: _dotted({"eval": {"every": 0}}, "eval.every") -> 0"""
    for part in key.split("."):
        tree = tree[part]
    return tree
