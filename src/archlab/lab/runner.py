"""Run a suite: every variant x seed through the trainer, one row each in the sweep's results table.

    SWEEP_DIR/
      results.sqlite        the table (archlab.lab.store)
      data/                 the prepared corpus, made once per sweep folder (unless --data is given)
      runs/<variant>/seed<k>/   one run folder each (config.yaml, metrics.jsonl, checkpoints/, ...)

Resumable: a run whose row says done or diverged (with the same config) is skipped; a row left
`running` by a crash, or `failed`, is run again (continuing from its last checkpoint when there is one).
A run that raises is recorded as failed with its error and the sweep goes on; a NaN loss is recorded
as diverged. After training, a suite's extra measurements (loss at 2x the training length, max
attention logit, attention-sink diagnostics, KV-cache bytes) are taken on the saved model.

Here: the driver (which runs are due, their rows, the executor). What will run is planned in plan.py;
one run is trained and measured by worker.py, wherever the executor (executors.py) puts it.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from archlab.errors import UserError
from archlab.lab import matching
from archlab.lab.executors import Executor, make_executor
from archlab.lab.plan import INTERRUPTED, PlannedRun, RunJob, crashed, plan
from archlab.lab.store import FINISHED, ResultStore, RunRecord
from archlab.lab.suites import Suite
from archlab.runs.lock import RunLock

DATA_SUBDIR = "data"


class LabError(UserError, RuntimeError):
    """A sweep that cannot proceed (e.g. its folder holds results for a different config)."""


def ensure_data(sweep_dir: Path, data_dir: str | Path | None = None, corpus: str = "shakespeare",
                tokenizer: str = "bytes", progress: bool = True) -> Path:
    """The prepared data folder: `data_dir` as given, else SWEEP_DIR/data (prepared on first use; a
    generated corpus such as "addition-3" is written by archlab.data.arithmetic, "addition-3+icl" with
    archlab.data.incontext's mapping episodes among its lines)."""
    from archlab.data.prepare import prepare
    from archlab.data.tokens import load_meta

    if data_dir is not None:
        load_meta(data_dir)  # raises a clear DataError when it is not prepared
        return Path(data_dir)
    from archlab.data import arithmetic, incontext, reverse_words

    target = Path(sweep_dir) / DATA_SUBDIR
    if not (target / "meta.json").is_file():
        base, episodes = incontext.split_corpus(corpus)
        digits = arithmetic.digits_of(base)
        if corpus == reverse_words.CORPUS:      # the post-training demo's base corpus and SFT examples
            if target.exists():
                shutil.rmtree(target)           # a preparation that stopped half way
            reverse_words.prepare_task_folder(target, progress=progress)
        elif digits is not None:                # generated here (the emergence suite's addition problems, and
            documents = arithmetic.documents(digits)        # with `+icl` k-shot mapping episodes among them)
            prepare(incontext.interleave(documents) if episodes else documents, tokenizer, target,
                    progress=progress, overwrite=True, corpus_name=corpus)
        else:
            prepare(corpus, tokenizer, target, progress=progress, overwrite=True)
    return target


def run_suite(
    suite: Suite,
    sweep_dir: str | Path,
    *,
    scale: str = "small",
    seeds: int | None = None,
    budget: float | None = None,
    budget_unit: str | None = None,
    data_dir: str | Path | None = None,
    corpus: str | None = None,
    tokenizer: str = "bytes",
    train_overrides: dict | None = None,
    device: str | None = None,
    train_fn: Callable | None = None,
    progress: bool = True,
    measure: bool = True,
    threads: int | None = 1,
    executor: str | Executor = "serial",
    workers: int | None = None,
    address: str | None = None,
    model: str | None = None,
) -> list[RunRecord]:
    """Run (or resume) `suite` into `sweep_dir`; returns the rows of this suite.

    threads: torch CPU threads per run (None: leave torch's default). One thread is the default because
    these models are tiny: on a shared 2-core machine two threads ran a step 10x slower than one (thread
    contention); parallelism comes from running several runs at once (`executor`, `workers`).
    corpus: the corpus prepared when `data_dir` is not given (default: the scale's, else the suite's own,
    else Shakespeare).
    executor: "serial" (here, one after another), "local" (`workers` processes on this machine) or "ray"
    (Ray tasks; `address` of a cluster, else a local Ray instance), see archlab.lab.executors.
    model: a real-model suite's model (a packaged model's name, a .gguf file or a run folder) instead of its own;
    such a suite prepares no data: its runs read their text in the model's tokenizer (archlab.lab.real_model_run).
    """
    if threads:
        import torch
        torch.set_num_threads(int(threads))
    sweep_dir = Path(sweep_dir)
    corpus = corpus or suite.scale(scale)["corpus"] or suite.corpus or "shakespeare"
    # every variant's config is checked (with a stand-in vocabulary) before any folder or data work
    checked = plan(suite, sweep_dir, scale=scale, seeds=seeds, budget=budget, budget_unit=budget_unit,
                   vocab_size=257, train_overrides=train_overrides, device=device, model=model)
    real = checked[0].real if checked else None
    from archlab.training.placement import device_kind

    gpu = any(device_kind(run.train.device) == "cuda" for run in checked)   # one GPU per run where it trains on one
    from archlab.data.prepare import input_paths
    from archlab.runs.outputs import check_output

    # the sweep's own data (SWEEP/data, what ensure_data prepares) is no input; any other --data is, the sweep
    # folder itself included: a sweep written into its data folder would go with the next `data prepare --overwrite`
    own = data_dir is not None and os.path.realpath(data_dir) == os.path.realpath(sweep_dir / DATA_SUBDIR)
    inputs = [real.source] if real else [None if own else data_dir, *input_paths(corpus, tokenizer)]
    check_output(sweep_dir, inputs=inputs, in_place=True)
    with RunLock(sweep_dir, what="sweep folder"):    # one driver per sweep: a second writes no row, no data
        pool = executor if isinstance(executor, Executor) else make_executor(executor, workers, address, threads,
                                                                             gpu=gpu)
        try:
            if real:                  # a pretrained model, converted once, reads its own text: no data
                from archlab.lab.real_model_run import ensure_model

                ensure_model(real)
                data, runs = sweep_dir, checked
            else:
                data = ensure_data(sweep_dir, data_dir, corpus, tokenizer, progress)
                from archlab.data.tokens import load_meta

                vocab = int(load_meta(data)["vocab_size"])
                runs = plan(suite, sweep_dir, scale=scale, seeds=seeds, budget=budget, budget_unit=budget_unit,
                            vocab_size=vocab, train_overrides=train_overrides, device=device)
            with ResultStore(sweep_dir) as store:
                store.set_meta(f"suite:{suite.name}", suite.to_dict())
                store.set_meta(f"sweep:{suite.name}", {"scale": scale, "data": None if real else str(data),
                                                       "seeds": seeds or suite.seeds, "budget": budget,
                                                       "budget_unit": budget_unit})
                _drive(store, suite, runs, pool, lambda run, record: RunJob(suite, run, data, record, train_fn,
                                                                             measure, threads), progress)
                if measure and "paired_step_time" in suite.measure:
                    _record_paired_step_times(store, suite, runs, progress)
                return store.runs(suite.name)
        finally:
            pool.close()


def _drive(store: ResultStore, suite: Suite, runs: list[PlannedRun], pool: Executor,
           make_job: Callable[[PlannedRun, RunRecord], RunJob], progress: bool) -> None:
    """Submit every due run to `pool`, at most `pool.workers` at once, and write each finished row.
    The driver is the table's only writer; an interrupted run's row says so and the sweep stops."""
    due = [run for run in runs if _due(store, suite, run)]
    bar = None
    if progress:
        from archlab.progress import progress_bar
        bar = progress_bar(total=len(runs), initial=len(runs) - len(due), desc=f"ablate {suite.name}", unit="run")
        if pool.workers > 1:
            bar.write(f"ablate {suite.name}: {len(due)} runs on {pool.describe()}")
    in_flight: dict[Any, RunJob] = {}
    queue = list(due)
    try:
        while queue or in_flight:
            while queue and len(in_flight) < pool.workers:
                run = queue.pop(0)
                job = make_job(run, _start(store, suite, run))
                store.put(job.record)
                in_flight[pool.submit(job)] = job
            if bar is not None:
                names = sorted(f"{j.run.variant.name} seed{j.run.seed}" for j in in_flight.values())
                bar.set_postfix_str(", ".join(names)[:80], refresh=True)
            for handle, record in pool.wait(list(in_flight)):
                in_flight.pop(handle)
                store.put(record)
                if bar is not None:
                    bar.update(1)
                if (record.error or "").startswith(INTERRUPTED):
                    raise KeyboardInterrupt(record.error)
    except BaseException:
        pool.cancel(list(in_flight))
        for job in in_flight.values():             # rows in flight: recorded as interrupted, re-run next time
            store.put(crashed(job, f"{INTERRUPTED}: the sweep stopped while it ran"))
        raise
    finally:
        if bar is not None:
            bar.close()


def _record_paired_step_times(store: ResultStore, suite: Suite, runs: list[PlannedRun], progress: bool) -> None:
    """Time the variants' steps side by side (lab/timing.py) once every run has a row, unless every
    finished run already has its time (a resumed sweep keeps the times it measured). Always on the
    driver: the pairs interleave in one process, whatever executor trained them."""
    from archlab.lab import timing

    records = {(run.variant.name, run.seed): store.get(suite.name, run.variant.name, run.seed) for run in runs}
    done = {key: rec for key, rec in records.items() if rec is not None and rec.status == "done"}
    if not done or all(timing.METRIC in rec.extra for rec in done.values()):
        return
    times = timing.paired_step_times(runs, progress=progress, seq_len=suite.timing_seq_len)
    for key, rec in done.items():
        rec.extra[timing.METRIC] = times[key]
        store.put(rec)


def _same_config(a: dict, b: dict) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _config(run: PlannedRun) -> dict:
    return json.loads(json.dumps(run.config, default=str))


def _due(store: ResultStore, suite: Suite, run: PlannedRun) -> bool:
    """False for a run whose finished row has this config; a finished row of another config is refused."""
    old = store.get(suite.name, run.variant.name, run.seed)
    if old is None or old.status not in FINISHED:
        return True
    if _same_config(old.config, _config(run)):
        return False
    raise LabError(
        f"{store.path} already holds a finished run {suite.name}/{run.variant.name}/seed{run.seed} with a "
        "different config (budget, scale or suite changed): use another --out folder")


def _start(store: ResultStore, suite: Suite, run: PlannedRun) -> RunRecord:
    """The `running` row of a run about to start."""
    trains = suite.runs not in ("ngram", "real_model")   # no model to count, or one the run counts itself
    record = RunRecord(suite=suite.name, variant=run.variant.name, seed=run.seed, status="running",
                       config=_config(run), params=matching.param_count(run.model) if trains else None,
                       flops_per_token=matching.flops_per_token(run.model, run.train.seq_len) if trains else None,
                       run_dir=str(run.run_dir), started_at=time.time(), extra={"labels": run.variant.labels})
    if run.match_note:
        record.extra["match"] = run.match_note
    return record
