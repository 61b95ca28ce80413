"""Checkpoints and run folders: atomic saves, keep-last-K, and loading a run back.

A run folder describes itself (DESIGN.md)::

    RUN_DIR/
      config.yaml          keys `model` (ModelConfig), `train` (TrainConfig), `data` (where and what)
      tokenizer/           copied from the data folder
      metrics.jsonl        one JSON object per line (train and eval lines)
      samples.txt          generated text at sample points
      loss_curve.png       train / val loss against tokens
      checkpoints/
        step_0000100/
          model.safetensors  weights under our parameter names (TransformerLM.state_dict())
          trainer.pt         optimizer, schedule counters, RNG states, data-sampler position
          meta.json          step, tokens, file sizes; written last

A checkpoint is written into `checkpoints/.tmp-step_XXXXXXX-PID/`, flushed to disk, then renamed to
`step_XXXXXXX` in one `os.rename`: a folder named `step_*` is always complete, and older checkpoints are
deleted only after the new one is in place, so the last good checkpoint always survives a crash.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from archlab.config import ModelConfig
from archlab.errors import UserError

__all__ = [
    "CheckpointError", "save_checkpoint", "load_checkpoint", "list_checkpoints", "latest_checkpoint",
    "write_run_config", "read_run_config", "load_run", "MODEL_FILE", "TRAINER_FILE", "META_FILE",
]

MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"
META_FILE = "meta.json"
CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.yaml"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint or run folder that cannot be read; the message names the file."""


# --------------------------------------------------------------------------- low-level io
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not supported on this platform / filesystem
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _dedupe_aliases(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors sharing memory: keep the first name, remember the others."""
    seen: dict[tuple, str] = {}
    unique, aliases = {}, {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tensor.dtype) if tensor.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        unique[name] = tensor.detach().to("cpu").contiguous()
    return unique, aliases


def save_weights(state: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    from safetensors.torch import save_file

    unique, aliases = _dedupe_aliases(state)
    save_file(unique, str(path), metadata={"format": "pt", "aliases": json.dumps(aliases)})


def load_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A state dict from model.safetensors (on CPU); raises CheckpointError naming a bad file."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"missing weights file {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}
            aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    except Exception as exc:  # safetensors raises its own error types for truncated / garbled files
        raise CheckpointError(f"corrupt or unreadable weights file {path}: {exc}") from exc
    for name, target in aliases.items():
        state[name] = state[target]
    return state


# --------------------------------------------------------------------------- checkpoints
def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders under `root` (a run folder or its checkpoints/), oldest first."""
    root = Path(root)
    if (root / CHECKPOINT_DIR).is_dir():
        root = root / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(root: str | os.PathLike, step: int, model_state: dict[str, torch.Tensor],
                    trainer_state: dict[str, Any], *, keep_last: int = 3,
                    extra_meta: dict | None = None) -> Path:
    """Write checkpoint `step` atomically under `root` (the checkpoints/ folder); keep the newest
    `keep_last` (0 or less: keep all). Returns the checkpoint folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        save_weights(model_state, tmp / MODEL_FILE)
        torch.save(trainer_state, tmp / TRAINER_FILE)
        files = {name: (tmp / name).stat().st_size for name in (MODEL_FILE, TRAINER_FILE)}
        meta = {"step": int(step), "files": files, **(extra_meta or {})}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        for name in (MODEL_FILE, TRAINER_FILE, META_FILE):
            _fsync_file(tmp / name)
        _fsync_dir(tmp)
        old = None
        if final.exists():  # same step saved again (e.g. after a resume): swap, then drop the old one
            old = root / f".old-{step_dir_name(step)}-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last > 0:
        for stale in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(stale, ignore_errors=True)
    for leftover in root.glob(".tmp-step_*"):  # from runs killed mid-save
        if leftover != tmp:
            shutil.rmtree(leftover, ignore_errors=True)
    return final


def load_checkpoint(path: str | os.PathLike, *, weights_only_model: bool = False
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """(model state dict, trainer state) from a checkpoint folder, both on CPU.

    Raises CheckpointError naming the file when a file is missing, truncated or unreadable."""
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"incomplete checkpoint {path}: no {META_FILE}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"corrupt checkpoint metadata {meta_path}: {exc}") from exc
    for name, size in meta.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint file {file} is corrupt: {file.stat().st_size} bytes, "
                                  f"{META_FILE} says {size}")
    model_state = load_weights(path / MODEL_FILE)
    if weights_only_model:
        return model_state, None
    trainer_path = path / TRAINER_FILE
    try:
        # weights_only=False: the state holds numpy RNG state (a tuple with an ndarray); the file is ours
        trainer_state = torch.load(trainer_path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"corrupt or unreadable trainer state {trainer_path}: {exc}") from exc
    return model_state, trainer_state


# --------------------------------------------------------------------------- run folders
def write_run_config(run_dir: str | os.PathLike, model: dict, train: dict, data: dict) -> Path:
    path = Path(run_dir) / CONFIG_FILE
    text = yaml.safe_dump({"model": model, "train": train, "data": data}, sort_keys=False)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def read_run_config(run_dir: str | os.PathLike) -> dict:
    """The raw config.yaml mapping of a run folder (keys model, train, data)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{run_dir} is not a run folder: no {CONFIG_FILE}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise CheckpointError(f"corrupt run config {path}: {exc}") from exc
    if not isinstance(data, dict) or "model" not in data:
        raise CheckpointError(f"{path} has no `model` section")
    return data


def load_run(run_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
             device: str | torch.device = "cpu"):
    """(TransformerLM in eval mode with the latest (or given) checkpoint's weights, tokenizer or None)."""
    from archlab.model import TransformerLM

    run_dir = Path(run_dir)
    cfg = ModelConfig.from_dict(read_run_config(run_dir)["model"])
    ckpt = Path(checkpoint) if checkpoint is not None else latest_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{run_dir} has no checkpoint under {run_dir / CHECKPOINT_DIR}")
    state, _ = load_checkpoint(ckpt, weights_only_model=True)
    model = TransformerLM(cfg)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(f"{ckpt / MODEL_FILE} does not match the model in config.yaml: {exc}") from exc
    model.to(device).eval()
    return model, load_run_tokenizer(run_dir)


def load_run_tokenizer(run_dir: str | os.PathLike):
    tok_dir = Path(run_dir) / "tokenizer"
    if not tok_dir.is_dir():
        return None
    from archlab.data import load_tokenizer

    return load_tokenizer(tok_dir)
