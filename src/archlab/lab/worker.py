"""One run in a worker: train it (continuing from its last checkpoint), take the suite's measurements
on the saved model, and return the finished row. Runs wherever the executor put it (this process, a
spawned process, a Ray task) and writes nothing to the results table: the driver does.
"""
from __future__ import annotations

import math
import shutil
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from archlab.config import ModelConfig
from archlab.errors import one_line_warnings
from archlab.lab.extend import extend_job
from archlab.lab.finetune import finetune_job
from archlab.lab.plan import INTERRUPTED, PlannedRun, RunJob
from archlab.lab.real_model_run import real_model_job
from archlab.lab.store import RunRecord
from archlab.lab.suites import Suite
from archlab.runs.lock import LockedError

__all__ = ["RUN_KINDS", "run_job", "train_and_measure", "evaluate_ngram_run", "measurements", "kv_bytes", "failed"]


def run_job(job: RunJob) -> RunRecord:
    """Do one run in this process (what the suite's `runs` kind names); the finished row (never raises for the
    run's own failure)."""
    if job.threads:
        import torch
        torch.set_num_threads(int(job.threads))
    with one_line_warnings(f"archlab ablate: {job.run.variant.name}/seed{job.run.seed}"):
        return RUN_KINDS[job.suite.runs](job)


def evaluate_ngram_run(job: RunJob) -> RunRecord:
    """An n-gram run: Kneser-Ney and add-k of `ngram.order`, counted on the train split, scored on every validation
    token. The row's val losses are Kneser-Ney's nats per token; both estimates' bits/byte go to `extra`."""
    from archlab.data.tokens import load_meta
    from archlab.eval.ngram import evaluate_ngram
    from archlab.runs.provenance import device_name

    record, settings = job.record, job.run.variant.ngram
    t0 = time.perf_counter()
    try:
        kn, add_k = evaluate_ngram(job.data, [int(settings["order"])], estimators=("kneser_ney", "add_k"),
                                   k=float(settings.get("add_k", 1.0)))
    except Exception as exc:  # noqa: BLE001 - a failed run is recorded, the sweep goes on
        record.status = "failed"
        record.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    else:
        record.status = "done"
        record.final_val_loss = record.best_val_loss = kn.bits_per_token * math.log(2)
        record.peak_memory_bytes = kn.peak_rss_bytes
        record.extra.update({"kn_bpb": kn.bpb, "add_k_bpb": add_k.bpb, "add_k": float(settings.get("add_k", 1.0)),
                             "seen": kn.seen, "ngrams": kn.ngrams, "table_bytes": kn.table_bytes,
                             "val_tokens": kn.tokens, "val_bytes": kn.n_bytes, "seconds": kn.seconds,
                             "device": device_name("cpu"), "corpus": str(load_meta(job.data).get("corpus", "?")),
                             "vocab_size": int(load_meta(job.data)["vocab_size"])})
    record.wall_s = time.perf_counter() - t0
    record.finished_at = time.time()
    return record


def _train_job(job: RunJob) -> RunRecord:
    return train_and_measure(job.suite, job.run, job.data, job.record, job.train_fn, job.measure)


def failed(record: RunRecord, exc: BaseException, t0: float) -> RunRecord:
    """The row of a run that raised `exc` before it trained (its wall time counted from `t0`)."""
    record.status = "failed"
    record.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    record.wall_s = time.perf_counter() - t0
    record.finished_at = time.time()
    return record


# a suite's `runs` -> the function that does one of its runs (archlab.lab.suites.RUN_KINDS names them)
RUN_KINDS: dict[str, Callable[[RunJob], RunRecord]] = {"train": _train_job, "ngram": evaluate_ngram_run,
                                                       "finetune": lambda job: finetune_job(job, train_and_measure,
                                                                                            failed),
                                                       "extend": lambda job: extend_job(job, train_and_measure, failed),
                                                       "real_model": lambda job: real_model_job(job, failed)}


def train_and_measure(suite: Suite, run: PlannedRun, data: Path, record: RunRecord, train_fn: Callable | None,
                      measure: bool) -> RunRecord:
    """Train one run (continuing from its last checkpoint if it has one) and take the suite's
    measurements; the finished row. Runs wherever the executor put it; writes nothing to the table."""
    from archlab.training.trainer import Diverged, Stopped

    if train_fn is None:
        from archlab.training.trainer import train as train_fn
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
    """KV-cache bytes at `seq_len` (bf16, batch 1), as archlab.models.accounting counts them."""
    from archlab.models.accounting import kv_cache_bytes
    return int(kv_cache_bytes(cfg, seq_len, batch=1, dtype="bfloat16"))


def measurements(suite: Suite, run: PlannedRun, data: Path) -> dict:
    """Post-training measurements the suite asks for, on the run's final checkpoint."""
    wanted = [m for m in suite.measure if m not in ("kv_cache_bytes", "paired_step_time")]  # not per run
    if not wanted:
        return {}
    import torch

    from archlab.data.tokens import TokenDataset, eval_batches
    from archlab.eval.evaluate import evaluate
    from archlab.runs.model_folder import load_run

    model, _ = load_run(run.run_dir)
    model.eval()
    val = TokenDataset(data, "val")
    seq, bs = run.train.seq_len, run.train.batch_size
    out: dict[str, Any] = {}
    if "val_loss_2x" in wanted:
        out["val_loss_1x"] = evaluate(model, val, batch_size=bs, seq_len=seq,
                                      max_batches=run.train.eval.batches).loss
        if run.model.position.kind == "learned" and 2 * seq > run.model.max_seq_len:
            out["val_loss_2x"] = None
            out["val_loss_2x_note"] = (f"n/a: learned positions have {run.model.max_seq_len} rows, "
                                       f"2x the training length is {2 * seq}")
        else:
            out["val_loss_2x"] = evaluate(model, val, batch_size=max(1, bs // 2), seq_len=2 * seq,
                                          max_batches=run.train.eval.batches).loss
    if "icl" in wanted:           # k-shot accuracy on fresh random mappings, and the strongest induction head
        out.update(_icl_scores(model, Path(data)))
    if "addition" in wanted:      # exact match, digit accuracy, answer NLL on held-out sums (eval.arithmetic)
        from archlab.data import arithmetic, incontext
        from archlab.data.tokenizer_adapter import load_tokenizer
        from archlab.data.tokens import load_meta
        from archlab.eval.arithmetic import score_addition

        digits = arithmetic.digits_of(incontext.split_corpus(str(load_meta(data).get("corpus", "")))[0])
        if digits is None:
            raise ValueError("the addition scores need data prepared from an addition-K corpus")
        out.update(score_addition(model, load_tokenizer(Path(data) / "tokenizer"), arithmetic.problems(digits)))
    if "expert_load" in wanted:   # how the trained router spreads held-out tokens (eval.expert_load); dense: none
        from archlab.eval.expert_load import busiest_share, expert_load

        load = expert_load(model, [xb for xb, _ in eval_batches(val, bs, seq, run.train.eval.batches)])
        if load:
            out["busiest_expert_share"] = busiest_share(load["first_choice"])
            out["busiest_routed_share"] = busiest_share(load["routed"])
            out["expert_load_first_choice"], out["expert_load_routed"] = load["first_choice"], load["routed"]
    if "max_attn_logit" in wanted or "sinks" in wanted or "effective_rank" in wanted:
        from archlab.eval import diagnostics

        x = torch.cat([xb for xb, _ in eval_batches(val, 4, seq, 1)], 0)  # (4, t): 4 windows
        if "max_attn_logit" in wanted:
            logits = diagnostics.max_attention_logits(model, x)
            out["max_attn_logit"] = max(logits)
            out["max_attn_logit_per_layer"] = logits
        result = diagnostics.diagnose(model, x) if "sinks" in wanted or "effective_rank" in wanted else None
        if "sinks" in wanted:
            summary = result["summary"]
            out["first_token_mass"] = summary["first_token_mass"]
            out["massive_ratio"] = summary["max_ratio"]
            out["max_activation"] = summary["max_activation"]
            out["attention_entropy"] = summary["mean_entropy"]
        if "effective_rank" in wanted:
            out["final_effective_rank"] = result["summary"]["final_effective_rank"]
            out["effective_rank_per_layer"] = [layer["effective_rank"] for layer in result["layers"]]
    return out


def _icl_scores(model, data: Path) -> dict:
    """The mapping task's scores (archlab.eval.incontext) and the largest prefix-matching score of any head on
    repeated random letters, the mapping task's own tokens (archlab.eval.diagnostics, Olsson et al. 2022)."""
    from archlab.data import incontext
    from archlab.data.tokenizer_adapter import load_tokenizer
    from archlab.eval.diagnostics import prefix_matching_scores
    from archlab.eval.incontext import score_mapping

    tokenizer = load_tokenizer(data / "tokenizer")
    out = score_mapping(model, tokenizer, incontext.episodes())
    letters = sorted({i for ch in incontext.LETTERS for i in tokenizer.encode(ch)})
    scores = prefix_matching_scores(model, letters, min(32, model.config.max_seq_len // 2))
    out["prefix_matching_max"] = max(max(row) for row in scores)
    out["prefix_matching_per_layer"] = [max(row) for row in scores]
    return out
