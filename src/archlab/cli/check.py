"""`archlab check RUN`: verify a run folder without training (`archlab verify` is the HF-logits check)."""
from __future__ import annotations

import argparse
from pathlib import Path

CHECK_EXAMPLE = """example:
  archlab check runs/demo            # sha256 of every checkpoint file, config.yaml, tokenizer, lock
  archlab check runs/demo --quick    # sizes only (fast on large checkpoints)
exit status: 0 all good, 1 something damaged, 2 not a run folder"""


def register(subparsers) -> None:
    c = subparsers.add_parser("check", help="verify a run folder's checkpoints (sha256), config and tokenizer",
                              description="Verify a run folder without training: every checkpoint file "
                              "against the sizes and sha256 in its meta.json, config.yaml, the tokenizer, "
                              "and who holds its lock.",
                              epilog=CHECK_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("run_dir", help="a run folder (archlab train --out)")
    c.add_argument("--quick", action="store_true", help="check file sizes only, not sha256")
    c.set_defaults(func=run_check)


def run_check(args) -> int:
    from archlab.config import ModelConfig
    from archlab.runs.checkpoint import CheckpointError, list_checkpoints, load_trainer_state, verify_checkpoint
    from archlab.runs.lock import LOCK_FILE
    from archlab.runs.model_folder import load_run_tokenizer, read_run_config

    run_dir = Path(args.run_dir)
    ModelConfig.from_dict(read_run_config(run_dir)["model"])     # not a run folder / bad config: exit 2
    print("config.yaml   ok")
    damaged = 0
    try:
        tok = load_run_tokenizer(run_dir)
        print(f"tokenizer     {'ok' if tok is not None else 'none (the run has no tokenizer/ folder)'}")
    except Exception as exc:  # any tokenizer failure is damage to report, not a crash
        damaged += 1
        print(f"tokenizer     DAMAGED: {exc}")
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        print("checkpoints   none")
    for ckpt in checkpoints:
        try:
            meta = verify_checkpoint(ckpt, full=not args.quick)
            load_trainer_state(ckpt)
        except CheckpointError as exc:
            damaged += 1
            print(f"{ckpt.name}  DAMAGED: {exc}")
            continue
        how = "sizes" if args.quick else ("sha256" if "sha256" in meta else "sizes (format 1: no sha256)")
        print(f"{ckpt.name}  ok ({len(meta.get('files', {}))} files, {how} verified)")
    if (run_dir / LOCK_FILE).is_file():
        print(f"lock          held: {(run_dir / LOCK_FILE).read_text().strip()}")
    print("OK" if not damaged else f"DAMAGED: {damaged} item(s)")
    return 0 if not damaged else 1
