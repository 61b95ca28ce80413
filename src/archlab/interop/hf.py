"""Hugging Face folders (config.json + safetensors) <-> TransformerLM, EncoderLM (BERT, RoBERTa) or
EncoderDecoderLM (T5).

`load_hf(folder)` reads config.json, picks the family registered for its `model_type`, builds our
ModelConfig, and maps every tensor (single `model.safetensors` or a sharded
`model.safetensors.index.json`, whose shard names stay inside the folder; memory-mapped, CPU). Every HF tensor
must be used and every one of our parameters filled: a missing or a left-over tensor is an error naming it, so a
silently half-loaded model cannot happen. A stored copy of a tensor that is read (a tied head, BERT's decoder,
T5's per-stack embeddings) is dropped only when equal to it; one that differs is used as transformers uses it
(the head unties) or refused by name, so a file never loads to other logits than transformers gives it.
`save_hf(model, folder)` writes a folder `transformers` loads to the same logits; the family is inferred from the
config when not given.
HF names appear only here, in archlab.interop.families and in archlab.interop.tokenizer_files (the tokenizer
files beside an exported tokenizer.json, `write_tokenizer_files`, re-exported here).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Protocol, cast

import torch

from archlab.config import ConfigError, ModelConfig
from archlab.errors import os_errors_of
from archlab.interop.families import FAMILIES, Family, infer_family  # noqa: F401 - re-exported
from archlab.interop.families.base import config_diff
from archlab.interop.families.tables import Rule, WeightsError
from archlab.interop.folders import read_json_object
from archlab.interop.tokenizer_files import write_tokenizer_files  # noqa: F401 - convert calls it from here
from archlab.models import build_model
from archlab.models.decoder import TransformerLM
from archlab.models.encoder import EncoderLM
from archlab.models.encoder_decoder import EncoderDecoderLM
from archlab.progress import progress_bar
from archlab.runs.checkpoint import make_readable, nonfinite

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

HFModel = TransformerLM | EncoderLM | EncoderDecoderLM   # what load_hf builds (by the config's arch) and save_hf writes


# ---- reading -----------------------------------------------------------------------------------
def read_hf_config(folder: str | Path) -> dict:
    return read_json_object(folder, "config.json", "Hugging Face model folder")


def family_for(hf: dict) -> Family:
    model_type = hf.get("model_type")
    if not model_type:
        raise ConfigError("config.json has no 'model_type'; known: "
                          + ", ".join(sorted(FAMILIES.names())))
    return FAMILIES.get(model_type)  # unknown -> ConfigError listing the known ones


def _shard_name(index: Path, name: object) -> str:
    """A shard file name from an index's weight_map: a path inside the folder (`../` and absolute paths are
    refused; a shard that is a link, as in the Hugging Face cache, is followed)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise WeightsError(f"{index} names shard {name!r}, not a file inside {index.parent}")
    return name


class SafetensorsFolder:
    """Lazy access to the tensors of a folder: name -> file, opened memory-mapped on first use."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        folder = Path(folder)
        self._safe_open = safe_open
        self._handles: dict[Path, object] = {}
        index = folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.files = {name: folder / _shard_name(index, file) for name, file in weight_map.items()}
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise WeightsError(f"{index}: not a safetensors index ({exc})") from exc
            for path in set(self.files.values()):
                if not path.is_file():
                    raise WeightsError(f"{index} names shard {path.name}, which is missing")
        elif (folder / SINGLE_FILE).is_file():
            path = folder / SINGLE_FILE
            self.files = {name: path for name in self._open(path).keys()}
        else:
            others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
            hint = f" (found {', '.join(others)}: convert pickled weights to safetensors first)" if others else ""
            raise WeightsError(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = self._safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for truncated / garbled files
                raise WeightsError(f"corrupt or unreadable weights file {path}: {exc}") from exc
        return self._handles[path]

    def names(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`; a NaN or infinity in a floating-point tensor is a WeightsError naming it
        (archlab.runs.checkpoint.nonfinite, the rule a run folder's weights follow too)."""
        tensor = self._open(self.files[name]).get_tensor(name)
        bad = nonfinite(name, tensor)
        if bad is not None:
            raise WeightsError(f"{self.files[name]}: {bad}; refusing weights that are not finite")
        return tensor


class TensorSource(Protocol):
    """Named checkpoint tensors: a SafetensorsFolder, or a GGUF file's tensors under their HF names
    (archlab.interop.gguf.load.GGUFTensors)."""

    def names(self) -> list[str]: ...

    def get(self, name: str) -> torch.Tensor: ...


# ---- loading -----------------------------------------------------------------------------------
def load_hf(folder: str | Path, dtype: torch.dtype | None = torch.float32,
            family: str | None = None, adapter: str | Path | None = None) -> HFModel:
    """HF folder -> the model its config's arch names (TransformerLM, EncoderLM for BERT and RoBERTa, or
    EncoderDecoderLM for T5) in eval mode (`.config` set). `dtype=None` keeps the checkpoint's dtype; `family`
    overrides config.json's model_type; `adapter`: a PEFT LoRA adapter folder for this base, loaded onto the
    model (archlab.interop.peft; nn.lora.merge_lora folds it in)."""
    hf = read_hf_config(folder)
    fam = FAMILIES.get(family) if family else family_for(hf)
    cfg = fam.to_config(hf)
    source = SafetensorsFolder(folder)
    cfg, tensors = map_from_hf(fam, cfg, source)   # what config.json cannot say: a head stored apart unties
    if dtype is None:
        dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    with torch.device("meta"):  # no random init, no second copy of the weights in memory
        model = cast(HFModel, build_model(cfg))
    load_our_state(model, {k: v.to(dtype) if v.is_floating_point() else v
                           for k, v in tensors.items()})
    if adapter is not None:
        from archlab.interop.peft import load_peft
        load_peft(model, adapter, family=fam.model_type)
    return model.eval()


def load_our_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy named tensors into the model's parameters; every parameter exactly once."""
    own = model.state_dict()
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - set(own))
    if missing or extra:
        raise WeightsError(
            "weights do not match the model"
            + (f"; missing: {', '.join(missing[:10])}" if missing else "")
            + (f"; unexpected: {', '.join(extra[:10])}" if extra else "")
        )
    for name, value in tensors.items():
        if own[name].shape != value.shape:
            raise WeightsError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape "
                               f"{tuple(own[name].shape)}")
    if next(iter(own.values())).is_meta:  # adopt the tensors themselves (see load_hf)
        model.load_state_dict(tensors, assign=True)
    else:
        model.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()})


def _prefix_fix(fam: Family, names: list[str]) -> dict[str, str]:
    """Our expected HF name -> stored name; adds the base prefix back for bare-base checkpoints and
    reads legacy spellings through `fam.hf_name`."""
    prefix = fam.base_prefix
    bare = bool(prefix and names and not any(n.startswith(prefix) for n in names))
    return {fam.hf_name(prefix + n if bare else n): n for n in names}


def map_from_hf(fam: Family, cfg: ModelConfig, source: TensorSource
                ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(the config the checkpoint holds, all of our parameters from its HF tensors). Every stored tensor is read,
    or equal to one read (a stored copy), or one transformers does not load either (`ignored_hf`); a copy that
    differs unties the config or is read in its source's place (as transformers does) or is refused by name.
    Errors name missing and left-over tensors."""
    stored = _prefix_fix(fam, source.names())
    cfg, read_from, settled = _settle_copies(fam, cfg, source, stored)
    rules = fam.weight_rules(cfg)
    needed = [read_from.get(name, name) for rule in rules for name in rule.hf]
    missing = [n for n in needed if n not in stored]
    if missing:
        raise WeightsError(f"{fam.model_type} checkpoint is missing tensor(s): {', '.join(missing[:10])}"
                           + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))
    ignored = [re.compile(p) for p in fam.ignored_hf(cfg)]
    used = set(needed) | settled
    leftover = [n for n in stored if n not in used and not any(p.fullmatch(n) for p in ignored)]
    if leftover:
        raise WeightsError(f"{fam.model_type} checkpoint has tensor(s) archlab does not use: "
                           f"{', '.join(leftover[:10])}"
                           + (f" (+{len(leftover) - 10} more)" if len(leftover) > 10 else ""))
    out: dict[str, torch.Tensor] = {}
    for rule in progress_bar(rules, desc=f"loading {fam.model_type} tensors", unit="tensor",
                             disable=len(rules) < 200, leave=False):
        try:
            values = rule.to_ours([source.get(stored[read_from.get(n, n)]) for n in rule.hf])
        except ConfigError as exc:
            raise ConfigError(f"{fam.model_type} checkpoint tensor {', '.join(rule.hf)}: {exc}") from exc
        if len(values) != len(rule.ours):
            raise WeightsError(f"rule for {rule.hf} produced {len(values)} tensors for {rule.ours}")
        for name, value in zip(rule.ours, values):
            if name in out:
                raise WeightsError(f"{fam.model_type}: parameter {name} mapped twice (family bug)")
            out[name] = value
    return cfg, out


def _settle_copies(fam: Family, cfg: ModelConfig, source: TensorSource, stored: dict[str, str]
                   ) -> tuple[ModelConfig, dict[str, str], set[str]]:
    """(config, HF name -> the HF name read in its place, HF names accounted for without being read) after
    comparing every stored copy the config does not read with what it copies (Family.stored_copies). A copy
    whose source is absent is read as the source (transformers ties the other way round); a copy the config reads
    but the file lacks is read from its source."""
    while True:   # an untied head changes the config, and with it the copies: settle them again
        read_from: dict[str, str] = {}
        settled: set[str] = set()
        needed = {name for rule in fam.weight_rules(cfg) for name in rule.hf}
        for copy in fam.stored_copies(cfg):
            tied = copy.source if copy.source in stored else None       # the tensor it copies, when stored
            if copy.name in needed and copy.name not in stored and tied is not None:
                read_from[copy.name] = tied           # a tie transformers makes: the copy is its source
            if copy.name not in stored or copy.name in needed:
                continue
            if copy.source is not None and tied is None:
                read_from[copy.source] = copy.name    # transformers ties the other way round
                continue
            expected = source.get(stored[tied]) if tied is not None else copy.compute() if copy.compute else None
            if expected is not None and _same_tensor(source.get(stored[copy.name]), expected, exact=tied is not None):
                settled.add(copy.name)
            elif copy.on_difference == "untie_head" and cfg.tie_embeddings:
                cfg = dataclasses.replace(cfg, tie_embeddings=False)
                break
            elif copy.on_difference == "read_copy" and tied is not None:
                read_from[tied] = copy.name
                settled.add(tied)
            else:
                what = f"differs from {tied}, which it is tied to" if tied else "differs from what its config implies"
                raise WeightsError(f"{fam.model_type} checkpoint tensor {copy.name} {what}"
                                   + (f": {copy.why}" if copy.why else "")
                                   + "; archlab will not drop a tensor that holds other values")
        else:
            return cfg, read_from, settled


def _same_tensor(stored: torch.Tensor, expected: torch.Tensor, exact: bool) -> bool:
    """Equal shapes and values (in the expected tensor's dtype); `exact` False allows float32 rounding (a table
    computed by another program)."""
    if stored.shape != expected.shape:
        return False
    stored = stored.to(expected.dtype)
    return torch.equal(stored, expected) if exact else torch.allclose(stored, expected, rtol=0.0, atol=1e-6)


# ---- saving ------------------------------------------------------------------------------------
def save_hf(model: HFModel, folder: str | Path, family: str | None = None) -> Family:
    """Write config.json + model.safetensors loadable by `transformers`; returns the family used.
    With `family` given, the round trip must still be exact (error naming the differing switch). An untied
    config also gets the copies transformers then reads apart (BART's per-stack embed_tokens)."""
    from safetensors.torch import save_file

    cfg = model.config
    if family is None:
        fam = infer_family(cfg)
        hf = fam.to_hf(cfg)
    else:
        fam = FAMILIES.get(family)
        hf = fam.to_hf(cfg)
        diff = config_diff(cfg, fam.to_config(hf))
        if diff:
            raise ConfigError(f"HF family {family!r} cannot express {', '.join(diff)} of this config")
    own = {k: v.detach() for k, v in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    covered: set[str] = set()
    rules = fam.weight_rules(cfg)
    for rule in progress_bar(rules, desc=f"mapping to {fam.model_type}", unit="tensor",
                             disable=len(rules) < 200, leave=False):
        values = rule.to_hf([own[n] for n in rule.ours])
        covered.update(rule.ours)
        for name, value in zip(rule.hf, values):
            tensors[name] = value.contiguous().cpu()
    left = sorted(set(own) - covered)
    if left:
        raise WeightsError(f"{fam.model_type}: no HF name for parameter(s) {', '.join(left)}")
    if not cfg.tie_embeddings and fam.config_unties:   # transformers ties nothing: BART's stacks read their own
        for copy in fam.stored_copies(cfg):
            if copy.source in tensors and copy.name not in tensors:
                tensors[copy.name] = tensors[copy.source].clone()
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) == 1:
        hf["torch_dtype"] = hf["dtype"] = str(dtypes.pop()).removeprefix("torch.")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("model-*-of-*.safetensors"), folder / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)     # an earlier sharded export would shadow the new single file
    (folder / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    with os_errors_of(folder / SINGLE_FILE):
        save_file(tensors, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    make_readable(folder / SINGLE_FILE)
    return fam


def rules_for(model_type: str, cfg: ModelConfig) -> list[Rule]:
    """The weight mapping of a family (for tools that inspect it)."""
    return FAMILIES.get(model_type).weight_rules(cfg)
