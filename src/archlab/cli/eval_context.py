"""`archlab eval RUN --stride / --by-position / --lengths / --passkey`: the long-context evaluations
(archlab.eval.long_context, archlab.eval.passkey)."""
from __future__ import annotations

import json
from pathlib import Path

from archlab.errors import UserError

PLOT_SUFFIXES = {".png", ".pdf", ".svg"}   # what the plot is saved as (matplotlib picks the format by suffix)

CONTEXT_EXAMPLE = """
  archlab eval runs/exp1 --seq-len 256 --stride 128     # overlapping windows: each scores its last 128 tokens
  archlab eval runs/exp1 --by-position                  # loss by position in the window (table + PNG)
  archlab eval runs/exp1 --lengths 64,128,256,512       # perplexity by evaluation length (table + PNG)
  archlab eval runs/exp1 --passkey --lengths 256,1024 --depths 0,0.5,1 --trials 5   # passkey retrieval
  archlab eval runs/exp1 --lengths 256,1024 --set position.rope_scaling.kind=yarn \\
      --set position.rope_scaling.factor=4      # zero-shot context extension: the same weights, YaRN x4"""


def add_arguments(e) -> None:
    """The long-context options of `archlab eval`."""
    e.add_argument("--stride", type=int, default=None, metavar="S",
                   help="overlapping windows of --seq-len tokens starting every S tokens, each scoring only the "
                   "tokens the previous one did not (transformers' perplexity guide); 0 < S < --seq-len")
    e.add_argument("--by-position", action="store_true",
                   help="mean loss at each position of the window: a table by position range, and a PNG")
    e.add_argument("--lengths", default=None, metavar="N[,N...]",
                   help="evaluation lengths: perplexity at each (with --by-position: a curve each; with "
                   "--passkey: the prompt lengths)")
    e.add_argument("--passkey", action="store_true",
                   help="passkey retrieval (Mohtashami & Jaggi 2023): accuracy by prompt length (--lengths) and "
                   "depth (--depths); needs the run's tokenizer")
    e.add_argument("--depths", default="0,0.25,0.5,0.75,1", metavar="D[,D...]",
                   help="with --passkey: where the key sits, 0 (start) to 1 (end) (default 0,0.25,0.5,0.75,1)")
    e.add_argument("--trials", type=int, default=5, metavar="N", help="with --passkey: keys per cell (default 5)")
    e.add_argument("--plot", default=None, metavar="FILE.png",
                   help="with --by-position or --lengths: where the PNG goes (default: in the run folder)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing PNG")
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="evaluate under a changed model config that keeps every weight's shape (e.g. "
                   "position.rope_scaling.kind=yarn for zero-shot context extension, the run's length taken as "
                   "the original one, as train --init-from does)")


def with_overrides(model, pairs: list[str], device: str):
    """The run's weights in a model built from its config with `--set` model overrides (a new rope_scaling: the
    run's max_seq_len becomes original_max_seq_len, as training.init_from.extended_config). UserError for a
    train key or an override that changes a weight's shape."""
    import sys

    from archlab.cli.sets import parse_sets
    from archlab.models import build_model
    from archlab.training.init_from import extended_config

    model_over, train_over = parse_sets(pairs)
    if train_over:
        raise UserError(f"eval --set takes model keys only, not train.{next(iter(train_over))}")
    cfg, note = extended_config(model.config, model.config.with_overrides(model_over), model_over)
    new = build_model(cfg)
    try:
        new.load_state_dict(model.state_dict())
    except RuntimeError as exc:
        raise UserError(f"eval --set {' '.join(pairs)} changes the model's weights: {str(exc).splitlines()[-1].strip()}"
                        ) from None
    if note:
        print(f"note: {note}", file=sys.stderr)
    return new.to(device).eval()


def wanted(args) -> bool:
    """Whether any long-context option is given (--plot / --overwrite alone: `check` names what they need)."""
    return bool(args.stride is not None or args.by_position or args.lengths or args.passkey or args.plot
                or args.overwrite)


def _numbers(flag: str, text: str, kind, low, high=None) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r} must be a comma-separated list of numbers") from None
    bad = [v for v in values if v < low or (high is not None and v > high)]
    if not values or bad:
        bound = f"in [{low}, {high}]" if high is not None else f"at least {low}"
        raise UserError(f"{flag} {text!r}: every value must be {bound}")
    return values


def check(args, seq_len: int, max_seq_len: int, learned: bool, run_dir: Path) -> tuple[list[int], Path | None]:
    """Validate the options before anything runs or is written: (lengths, PNG path or None)."""
    if args.stride is not None:
        if not 0 < args.stride < seq_len:
            raise UserError(f"--stride {args.stride} must be between 1 and --seq-len - 1 = {seq_len - 1}")
        if args.by_position or args.lengths or args.passkey:
            raise UserError("--stride scores one stream of overlapping windows: drop --by-position / --lengths / "
                            "--passkey")
    if args.passkey and args.by_position:
        raise UserError("--passkey and --by-position are separate evaluations: run them one at a time")
    lengths = _numbers("--lengths", args.lengths, int, 2) if args.lengths else [seq_len]
    if learned and max(lengths) > max_seq_len:
        raise UserError(f"--lengths {max(lengths)} is past the model's max_seq_len={max_seq_len} (learned positions)")
    if args.passkey:
        _numbers("--depths", args.depths, float, 0.0, 1.0)
        if args.trials < 1:
            raise UserError(f"--trials {args.trials} must be at least 1")
    plotting = args.by_position or (args.lengths and not args.passkey)
    if (args.plot or args.overwrite) and not plotting:
        raise UserError(f"{'--plot' if args.plot else '--overwrite'} needs --by-position or --lengths")
    if not plotting:
        return lengths, None
    name = "loss_by_position.png" if args.by_position else "ppl_by_length.png"
    path = Path(args.plot) if args.plot else run_dir / name
    if path.suffix.lower() not in PLOT_SUFFIXES:     # a run's config.yaml or a data file is never written over
        raise UserError(f"--plot {path} must name an image file ending in {', '.join(sorted(PLOT_SUFFIXES))}")
    if path.exists() and not args.overwrite:
        raise UserError(f"{path} exists: pass --overwrite to replace it, or --plot another file")
    if not path.parent.is_dir():
        raise UserError(f"--plot {path}: no folder {path.parent}")
    return lengths, path


def run(args, model, dataset, *, seq_len: int, batch_size: int, device: str, dtype: str) -> int:
    """The evaluation the options ask for, printed (or as JSON), after `check`."""
    run_dir = Path(args.run_dir)
    lengths, plot = check(args, seq_len, model.config.max_seq_len, model.config.position.kind == "learned", run_dir)
    if args.stride is not None:
        return _strided(args, model, dataset, seq_len, batch_size, device)
    if args.passkey:
        return _passkey(args, model, lengths, device)
    if args.by_position:
        return _by_position(args, model, dataset, lengths, batch_size, device, plot)
    return _by_length(args, model, dataset, lengths, batch_size, device, dtype, plot)


def _strided(args, model, dataset, seq_len, batch_size, device) -> int:
    import numpy as np
    import torch

    from archlab.eval.long_context import strided_perplexity

    ids = torch.from_numpy(np.asarray(dataset.tokens, dtype=np.int64))
    result = strided_perplexity(model, ids, seq_len=seq_len, stride=args.stride, batch_size=batch_size,
                                max_windows=args.batches * batch_size if args.batches else None, device=device,
                                progress=True)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(f"{args.split}: loss {result.loss:.4f} nats, perplexity {result.ppl:.2f} over {result.tokens:,} tokens "
              f"in {result.windows:,} windows of {seq_len} moving by {args.stride}")
    return 0


def _by_position(args, model, dataset, lengths, batch_size, device, plot) -> int:
    from archlab.eval.long_context import loss_by_position, plot_curve, position_buckets

    curves = {n: loss_by_position(model, dataset, seq_len=n, batch_size=batch_size, max_batches=args.batches,
                                  device=device, progress=True).tolist() for n in lengths}
    plot_curve({f"windows of {n}": (range(1, n + 1), curve) for n, curve in curves.items()}, plot,
               xlabel="position in the window (tokens of context)", ylabel="loss (nats)",
               title=f"{args.run_dir}: loss by position ({args.split})")
    if args.json:
        print(json.dumps({"loss_by_position": {str(n): c for n, c in curves.items()}, "plot": str(plot)}))
        return 0
    for n, curve in curves.items():
        print(f"windows of {n}: position  mean loss (nats)")
        for first, last, loss in position_buckets(curve):
            print(f"  {first:>6}-{last:<6} {loss:.4f}")
    print(f"plot: {plot}")
    return 0


def _by_length(args, model, dataset, lengths, batch_size, device, dtype, plot) -> int:
    from archlab.eval.evaluate import evaluate
    from archlab.eval.long_context import plot_curve

    results = {n: evaluate(model, dataset, batch_size=batch_size, seq_len=n, max_batches=args.batches,
                           device=device, dtype=dtype, progress=True) for n in lengths}
    plot_curve({"perplexity": (lengths, [r.ppl for r in results.values()])}, plot, xlabel="evaluation length (tokens)",
               ylabel="perplexity", title=f"{args.run_dir}: perplexity by length ({args.split})")
    if args.json:
        print(json.dumps({"by_length": {str(n): r.to_dict() for n, r in results.items()}, "plot": str(plot)}))
        return 0
    print("length  loss (nats)  perplexity  tokens")
    for n, r in results.items():
        print(f"{n:>6}  {r.loss:>11.4f}  {r.ppl:>10.2f}  {r.tokens:,}")
    print(f"plot: {plot}")
    return 0


def _passkey(args, model, lengths, device) -> int:
    from archlab.eval.passkey import passkey_accuracy
    from archlab.runs.model_folder import load_run_tokenizer

    tokenizer = load_run_tokenizer(args.run_dir)
    if tokenizer is None:
        raise UserError(f"{args.run_dir} holds no tokenizer: --passkey writes its prompts as text")
    depths = _numbers("--depths", args.depths, float, 0.0, 1.0)
    try:
        table = passkey_accuracy(model, tokenizer, lengths=lengths, depths=depths, trials=args.trials,
                                 device=device, progress=True)
    except ValueError as exc:                  # a length too short for the prompt
        raise UserError(f"--passkey: {exc}") from exc
    if args.json:
        print(json.dumps({"passkey": {str(n): {str(d): a for d, a in row.items()} for n, row in table.items()}}))
        return 0
    print(f"passkey accuracy ({args.trials} keys per cell)\nlength  " + "  ".join(f"d={d:<5g}" for d in depths)
          + "  mean")
    for n, row in table.items():
        print(f"{n:>6}  " + "  ".join(f"{a:>7.0%}" for a in row.values()) + f"  {sum(row.values()) / len(row):>4.0%}")
    return 0
