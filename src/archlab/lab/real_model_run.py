"""A `real_model` run of the lab (a suite with `runs: real_model`): a pretrained model evaluated instead of a model
trained, one row per variant (the condition its measurement applies, archlab.lab.real_model).

    1. the model    a .gguf file (or a packaged model by name, e.g. smollm2-135m-instruct from the `models` extra)
                    converted once into SWEEP/models/<name>-<hash>/run by the sweep's driver, as it prepares a
                    training suite's data (`ensure_model`, archlab.interop.convert.convert_from_gguf), and read by
                    every run of the sweep; a run folder is used as it is
    2. the text     `tokens` tokens of Hamlet (the Shakespeare corpus, past its header), tokenized by the model's own
                    tokenizer
    3. measuring    MEASURES[measure](model, ids, **settings): the row's `ppl` (its final_val_loss is ln ppl) and the
                    measurement's other figures in `extra`, with the CPU (or GPU) and the seconds it took

The suite's `real_model` mapping holds the measurement and its defaults; a variant's `real.` keys override them.
Example: archlab ablate quantization --model smollm2-135m-instruct --out sweeps/quantization --report
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from archlab.config import ConfigError
from archlab.errors import UserError
from archlab.lab.real_model import MEASURES, SETTINGS
from archlab.lab.store import RunRecord
from archlab.lab.suites import Suite, Variant, slug
from archlab.nn.int8 import weight_count

if TYPE_CHECKING:
    from archlab.lab.plan import RunJob

__all__ = ["DEFAULT_MODEL", "RUN_SETTINGS", "RealSpec", "resolve_model", "real_spec", "ensure_model", "real_model_job",
           "text_ids"]

DEFAULT_MODEL = "smollm2-135m-instruct"
# a suite's `real_model` keys besides the measurement's own (archlab.lab.real_model.SETTINGS)
RUN_SETTINGS: dict[str, type] = {"measure": str, "model": str, "tokens": int}
MODEL_RECORD = "model.json"          # in the model's cache folder, written last: the conversion is complete
TEXT = "Hamlet (Shakespeare corpus)"


@dataclass(frozen=True)
class RealSpec:
    """What a `real_model` run measures: the model (a GGUF file converted once into `folder`, or a run folder used as
    it is), the measurement and its settings (the suite's `real_model` with the variant's `real.` keys over them)."""

    source: Path                  # the resolved .gguf file or run folder
    folder: Path | None           # SWEEP/models/<name>-<hash>/ the conversion is cached in (None: a run folder)
    measure: str
    settings: dict                # text, tokens and the measurement's own keys

    def to_dict(self) -> dict:
        return {"source": str(self.source), "folder": str(self.folder) if self.folder else None,
                "measure": self.measure, "settings": self.settings}


def resolve_model(suite: Suite, model: str | None = None) -> tuple[Path, Path | None] | None:
    """(the model's file or run folder, the cache folder name its conversion goes in, or None for a run folder) of a
    real_model suite (`model` over the suite's own), checked before anything is written; None for other suites.
    A name that is no path is a packaged model's (archlab.interop.gguf.PACKAGED). Bad input is one UserError line."""
    if suite.runs != "real_model":
        if suite.real_model is not None:
            raise ConfigError(f"suite {suite.name}: `real_model` settings need `runs: real_model`")
        if model is not None:
            raise UserError(f"--model is for the real-model suites (runs: real_model); {suite.name} trains its own")
        return None
    _check_settings(suite)
    spec = str(model or (suite.real_model or {}).get("model") or DEFAULT_MODEL)
    from archlab.interop.gguf.load import read_spec
    from archlab.interop.gguf.packaged import PACKAGED, packaged_model

    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.yaml").is_file():
            raise UserError(f"--model {spec}: a folder but not a run folder (no config.yaml)")
        if (suite.real_model or {}).get("measure") == "quantization":
            from archlab.runs.model_folder import refuse_quantized

            # its int8 layers are no nn.Linear: every scheme would score the same model
            refuse_quantized(path, f"ablate {suite.name} --model")
        return path.resolve(), None
    if not path.exists():
        if spec not in PACKAGED:
            raise UserError(f"--model {spec}: no such file or folder, and no packaged model of that name (known: "
                            f"{', '.join(sorted(PACKAGED))}); give a .gguf file or a converted run folder")
        path = packaged_model(spec)                          # a UserError naming the extra when it is absent
    read_spec(path)                                          # not a GGUF file / unknown architecture: one line
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return path.resolve(), Path(f"{slug(path.stem)}-{key}")


def _check_settings(suite: Suite) -> None:
    settings = suite.real_model or {}
    measure = settings.get("measure")
    if measure not in MEASURES:
        raise ConfigError(f"suite {suite.name}: real_model.measure={measure!r}; known: {', '.join(MEASURES)}")
    _check_keys(f"suite {suite.name}, real_model", {k: v for k, v in settings.items() if k != "measure"}, measure,
                with_run=True)


def _check_keys(where: str, settings: dict, measure: str, *, with_run: bool) -> None:
    known = {**SETTINGS[measure], **({k: v for k, v in RUN_SETTINGS.items() if k != "measure"} if with_run else {})}
    unknown = set(settings) - set(known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: {', '.join(known)}")
    for key, value in settings.items():
        kind = known[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(f"{where}: {key}={value!r} must be {'a whole number' if kind is int else 'a string'}")


def real_spec(suite: Suite, variant: Variant, source: tuple[Path, Path | None] | None,
              sweep_dir: Path) -> RealSpec | None:
    """A real_model run's RealSpec (the suite's settings with the variant's `real.` keys over them); None for other
    suites, whose variants may not carry `real.` keys."""
    if source is None:
        if variant.real:
            raise ConfigError(f"suite {suite.name}, variant {variant.name}: real.* keys need `runs: real_model`")
        return None
    settings = dict(suite.real_model or {})
    measure = settings.pop("measure")
    settings.pop("model", None)
    _check_keys(f"suite {suite.name}, variant {variant.name}", variant.real, measure, with_run=False)
    path, cache = source
    return RealSpec(path, None if cache is None else Path(sweep_dir) / "models" / cache, measure,
                    {**settings, **variant.real})


def text_ids(tokenizer, tokens: int):
    """The first `tokens` + 1 ids of Hamlet past the corpus file's header, in the model's tokenizer: (tokens + 1,)."""
    import torch

    from archlab.data.corpora import corpus_files

    hamlet = next(f for f in corpus_files("shakespeare") if "hamlet" in f.name)
    ids = torch.tensor(tokenizer.encode(hamlet.read_text(errors="replace")[30_000:90_000]))[: tokens + 1]
    if ids.numel() < tokens + 1:
        raise UserError(f"the text holds {ids.numel() - 1} tokens in this tokenizer, fewer than tokens={tokens}")
    return ids


def _run_dir(spec: RealSpec) -> Path:
    return spec.source if spec.folder is None else spec.folder / "run"


def ensure_model(spec: RealSpec) -> dict:
    """The run folder spec's model is read from: spec.folder/run converted from the GGUF file unless a finished
    conversion is there (its record, MODEL_RECORD, is written last), or the run folder given. Called by the sweep's
    driver under its lock, before any run. Returns the record ({gguf, seconds}; {} for a run folder)."""
    if spec.folder is None:
        return {}
    record = spec.folder / MODEL_RECORD
    if record.is_file():
        return json.loads(record.read_text())
    from archlab.interop.convert import convert_from_gguf

    if _run_dir(spec).exists():                  # a conversion that stopped half way
        shutil.rmtree(_run_dir(spec))
    t0 = time.perf_counter()
    convert_from_gguf(spec.source, _run_dir(spec))
    done = {"gguf": str(spec.source), "seconds": time.perf_counter() - t0}
    record.write_text(json.dumps(done) + "\n")
    return done


def real_model_job(job: RunJob, failed: Callable[[RunRecord, BaseException, float], RunRecord]) -> RunRecord:
    """One real_model row: the model (converted once, or loaded), the text, the measurement. The worker hands in its
    own `failed` (archlab.lab.worker). Example: worker.RUN_KINDS["real_model"](job) -> real_model_job(job, failed)"""
    import torch

    from archlab.runs.model_folder import load_run
    from archlab.runs.provenance import device_name

    record, spec = job.record, job.run.real
    assert spec is not None, "a real_model run is planned with its RealSpec"
    t0 = time.perf_counter()
    settings = dict(spec.settings)
    tokens = int(settings.pop("tokens", 1024))
    run_dir = _run_dir(spec)
    try:
        model, tok = load_run(run_dir)
        if tok is None:
            raise UserError(f"{run_dir} has no tokenizer/: a real-model suite scores text in the model's tokenizer")
        ids = text_ids(tok, tokens)
        start = time.perf_counter()
        metrics = MEASURES[spec.measure](model, ids, **settings)
    except Exception as exc:  # noqa: BLE001 - a failed run is recorded, the sweep goes on
        return failed(record, exc, t0)
    record.status = "done"
    record.final_val_loss = record.best_val_loss = math.log(metrics["ppl"]) if metrics["ppl"] > 0 else None
    record.params = weight_count(model)                      # an int8 run's rows included
    record.tokens_seen = int(ids.numel())
    record.extra.update({**metrics, "model": model.config.name, "source": str(spec.source),
                         "text": f"{TEXT}, {ids.numel() - 1} tokens", "device": device_name("cpu"),
                         "cores": os.cpu_count(), "threads": torch.get_num_threads(),
                         "seconds": time.perf_counter() - start})
    record.wall_s = time.perf_counter() - t0
    record.finished_at = time.time()
    return record
