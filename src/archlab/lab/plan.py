"""What a sweep will run, as data: every (variant, seed) resolved to a PlannedRun, and the RunJob a
worker receives for one of them.

The runner (runner.py) plans and drives, the executors (executors.py) carry RunJobs to workers, and a
worker (worker.py) trains one; all three read these types from here, so none imports another to
learn them.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from archlab.config import ConfigError, ModelConfig
from archlab.lab import matching
from archlab.lab.store import RunRecord
from archlab.lab.suites import Suite, Variant, build_model_config
from archlab.training.config import TrainConfig

__all__ = ["INTERRUPTED", "LAB_TRAIN_DEFAULTS", "BaseSpec", "PlannedRun", "RunJob", "crashed", "plan", "slug"]

INTERRUPTED = "interrupted"   # error prefix of a row whose run a Ctrl-C / SIGTERM stopped
LAB_TRAIN_DEFAULTS = {"sample_every": -1, "checkpoint_every": 0, "keep_last": 1, "log_every": 10}


@dataclass(frozen=True)
class BaseSpec:
    """The pretrained base of a `finetune` run: its model and pretraining settings, and the folder it is built in
    (SWEEP/bases/<hash of both>/, shared by every run whose base is the same)."""

    model: ModelConfig
    train: TrainConfig
    folder: Path
    test_words: int               # held-out words the fine-tuned model is scored on

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "train": self.train.to_dict(), "folder": str(self.folder),
                "test_words": self.test_words}


@dataclass
class PlannedRun:
    variant: Variant
    seed: int
    model: ModelConfig
    train: TrainConfig
    run_dir: Path
    match_note: str | None = None
    base: BaseSpec | None = None  # a finetune run's base (`train` is then the fine-tuning)

    @property
    def config(self) -> dict:
        return {"model": self.model.to_dict(), "train": self.train.to_dict(),
                "overrides": {"model": self.variant.model, "train": self.variant.train,
                              **({"ngram": self.variant.ngram} if self.variant.ngram else {})},
                "labels": self.variant.labels, **({"base": self.base.to_dict()} if self.base else {})}


@dataclass(eq=False)      # hashed by identity: the serial executor's job is its own handle
class RunJob:
    """Everything a worker needs for one run; pickled to local processes and Ray tasks."""

    suite: Suite
    run: PlannedRun
    data: Path              # the prepared data folder
    record: RunRecord       # the `running` row the driver wrote
    train_fn: Callable | None = None   # None: archlab.training.trainer.train (anything else must pickle)
    measure: bool = True
    threads: int | None = 1


def crashed(job: RunJob, why: str) -> RunRecord:
    """The row of a job whose worker died (or was stopped) before returning one."""
    return replace(job.record, status="failed", error=why, finished_at=time.time())


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", name).strip("_") or "variant"


NGRAM_SETTINGS = {"order": int, "add_k": float}   # an n-gram run's `ngram.` keys and their types


def _check_ngram(suite: Suite, variant: Variant) -> None:
    """An n-gram suite's variant names an order >= 1 (and optionally add_k > 0); other suites have no ngram keys."""
    where = f"suite {suite.name}, variant {variant.name}"
    if suite.runs != "ngram":
        if variant.ngram:
            raise ConfigError(f"{where}: ngram.* keys need `runs: ngram`")
        return
    unknown = set(variant.ngram) - set(NGRAM_SETTINGS)
    if unknown:
        raise ConfigError(f"{where}: unknown ngram key(s) {sorted(unknown)}; known: {', '.join(NGRAM_SETTINGS)}")
    order, add_k = variant.ngram.get("order"), variant.ngram.get("add_k", 1.0)
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise ConfigError(f"{where}: ngram.order={order!r} must be a whole number >= 1")
    if isinstance(add_k, bool) or not isinstance(add_k, (int, float)) or not add_k > 0:
        raise ConfigError(f"{where}: ngram.add_k={add_k!r} must be a number > 0")


# a finetune suite's `finetune:` keys: bases shared by the seeds or one per seed, the base's pretraining settings
# over the post-training demo's (TrainConfig keys), the number of held-out words scored
FINETUNE_SETTINGS = {"bases": ("shared", "per_seed"), "pretrain": dict, "test_words": int}


def _check_finetune(suite: Suite) -> None:
    where = f"suite {suite.name}"
    if suite.runs != "finetune":
        if suite.finetune is not None:
            raise ConfigError(f"{where}: `finetune` settings need `runs: finetune`")
        return
    settings = suite.finetune or {}
    unknown = set(settings) - set(FINETUNE_SETTINGS)
    if unknown:
        raise ConfigError(f"{where}: unknown finetune key(s) {sorted(unknown)}; known: {', '.join(FINETUNE_SETTINGS)}")
    if settings.get("bases", "shared") not in FINETUNE_SETTINGS["bases"]:
        raise ConfigError(f"{where}: finetune.bases={settings['bases']!r}; known: shared, per_seed")
    if not isinstance(settings.get("pretrain", {}), dict):
        raise ConfigError(f"{where}: finetune.pretrain must be a mapping of train keys")
    words = settings.get("test_words", 1)
    if isinstance(words, bool) or not isinstance(words, int) or words < 1:
        raise ConfigError(f"{where}: finetune.test_words={words!r} must be a whole number >= 1")


def _base_spec(suite: Suite, model: ModelConfig, sft: TrainConfig, seed: int, sweep_dir: Path) -> BaseSpec:
    """A finetune run's base: the variant's model, pretrained with the demo's base settings (finetune.pretrain
    over them), seed 0 for every run (`bases: shared`) or the run's seed (`per_seed`)."""
    from archlab.training.recipes import reverse_words

    demo = reverse_words(quick=False)
    settings = suite.finetune or {}
    base_seed = seed if settings.get("bases") == "per_seed" else 0
    try:
        train = TrainConfig.from_dict({**demo["base"].to_dict(), "device": sft.device,
                                       **settings.get("pretrain", {}), "seed": base_seed})
    except ConfigError as exc:
        raise ConfigError(f"suite {suite.name}, finetune.pretrain: {exc}") from exc
    model = model.with_overrides({"seed": base_seed})
    key = json.dumps([model.to_dict(), train.to_dict()], sort_keys=True, default=str)
    folder = Path(sweep_dir) / "bases" / hashlib.sha256(key.encode()).hexdigest()[:12]
    return BaseSpec(model, train, folder, int(settings.get("test_words", demo["test_words"])))


def plan(suite: Suite, sweep_dir: Path, *, scale: str = "small", seeds: int | None = None,
         budget: float | None = None, budget_unit: str | None = None, vocab_size: int | None = None,
         train_overrides: dict | None = None, device: str | None = None) -> list[PlannedRun]:
    """Every (variant, seed) with its resolved ModelConfig and TrainConfig, matching applied."""
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
        target = matching.MATCH_BY[by](base_cfg, seq_len)
    n_seeds = seeds or suite.seeds
    _check_finetune(suite)
    out: list[PlannedRun] = []
    for variant in suite.expand(scale):
        _check_ngram(suite, variant)
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
            base = _base_spec(suite, cfg, train_cfg, seed, Path(sweep_dir)) if suite.runs == "finetune" else None
            out.append(PlannedRun(variant, seed, model_cfg, train_cfg,
                                  Path(sweep_dir) / "runs" / slug(variant.name) / f"seed{seed}", note, base))
    return out
