"""`archlab score`: the rewards a reward run (archlab finetune --method reward) gives the completions of a file."""
from __future__ import annotations

import argparse
import json
import sys

EXAMPLE = """example:
  archlab score runs/rm --data prefs.jsonl                 # preference lines: each side's reward, and the accuracy
  archlab score runs/rm --data prefs.jsonl --out scores.jsonl
  (one JSON line per pair to stdout (or --out): {"line", "chosen", "rejected"}; the share of pairs whose chosen
  reward is the larger, and the mean margin, on stderr)"""


def register(subparsers) -> None:
    p = subparsers.add_parser("score", help="score completions with a reward run",
                              description="Read prompt / chosen / rejected lines, encode them with the reward run's "
                              "tokenizer (its chat template for message lines) and print each side's reward: the "
                              "run's score head at the last token.",
                              epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", metavar="RUN", help="a reward run folder (archlab finetune --method reward)")
    p.add_argument("--data", required=True, help="a .jsonl of prompt / chosen / rejected lines")
    p.add_argument("--out", help="write the JSON lines here instead of stdout (a new file)")
    p.add_argument("--batch-size", type=int, default=8, help="pairs per forward (default 8)")
    p.set_defaults(func=run_score)


def run_score(args) -> int:
    from pathlib import Path

    import torch

    from archlab.data.preference import load_preference_data, pad_pairs
    from archlab.errors import UserError
    from archlab.nn.heads import SCORE_HEAD
    from archlab.runs.model_folder import load_run
    from archlab.training.methods.reward import sequence_rewards

    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size} must be at least 1")
    if args.out and Path(args.out).exists():
        raise UserError(f"--out {args.out} exists: choose a new file")
    model, _ = load_run(args.run)
    if not hasattr(model, SCORE_HEAD):
        raise UserError(f"{args.run} is not a reward run (its checkpoint has no score head): train one with "
                        "archlab finetune BASE --method reward")
    limit = model.config.max_seq_len if model.config.position.kind == "learned" else None
    data = load_preference_data(args.data, Path(args.run) / "tokenizer", max_tokens=limit, progress=False)
    if data.unpaired:
        raise UserError(f"--data {args.data} holds unpaired preferences (prompt, completion, label): archlab score "
                        "compares a pair's chosen and rejected rewards, so it reads prompt / chosen / rejected lines")
    rows = []
    with torch.no_grad():
        for start in range(0, len(data.pairs), args.batch_size):
            pairs = data.pairs[start:start + args.batch_size]
            ids, _ = pad_pairs(pairs, data.eot_id or 0)                                         # (2b, t)
            lengths = torch.tensor([len(p.chosen[0]) for p in pairs] + [len(p.rejected[0]) for p in pairs])
            chosen, rejected = sequence_rewards(model, ids, lengths).chunk(2)                    # (b,) each
            rows += [{"line": p.line, "chosen": float(c), "rejected": float(r)}
                     for p, c, r in zip(pairs, chosen, rejected)]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    accuracy = sum(row["chosen"] > row["rejected"] for row in rows) / len(rows)
    margin = sum(row["chosen"] - row["rejected"] for row in rows) / len(rows)
    print(f"{len(rows)} pairs: accuracy {accuracy:.4f} (chosen reward the larger), mean margin {margin:.4f}",
          file=sys.stderr)
    return 0
