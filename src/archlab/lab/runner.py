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
"""
from __future__ import annotations

import json
import math
import re
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from archlab.config import ConfigError, ModelConfig
from archlab.errors import UserError
from archlab.lab import matching
from archlab.lab.executors import Executor, RunJob, crashed, make_executor
from archlab.lab.store import FINISHED, ResultStore, RunRecord
from archlab.lab.suites import Suite, Variant, build_model_config
from archlab.runlock import LockedError

DATA_SUBDIR = "data"
INTERRUPTED = "interrupted"   # error prefix of a row whose run a Ctrl-C / SIGTERM stopped
LAB_TRAIN_DEFAULTS = {"sample_every": -1, "checkpoint_every": 0, "keep_last": 1, "log_every": 10}


class LabError(UserError, RuntimeError):
    """A sweep that cannot proceed (e.g. its folder holds results for a different config)."""


@dataclass
class PlannedRun:
    variant: Variant
    seed: int
    model: ModelConfig
    train: Any                 # archlab.train.TrainConfig
    run_dir: Path
    match_note: str | None = None

    @property
    def config(self) -> dict:
        return {"model": self.model.to_dict(), "train": self.train.to_dict(),
                "overrides": {"model": self.variant.model, "train": self.variant.train},
                "labels": self.variant.labels}


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", name).strip("_") or "variant"


def ensure_data(sweep_dir: Path, data_dir: str | Path | None = None, corpus: str = "shakespeare",
                tokenizer: str = "bytes", progress: bool = True) -> Path:
    """The prepared data folder: `data_dir` as given, else SWEEP_DIR/data (prepared on first use)."""
    from archlab.data import load_meta, prepare

    if data_dir is not None:
        load_meta(data_dir)  # raises a clear DataError when it is not prepared
        return Path(data_dir)
    target = Path(sweep_dir) / DATA_SUBDIR
    if not (target / "meta.json").is_file():
        prepare(corpus, tokenizer, target, progress=progress, overwrite=True)
    return target


def plan(suite: Suite, sweep_dir: Path, *, scale: str = "small", seeds: int | None = None,
         budget: float | None = None, budget_unit: str | None = None, vocab_size: int | None = None,
         train_overrides: dict | None = None, device: str | None = None) -> list[PlannedRun]:
    """Every (variant, seed) with its resolved ModelConfig and TrainConfig, matching applied."""
    from archlab.train import TrainConfig

    sc = suite.scale(scale)
    base_model, base_train = suite.base_overrides(scale)
    train_base = {**LAB_TRAIN_DEFAULTS, **base_train, "budget": float(budget or sc["budget"]),
                  "budget_unit": budget_unit or sc["unit"], **(train_overrides or {})}
    if device:
        train_base["device"] = device
    if vocab_size:
        base_model = {**base_model, "vocab_size": vocab_size}
    seq_len = int(train_base["seq_len"])
    base_model = {**base_model, "max_seq_len": seq_len}
    base_cfg = build_model_config(base_model)
    target = None
    if suite.match:
        by = suite.match.get("by", "params")
        target = (matching.param_count(base_cfg) if by == "params"
                  else matching.flops_per_token(base_cfg, seq_len))
    n_seeds = seeds or suite.seeds
    out: list[PlannedRun] = []
    for variant in suite.expand():
        try:
            cfg = build_model_config({**base_model, **variant.model})
        except ConfigError as exc:
            raise ConfigError(f"suite {suite.name}, variant {variant.name}: {exc}") from exc
        note = None
        if suite.match:
            m = suite.match
            knob = m.get("knob", "mlp.d_ff")
            result = matching.match(cfg, target, by=m.get("by", "params"), knob=knob,
                                    multiple=int(m.get("multiple", 1)), tolerance=float(m.get("tolerance", 0.02)),
                                    seq_len=seq_len)
            cfg = result.config
            note = f"{knob}={result.value} ({result.rel_error:+.2%} {m.get('by', 'params')} vs base)"
        for seed in range(n_seeds):
            model_cfg = cfg.with_overrides({"seed": seed})
            train_cfg = TrainConfig.from_dict({**train_base, **variant.train, "seed": seed})
            out.append(PlannedRun(variant, seed, model_cfg, train_cfg,
                                  Path(sweep_dir) / "runs" / slug(variant.name) / f"seed{seed}", note))
    return out


def run_suite(
    suite: Suite,
    sweep_dir: str | Path,
    *,
    scale: str = "small",
    seeds: int | None = None,
    budget: float | None = None,
    budget_unit: str | None = None,
    data_dir: str | Path | None = None,
    corpus: str = "shakespeare",
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
) -> list[RunRecord]:
    """Run (or resume) `suite` into `sweep_dir`; returns the rows of this suite.

    threads: torch CPU threads per run (None: leave torch's default). One thread is the default because
    these models are tiny: on a shared 2-core machine two threads ran a step 10x slower than one (thread
    contention); parallelism comes from running several runs at once (`executor`, `workers`).
    executor: "serial" (here, one after another), "local" (`workers` processes on this machine) or "ray"
    (Ray tasks; `address` of a cluster, else a local Ray instance), see archlab.lab.executors.
    """
    if threads:
        import torch
        torch.set_num_threads(int(threads))
    sweep_dir = Path(sweep_dir)
    # every variant's config is checked (with a stand-in vocabulary) before any folder or data work
    checked = plan(suite, sweep_dir, scale=scale, seeds=seeds, budget=budget, budget_unit=budget_unit,
                   vocab_size=257, train_overrides=train_overrides, device=device)
    from archlab.train import device_kind

    gpu = any(device_kind(run.train.device) == "cuda" for run in checked)   # one GPU per run where it trains on one
    pool = executor if isinstance(executor, Executor) else make_executor(executor, workers, address, threads, gpu=gpu)
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        data = ensure_data(sweep_dir, data_dir, corpus, tokenizer, progress)
        from archlab.data import load_meta

        vocab = int(load_meta(data)["vocab_size"])
        runs = plan(suite, sweep_dir, scale=scale, seeds=seeds, budget=budget, budget_unit=budget_unit,
                    vocab_size=vocab, train_overrides=train_overrides, device=device)
        with ResultStore(sweep_dir) as store:
            store.set_meta(f"suite:{suite.name}", suite.to_dict())
            store.set_meta(f"sweep:{suite.name}", {"scale": scale, "data": str(data),
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
    times = timing.paired_step_times(runs, progress=progress)
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
    record = RunRecord(suite=suite.name, variant=run.variant.name, seed=run.seed, status="running",
                       config=_config(run), params=matching.param_count(run.model),
                       flops_per_token=matching.flops_per_token(run.model, run.train.seq_len),
                       run_dir=str(run.run_dir), started_at=time.time(), extra={"labels": run.variant.labels})
    if run.match_note:
        record.extra["match"] = run.match_note
    return record


def train_and_measure(suite: Suite, run: PlannedRun, data: Path, record: RunRecord, train_fn: Callable | None,
                      measure: bool) -> RunRecord:
    """Train one run (continuing from its last checkpoint if it has one) and take the suite's
    measurements; the finished row. Runs wherever the executor put it; writes nothing to the table."""
    from archlab.train import Diverged, Stopped

    if train_fn is None:
        from archlab.train import train as train_fn
    t0 = time.perf_counter()
    resume = run.run_dir.exists() and any((run.run_dir / "checkpoints").glob("step_*"))
    if run.run_dir.exists() and not resume:
        shutil.rmtree(run.run_dir)  # a crash before the first checkpoint: start the run over
    result = None
    try:
        result = train_fn(run.model, run.train, data, run.run_dir, resume=resume, progress=False)
        record.status = "diverged" if result.diverged else "done"
    except Diverged as exc:
        result = exc.result
        record.status = "diverged"
        record.error = str(exc)
    except LockedError:  # another worker runs this row right now: its result will land, not ours
        raise
    except (KeyboardInterrupt, Stopped) as exc:   # Ctrl-C / SIGTERM: the run saved; the sweep stops
        record.status = "failed"
        record.error = f"{INTERRUPTED}: {exc}" if str(exc) else INTERRUPTED
        record.wall_s = time.perf_counter() - t0
        return record
    except Exception as exc:  # noqa: BLE001 - a crashed run is recorded, the sweep goes on
        record.status = "failed"
        record.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    if result is not None:
        _fill_result(record, run, result)
    if measure and record.status == "done":
        try:
            record.extra.update(measurements(suite, run, data))
        except Exception as exc:  # noqa: BLE001 - a failed measurement must not lose the run
            record.extra["measure_error"] = f"{type(exc).__name__}: {exc}"
    if measure and "kv_cache_bytes" in suite.measure and record.status != "failed":
        record.extra["kv_cache_bytes"] = kv_bytes(run.model, 4 * run.train.seq_len)
    record.wall_s = time.perf_counter() - t0
    record.finished_at = time.time()
    return record


def _fill_result(record: RunRecord, run: PlannedRun, result: Any) -> None:
    record.tokens_seen = int(result.tokens_seen)
    record.steps = int(result.steps)
    record.final_val_loss = _finite(result.final_val_loss)
    record.best_val_loss = _finite(result.best_val_loss)
    record.final_train_loss = _finite(result.final_train_loss)
    record.tokens_per_s = float(result.tokens_per_s) or None
    if record.tokens_per_s:
        record.step_time_s = run.train.tokens_per_step / record.tokens_per_s
    record.peak_memory_bytes = int(result.peak_memory_bytes)
    record.diverged = bool(result.diverged) or record.status == "diverged"


def _finite(x) -> float | None:
    return float(x) if x is not None and math.isfinite(float(x)) else None


def kv_bytes(cfg: ModelConfig, seq_len: int) -> int:
    """KV-cache bytes at `seq_len` (bf16, batch 1), as archlab.accounting counts them."""
    from archlab.accounting import kv_cache_bytes
    return int(kv_cache_bytes(cfg, seq_len, batch=1, dtype="bfloat16"))


def measurements(suite: Suite, run: PlannedRun, data: Path) -> dict:
    """Post-training measurements the suite asks for, on the run's final checkpoint."""
    wanted = [m for m in suite.measure if m not in ("kv_cache_bytes", "paired_step_time")]  # not per run
    if not wanted:
        return {}
    import torch

    from archlab.checkpoint import load_run
    from archlab.data import TokenDataset, eval_batches
    from archlab.evaluate import evaluate

    model, _ = load_run(run.run_dir)
    model.eval()
    val = TokenDataset(data, "val")
    seq, bs = run.train.seq_len, run.train.batch_size
    out: dict[str, Any] = {}
    if "val_loss_2x" in wanted:
        out["val_loss_1x"] = evaluate(model, val, batch_size=bs, seq_len=seq,
                                      max_batches=run.train.eval_batches).loss
        if run.model.position.kind == "learned" and 2 * seq > run.model.max_seq_len:
            out["val_loss_2x"] = None
            out["val_loss_2x_note"] = (f"n/a: learned positions have {run.model.max_seq_len} rows, "
                                       f"2x the training length is {2 * seq}")
        else:
            out["val_loss_2x"] = evaluate(model, val, batch_size=max(1, bs // 2), seq_len=2 * seq,
                                          max_batches=run.train.eval_batches).loss
    if "max_attn_logit" in wanted or "sinks" in wanted:
        from archlab import diagnostics

        x = torch.cat([xb for xb, _ in eval_batches(val, 4, seq, 1)], 0)  # (4, t): 4 windows
        if "max_attn_logit" in wanted:
            logits = diagnostics.max_attention_logits(model, x)
            out["max_attn_logit"] = max(logits)
            out["max_attn_logit_per_layer"] = logits
        if "sinks" in wanted:
            summary = diagnostics.diagnose(model, x)["summary"]
            out["first_token_mass"] = summary["first_token_mass"]
            out["massive_ratio"] = summary["max_ratio"]
            out["max_activation"] = summary["max_activation"]
            out["attention_entropy"] = summary["mean_entropy"]
    return out
