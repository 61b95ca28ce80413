"""A `finetune` run of the lab (a suite with `runs: finetune`): the post-training demo's stages 1-2 as one row.

    1. the base     pretrained once per distinct BaseSpec (model + pretraining settings, archlab.lab.plan) into
                    SWEEP/bases/<hash>/run by archlab.lab.bases: every run (and seed, unless `finetune.bases:
                    per_seed`) reuses it
    2. fine-tuning  archlab.training.finetune on the data folder's SFT examples (archlab.data.reverse_words
                    SFT_FILE) with the run's TrainConfig: full fine-tuning, or LoRA with train.lora
    3. scoring      greedy answers to held-out words (archlab.eval.reverse_words.score_reversal): `exact_match`
                    (case ignored) and `preferred_case` in the row's extra; final_val_loss is the SFT validation loss

The data folder is what data.reverse_words.prepare_task_folder writes (a sweep prepares it as corpus "reverse-words").
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from archlab.errors import UserError
from archlab.lab import bases
from archlab.lab.bases import BASE_RECORD
from archlab.lab.plan import BaseSpec, RunJob
from archlab.lab.store import RunRecord
from archlab.runs.lock import LockedError

__all__ = ["finetune_job", "ensure_base", "BASE_RECORD"]


def ensure_base(spec: BaseSpec, data: Path) -> tuple[Path, dict]:
    """The base's run folder and its record (archlab.lab.bases.ensure_base) with `exact_plain`: the base's held-out
    exact match in the pretraining text's own format, scored once when it is built."""
    from archlab.data.reverse_words import reverse_problems
    from archlab.eval.reverse_words import score_plain

    return bases.ensure_base(spec, data, lambda run_dir: {
        "exact_plain": score_plain(run_dir, reverse_problems(spec.test_words or 1))})


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
