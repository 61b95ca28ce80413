"""Bases that a suite's runs start from: trained once, shared by every run that names the same one.

A `finetune` run (archlab.lab.finetune) fine-tunes a pretrained base; an `extend` run (archlab.lab.extend) extends
a base's context. Both plan a BaseSpec (archlab.lab.plan: the base's model and training, and its folder
SWEEP/bases/<hash of both>/), and `ensure_base` builds it there under a lock on that folder: the first worker that
needs it trains it, a worker that finds another building it waits, and every later run reads the record.

    run_dir, record = ensure_base(spec, data)        # SWEEP/bases/<hash>/run, {"seconds", "final_val_loss", ...}

`run_base` is the step both kinds of run begin with: the base built or reused and noted in the row, or the row
failed when the base could not be built.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from archlab.lab.plan import BaseSpec, RunJob
from archlab.lab.store import RunRecord
from archlab.runs.lock import LockedError, RunLock

__all__ = ["ensure_base", "run_base", "BASE_RECORD", "WAIT_S"]

BASE_RECORD = "base.json"    # in the base's folder, written last: the base is complete
WAIT_S = 2.0                 # how often a worker waiting for another's base looks again


def ensure_base(spec: BaseSpec, data: Path, score: Callable[[Path], dict] | None = None) -> tuple[Path, dict]:
    """The base's run folder and its record ({seconds, final_val_loss, **score(run folder), **spec}), training it
    first unless a finished one is there. `score` adds what a kind of run wants to know of its base once (the
    finetune runs: its exact match in the pretraining format). The record of a base built by this call has
    built_here=True. Example: ensure_base(job.run.base, job.data)[0] / "checkpoints" """
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
                          **(score(run_dir) if score else {}), **spec.to_dict()}
                tmp = record_path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
                tmp.replace(record_path)
                return run_dir, {**record, "built_here": True}
        except LockedError:
            time.sleep(WAIT_S)


def run_base(job: RunJob, failed: Callable[[RunRecord, BaseException, float], RunRecord], t0: float, *,
             build: Callable[[BaseSpec, Path], tuple[Path, dict]] = ensure_base,
             check: Callable[[], None] | None = None) -> tuple[Path, dict] | RunRecord:
    """The base a finetune or extend row starts from, built or reused by `build`, noted in the row's extra as `base`
    (its folder's name), `base_val_loss` and, when this call built it, `base_s`. When `check` (what the row needs
    besides the base) or the build raises, the row failed: `failed(job.record, exc, t0)` (the worker's) is returned.
    A LockedError is no failure: it goes up to the worker, which tries the run again.
    Example: got = run_base(job, failed, t0); if isinstance(got, RunRecord): return got; base_dir, base = got"""
    spec = job.run.base
    assert spec is not None, "a run that starts from a base is planned with it"
    try:
        if check is not None:
            check()
        base_dir, base = build(spec, Path(job.data))
    except LockedError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed run is recorded, the sweep goes on
        return failed(job.record, exc, t0)
    job.record.extra.update({"base": spec.folder.name, "base_val_loss": base.get("final_val_loss")})
    if base.get("built_here"):
        job.record.extra["base_s"] = base["seconds"]
    return base_dir, base
