"""What a sweep will run, as data: every (variant, seed) resolved to a PlannedRun, and the RunJob a
worker receives for one of them.

The runner (runner.py) plans and drives, the executors (executors.py) carry RunJobs to workers, and a
worker (worker.py) trains one; all three read these types from here, so none imports another to
learn them.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from archlab.config import ConfigError, ModelConfig
from archlab.lab import matching
from archlab.lab.real_model_run import RealSpec, real_spec, resolve_model
from archlab.lab.store import RunRecord
from archlab.lab.suites import Suite, Variant, build_model_config, slug
from archlab.runs.train_section import merge_train
from archlab.training.config import TrainConfig

__all__ = ["INTERRUPTED", "LAB_TRAIN_DEFAULTS", "BaseSpec", "RealSpec", "PlannedRun", "RunJob", "crashed", "plan",
           "slug"]

INTERRUPTED = "interrupted"   # error prefix of a row whose run a Ctrl-C / SIGTERM stopped
LAB_TRAIN_DEFAULTS = {"sample_every": -1, "checkpoint_every": 0, "keep_last": 1, "log_every": 10}


@dataclass(frozen=True)
class BaseSpec:
    """The pretrained base of a `finetune` or `extend` run: its model and pretraining settings, and the folder it is
    built in (SWEEP/bases/<hash of both>/, shared by every run whose base is the same; archlab.lab.bases)."""

    model: ModelConfig
    train: TrainConfig
    folder: Path
    test_words: int | None = None     # finetune: held-out words the fine-tuned model is scored on

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "train": self.train.to_dict(), "folder": str(self.folder),
                **({"test_words": self.test_words} if self.test_words is not None else {})}


def base_folder(sweep_dir: Path, model: ModelConfig, train: TrainConfig) -> Path:
    """SWEEP/bases/<12 hex digits of the model's and the pretraining's settings>: equal bases share a folder."""
    key = json.dumps([model.to_dict(), train.to_dict()], sort_keys=True, default=str)
    return Path(sweep_dir) / "bases" / hashlib.sha256(key.encode()).hexdigest()[:12]


@dataclass
class PlannedRun:
    variant: Variant
    seed: int
    model: ModelConfig
    train: TrainConfig
    run_dir: Path
    match_note: str | None = None
    base: BaseSpec | None = None  # a finetune or extend run's base (`train` is then the fine-tuning / extension)
    real: RealSpec | None = None  # a real_model run's model and measurement (`model` / `train` unused)

    @property
    def config(self) -> dict:
        return {"model": self.model.to_dict(), "train": self.train.to_dict(),
                "overrides": {"model": self.variant.model, "train": self.variant.train,
                              **({"ngram": self.variant.ngram} if self.variant.ngram else {}),
                              **({"extend": self.variant.extend} if self.variant.extend else {})},
                "labels": self.variant.labels, **({"base": self.base.to_dict()} if self.base else {}),
                **({"real": self.real.to_dict()} if self.real else {})}


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


NGRAM_SETTINGS = {"order": int, "add_k": float}   # an n-gram run's `ngram.` keys and their types


def _check_ngram(suite: Suite, variant: Variant) -> None:
    """An n-gram suite's variant names an order >= 1 (and optionally add_k > 0); other suites have no ngram keys."""
    where = f"suite {suite.name}, variant {variant.name}"
    if suite.runs != "ngram":
        if variant.ngram:
            raise ConfigError(f"{where}: ngram.* keys need `runs: ngram`")
        return
    _refuse_unknown(where, "ngram", variant.ngram, NGRAM_SETTINGS)
    order, add_k = variant.ngram.get("order"), variant.ngram.get("add_k", 1.0)
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise ConfigError(f"{where}: ngram.order={order!r} must be a whole number >= 1")
    if isinstance(add_k, bool) or not isinstance(add_k, (int, float)) or not add_k > 0:
        raise ConfigError(f"{where}: ngram.add_k={add_k!r} must be a number > 0")


def _refuse_unknown(where: str, kind: str, settings: dict, known: dict) -> None:
    """A KIND setting that `known` does not name is refused with the names it does know."""
    unknown = set(settings) - set(known)
    if unknown:
        raise ConfigError(f"{where}: unknown {kind} key(s) {sorted(unknown)}; known: {', '.join(known)}")


def _run_kind_settings(suite: Suite, kind: str, known: dict, variant_keys: dict | None = None) -> dict | None:
    """The suite's `KIND:` settings (suite.finetune, suite.extend) when it has `runs: KIND`, checked against `known`
    (key -> type, or the tuple of allowed values): an unknown key, a value outside its tuple or a mapping that is not
    one is refused by name. None when the suite runs another kind; it must then have no such settings, nor
    `variant_keys` (a variant's KIND.* keys).
    Example: _run_kind_settings(suite, "extend", EXTEND_SETTINGS, variant.extend) -> {"factor": 4, ...}"""
    where, settings = f"suite {suite.name}", getattr(suite, kind)
    if suite.runs != kind:
        if settings is not None or variant_keys:
            keys = f" and {kind}.* keys" if variant_keys is not None else ""
            raise ConfigError(f"{where}: `{kind}` settings{keys} need `runs: {kind}`")
        return None
    settings = settings or {}
    _refuse_unknown(where, kind, settings, known)
    for key, allowed in known.items():
        if key not in settings:
            continue
        value = settings[key]
        if isinstance(allowed, tuple) and value not in allowed:
            raise ConfigError(f"{where}: {kind}.{key}={value!r}; known: {', '.join(allowed)}")
        if allowed is dict and not isinstance(value, dict):
            raise ConfigError(f"{where}: {kind}.{key} must be a mapping, got {value!r}")
    return settings


# a finetune suite's `finetune:` keys: bases shared by the seeds or one per seed, the base's pretraining settings
# over the post-training demo's (TrainConfig keys), the number of held-out words scored, and `rlvr`: GRPO after the
# fine-tuning with pass@k measured before and after (archlab.lab.finetune.RLVR_SETTINGS)
FINETUNE_SETTINGS = {"bases": ("shared", "per_seed"), "pretrain": dict, "test_words": int, "rlvr": dict}
# finetune.rlvr: GRPO steps from the fine-tuned model, sampled answers per held-out word (the largest k of pass@k),
# GRPO prompt lines written for the run; defaults: the post-training demo's GRPO stage (archlab.training.recipes)
RLVR_SETTINGS = {"steps": 60, "samples": 16, "prompts": 2_000}


def _check_finetune(suite: Suite) -> None:
    """A finetune suite's settings (test_words >= 1, whole rlvr numbers >= 1); other suites have none."""
    where = f"suite {suite.name}"
    settings = _run_kind_settings(suite, "finetune", FINETUNE_SETTINGS)
    if settings is None:
        return
    words = settings.get("test_words", 1)
    if isinstance(words, bool) or not isinstance(words, int) or words < 1:
        raise ConfigError(f"{where}: finetune.test_words={words!r} must be a whole number >= 1")
    rlvr = settings.get("rlvr", {})
    _refuse_unknown(where, "finetune.rlvr", rlvr, RLVR_SETTINGS)
    for key, value in rlvr.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: finetune.rlvr.{key}={value!r} must be a whole number >= 1")


def _base_spec(suite: Suite, model: ModelConfig, sft: TrainConfig, seed: int, sweep_dir: Path) -> BaseSpec:
    """A finetune run's base: the variant's model, pretrained with the demo's base settings (finetune.pretrain
    over them), seed 0 for every run (`bases: shared`) or the run's seed (`per_seed`)."""
    from archlab.training.recipes import reverse_words

    demo = reverse_words(quick=False)
    settings = suite.finetune or {}
    base_seed = seed if settings.get("bases") == "per_seed" else 0
    try:
        train = TrainConfig.from_dict(merge_train(demo["base"].to_dict(), {"device": sft.device},
                                                  settings.get("pretrain", {}), {"seed": base_seed}))
    except ConfigError as exc:
        raise ConfigError(f"suite {suite.name}, finetune.pretrain: {exc}") from exc
    model = model.with_overrides({"seed": base_seed})
    return BaseSpec(model, train, base_folder(sweep_dir, model, train),
                    int(settings.get("test_words", demo["test_words"])))


# an extend suite's `extend:` keys: how many times the base's length the context grows, bases shared by the seeds or
# one per seed, the extension's TrainConfig keys (over the base's pretraining settings, seq_len = factor x L), the
# evaluation lengths as multiples of L, the passkey keys tried per depth (0: no passkey)
EXTEND_SETTINGS = {"factor": float, "bases": ("shared", "per_seed"), "train": dict, "lengths": list,
                   "passkey_trials": int}


def _check_extend(suite: Suite, variant: Variant) -> None:
    """An extend suite's settings and each variant's `extend.steps` (a whole number >= 0); other suites have none."""
    where = f"suite {suite.name}"
    settings = _run_kind_settings(suite, "extend", EXTEND_SETTINGS, variant.extend)
    if settings is None:
        return
    factor = settings.get("factor", 4)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ConfigError(f"{where}: extend.factor={factor!r} must be a number > 1 (the extended length is factor "
                          "x the base's training length)")
    lengths = settings.get("lengths", [1])
    if not isinstance(lengths, list) or not lengths or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in lengths):
        raise ConfigError(f"{where}: extend.lengths={lengths!r} must be a list of multiples of the base's length > 0")
    trials = settings.get("passkey_trials", 0)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
        raise ConfigError(f"{where}: extend.passkey_trials={trials!r} must be a whole number >= 0")
    unknown = set(variant.extend) - {"steps"}
    steps = variant.extend.get("steps", 0)
    if unknown or isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"{where}, variant {variant.name}: extend.* takes `steps`, a whole number >= 0 (0: the "
                          f"base's weights under the scaling, no training); got {variant.extend!r}")


def _extension(suite: Suite, variant: Variant, base_model: dict, train_base: dict, seed: int,
               sweep_dir: Path) -> tuple[ModelConfig, TrainConfig, BaseSpec]:
    """An extend run: (the extended model, the extension's TrainConfig, the base trained at L it starts from).
    The base is the suite's model and training at its own length; the extended model is the base's config with the
    variant's model keys (a `position.rope_scaling.kind` gets extend.factor unless it names one), the base's length
    as original_max_seq_len (training.init_from.extended_config, as `train --init-from` does) and max_seq_len
    factor x L."""
    from archlab.errors import UserError
    from archlab.training.init_from import extended_config

    settings = suite.extend or {}
    where = f"suite {suite.name}, variant {variant.name}"
    base_seed = seed if settings.get("bases", "per_seed") == "per_seed" else 0
    source = build_model_config({**base_model, "seed": base_seed})
    pretrain = TrainConfig.from_dict({**train_base, "seed": base_seed})
    base = BaseSpec(source, pretrain, base_folder(sweep_dir, source, pretrain))
    overrides = dict(variant.model)
    if "position.rope_scaling.kind" in overrides:
        overrides.setdefault("position.rope_scaling.factor", settings.get("factor", 4))
    long = round(source.max_seq_len * settings.get("factor", 4))
    steps = int(variant.extend.get("steps", 0))
    try:
        cfg, _ = extended_config(source, source.with_overrides(overrides), overrides)
        cfg = cfg.with_overrides({"max_seq_len": long, "seed": seed})
        # a 0-step run trains nothing (archlab.lab.extend); its TrainConfig only has to be a valid one
        train = TrainConfig.from_dict(merge_train(train_base, {"seq_len": long}, settings.get("train", {}),
                                                  variant.train, {"budget": max(steps, 1), "budget_unit": "steps",
                                                                  "seed": seed}))
    except UserError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return cfg, train, base


def plan(suite: Suite, sweep_dir: Path, *, scale: str = "small", seeds: int | None = None,
         budget: float | None = None, budget_unit: str | None = None, vocab_size: int | None = None,
         train_overrides: dict | None = None, device: str | None = None,
         model: str | None = None) -> list[PlannedRun]:
    """Every (variant, seed) with its resolved ModelConfig and TrainConfig, matching applied; `model`: a real_model
    suite's model instead of its own (a packaged model's name, a .gguf file or a run folder)."""

    sc = suite.scale(scale)
    base_model, base_train = suite.base_overrides(scale)
    train_base = merge_train(LAB_TRAIN_DEFAULTS, base_train, {"budget": float(budget or sc["budget"]),
                                                              "budget_unit": budget_unit or sc["unit"]},
                             train_overrides or {})
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
    source = resolve_model(suite, model)            # (path, cache folder) of a real_model suite, else None
    out: list[PlannedRun] = []
    for variant in suite.expand(scale):
        _check_ngram(suite, variant)
        _check_extend(suite, variant)
        real = real_spec(suite, variant, source, Path(sweep_dir))
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
            train_cfg = TrainConfig.from_dict(merge_train(train_base, variant.train, {"seed": seed}))
            base = _base_spec(suite, cfg, train_cfg, seed, Path(sweep_dir)) if suite.runs == "finetune" else None
            if suite.runs == "extend":
                model_cfg, train_cfg, base = _extension(suite, variant, base_model, train_base, seed, Path(sweep_dir))
            out.append(PlannedRun(variant, seed, model_cfg, train_cfg,
                                  Path(sweep_dir) / "runs" / slug(variant.name) / f"seed{seed}", note, base, real))
    return out
