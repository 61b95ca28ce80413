"""A `finetune` run of the lab (a suite with `runs: finetune`): the post-training demo's stages 1-2 as one row.

    1. the base     pretrained once per distinct BaseSpec (model + pretraining settings, archlab.lab.plan) into
                    SWEEP/bases/<hash>/run, under a lock on SWEEP/bases/<hash>/: a worker that finds another
                    building it waits, and every run (and seed, unless `finetune.bases: per_seed`) reuses it
    2. fine-tuning  archlab.training.finetune on the data folder's SFT examples (archlab.data.reverse_words
                    SFT_FILE) with the run's TrainConfig: full fine-tuning, or LoRA with train.lora
    3. scoring      greedy answers to held-out words (archlab.eval.reverse_words.score_reversal): `exact_match`
                    (case ignored) and `preferred_case` in the row's extra; final_val_loss is the SFT validation loss

The data folder is what data.reverse_words.prepare_task_folder writes (a sweep prepares it as corpus "reverse-words").
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from archlab.errors import UserError
from archlab.lab.plan import BaseSpec, RunJob
from archlab.lab.store import RunRecord
from archlab.runs.lock import LockedError, RunLock

__all__ = ["finetune_job", "ensure_base", "BASE_RECORD"]

BASE_RECORD = "base.json"    # in the base's folder, written last: the base is complete
WAIT_S = 2.0                 # how often a worker waiting for another's base looks again


def ensure_base(spec: BaseSpec, data: Path) -> tuple[Path, dict]:
    """The base's run folder and its record ({seconds, exact_plain, ...}), pretraining it first unless a finished
    one is there. Two workers that need the same base at once: one builds it, the other waits for its record."""
    from archlab.data.reverse_words import reverse_problems
    from archlab.eval.reverse_words import score_plain
    from archlab.training.trainer import train

    run_dir, record_path = spec.folder / "run", spec.folder / BASE_RECORD
    while True:
        if record_path.is_file():
            return run_dir, json.loads(record_path.read_text())
        try:
            with RunLock(spec.folder, what="base folder"):
                if record_path.is_file():          # built while we waited for the lock
                    continue
                if run_dir.exists():               # a builder that died: start it over
                    shutil.rmtree(run_dir)
                t0 = time.perf_counter()
                result = train(spec.model, spec.train, data, run_dir, progress=False)
                if result.diverged:
                    raise RuntimeError(f"the base in {spec.folder} diverged while pretraining")
                record = {"seconds": time.perf_counter() - t0, "final_val_loss": result.final_val_loss,
                          "exact_plain": score_plain(run_dir, reverse_problems(spec.test_words)),
                          **spec.to_dict()}
                tmp = record_path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
                tmp.replace(record_path)
                return run_dir, {**record, "built_here": True}
        except LockedError:
            time.sleep(WAIT_S)


def finetune_job(job: RunJob, train_and_measure: Callable[..., RunRecord],
                 failed: Callable[[RunRecord, BaseException, float], RunRecord]) -> RunRecord:
    """One finetune row: the base (built or reused), fine-tuning (continued from its last checkpoint), scores.
    The worker hands in its own train_and_measure and failed (archlab.lab.worker), so this module does not import it.
    Example: worker.RUN_KINDS["finetune"](job) -> finetune_job(job, train_and_measure, failed)"""
    from archlab.data.reverse_words import SFT_FILE, reverse_problems
    from archlab.eval.reverse_words import score_reversal
    from archlab.training.finetune import finetune

    run, record, spec = job.run, job.record, job.run.base
    assert spec is not None, "a finetune run is planned with its base"
    t0 = time.perf_counter()
    sft = Path(job.data) / SFT_FILE
    try:
        if not sft.is_file():
            raise UserError(f"{job.data} holds no {SFT_FILE}: a finetune suite reads the data of "
                            "archlab.data.reverse_words.prepare_task_folder (corpus reverse-words)")
        base_dir, base = ensure_base(spec, Path(job.data))
    except LockedError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed run is recorded, the sweep goes on
        return failed(record, exc, t0)
    record.extra.update({"base": spec.folder.name, "base_exact_plain": base.get("exact_plain"),
                         "base_val_loss": base.get("final_val_loss")})
    if base.get("built_here"):
        record.extra["base_s"] = base["seconds"]

    def fine_tune(model, train_cfg, data, run_dir, *, resume, progress):
        return finetune(base_dir, sft, run_dir, train_cfg=train_cfg, resume=resume, progress=progress)

    record = train_and_measure(job.suite, run, job.data, record, fine_tune, measure=False)
    if record.status == "done":
        try:
            scores = score_reversal(run.run_dir, reverse_problems(spec.test_words))
        except Exception as exc:  # noqa: BLE001 - a failed measurement must not lose the run
            record.extra["measure_error"] = f"{type(exc).__name__}: {exc}"
        else:
            record.extra.update({"exact_match": scores["exact"], "preferred_case": scores["preferred"],
                                 "test_words": spec.test_words})
    record.wall_s = time.perf_counter() - t0
    return record
