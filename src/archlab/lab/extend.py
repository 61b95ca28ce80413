"""An `extend` run of the lab (a suite with `runs: extend`): a RoPE model trained at length L, its context extended
to factor x L, scored by length. One row each:

    1. the base      trained once at L per distinct BaseSpec (archlab.lab.bases: shared by every method and step
                     count, one per seed unless `extend.bases: shared`)
    2. extension     the base's weights under the variant's RoPE scaling (linear / dynamic NTK / YaRN / none), with
                     original_max_seq_len = L (training.init_from.extended_config): `extend.steps` 0 scores them as
                     they are; more fine-tunes them that many steps at factor x L (`archlab train --init-from`)
    3. scoring       validation perplexity at each of `extend.lengths` x L (the same windows for every run, as
                     `archlab eval --lengths` scores them): `ppl_by_length`, `ppl_original` (at L), `ppl_extended`
                     (at factor x L, whose loss is also the row's final_val_loss); passkey retrieval at factor x L
                     (archlab.eval.passkey, `extend.passkey_trials` keys at depths 0, 0.5, 1): `passkey_extended`
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from archlab.lab.bases import run_base
from archlab.lab.plan import RunJob
from archlab.lab.store import RunRecord

__all__ = ["extend_job", "context_scores", "PASSKEY_DEPTHS", "DEFAULT_LENGTHS"]

PASSKEY_DEPTHS = (0.0, 0.5, 1.0)
DEFAULT_LENGTHS = (0.5, 1, 2, 4)        # multiples of L scored when the suite names none (capped at factor x L)


def extend_job(job: RunJob, train_and_measure: Callable[..., RunRecord],
               failed: Callable[[RunRecord, BaseException, float], RunRecord]) -> RunRecord:
    """One extend row: the base (built or reused), the extension (trained from the base's weights, continuing from its
    last checkpoint; none for 0 steps), the scores. The worker hands in its train_and_measure and failed
    (archlab.lab.worker). Example: worker.RUN_KINDS["extend"](job) -> extend_job(job, train_and_measure, failed)"""
    from archlab.training.init_from import read_init_source
    from archlab.training.trainer import train

    run, record = job.run, job.record
    t0 = time.perf_counter()
    got = run_base(job, failed, t0)
    if isinstance(got, RunRecord):
        return got
    base_dir, _ = got
    record.extra["steps"] = int(job.run.variant.extend.get("steps", 0))
    if record.extra["steps"] > 0:
        def extend(model, train_cfg, data, run_dir, *, resume, progress):
            return train(model, train_cfg, data, run_dir, resume=resume, progress=progress,
                         init_from=read_init_source(base_dir))

        record = train_and_measure(job.suite, run, job.data, record, extend, measure=False)
        weights = run.run_dir
    else:                                   # the base's weights as they are, under the new scaling
        record.status, record.steps, record.tokens_seen = "done", 0, 0
        weights = base_dir
    if record.status == "done":
        try:
            record.extra.update(context_scores(job, weights))
        except Exception as exc:  # noqa: BLE001 - a failed measurement must not lose the run
            record.extra["measure_error"] = f"{type(exc).__name__}: {exc}"
        else:
            record.final_val_loss = math.log(record.extra["ppl_extended"])
    record.wall_s = time.perf_counter() - t0
    record.finished_at = time.time()
    return record


def context_scores(job: RunJob, weights: Path) -> dict[str, Any]:
    """Perplexity at each evaluation length and passkey accuracy at the extended length, of the weights in the run
    folder `weights` loaded into the run's (extended) model config."""
    import torch

    from archlab.data.tokenizer_adapter import load_tokenizer
    from archlab.data.tokens import TokenDataset
    from archlab.eval.evaluate import evaluate
    from archlab.eval.passkey import passkey_accuracy
    from archlab.models import build_model
    from archlab.runs.model_folder import load_run

    run, settings = job.run, job.suite.extend or {}
    assert run.base is not None
    short, long = run.base.model.max_seq_len, run.train.seq_len
    loaded, _ = load_run(weights)
    model = build_model(run.model)
    model.load_state_dict(loaded.state_dict())       # same weights, the run's RoPE scaling and length
    model.eval()
    val = TokenDataset(job.data, "val")
    lengths = sorted({max(2, min(long, round(m * short))) for m in settings.get("lengths", DEFAULT_LENGTHS)}
                     | {short, long})
    tokens_per_batch = run.train.batch_size * long    # every length reads about as many tokens per batch
    ppl: dict[str, float] = {}
    with torch.no_grad():
        for n in lengths:
            loss = evaluate(model, val, batch_size=max(1, tokens_per_batch // n), seq_len=n,
                            max_batches=run.train.eval.batches).loss
            ppl[str(n)] = math.exp(min(loss, 700.0))
    out: dict[str, Any] = {"ppl_by_length": ppl, "ppl_original": ppl[str(short)], "ppl_extended": ppl[str(long)],
                           "original_len": short, "extended_len": long}
    trials = int(settings.get("passkey_trials", 0))
    if trials:
        tokenizer = load_tokenizer(Path(job.data) / "tokenizer")
        try:
            table = passkey_accuracy(model, tokenizer, lengths=[long], depths=PASSKEY_DEPTHS, trials=trials,
                                     seed=0)
        except ValueError as exc:           # the prompt does not fit the extended length
            out["passkey_extended_note"] = f"n/a: {exc}"
        else:
            out["passkey_extended"] = sum(table[long].values()) / len(PASSKEY_DEPTHS)
            out["passkey_by_depth"] = {f"{d:g}": v for d, v in table[long].items()}
    return out
