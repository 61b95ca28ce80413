"""Checkpoints: atomic saves, keep-last-K, verification, and reading a checkpoint's files back.

A run folder describes itself (DESIGN.md)::

    RUN_DIR/
      config.yaml          keys `model` (ModelConfig), `train` (TrainConfig), `data` (where and what)
      tokenizer/           copied from the data folder
      metrics.jsonl        one JSON object per line (train and eval lines)
      samples.txt          generated text at sample points
      loss_curve.png       train / val loss against tokens
      checkpoints/
        step_0000100/
          model.safetensors    weights under our parameter names (TransformerLM.state_dict())
          trainer.safetensors  optimizer, schedule counters, RNG states, data-sampler position
                               (archlab.runs.statefile: tensors + a JSON tree, no pickle)
          meta.json            format version, step, tokens, size and sha256 of each file; written last

A checkpoint is written into `checkpoints/.tmp-step_XXXXXXX-PID/`, flushed to disk, then renamed to
`step_XXXXXXX` in one `os.rename`: a folder named `step_*` is always complete, and older checkpoints are
deleted only after the new one is in place, so the last good checkpoint always survives a crash.

Nothing in a checkpoint can run code when loaded: weights and trainer state are safetensors, metadata
JSON. Every load checks each file's size against meta.json, and every name meta.json gives stays inside its
folder; `verify_checkpoint(..., full=True)` also checks the sha256 (resume does; a damaged newest checkpoint is
skipped for the previous good one), and `verified_weights` (what model_folder.load_run reads for generate, serve,
convert --to-hf) checks the sha256 of the
weights it loads and refuses a weights file linked from outside the run folder.
Checkpoints of format 1 (trainer.pt, a pickle) load through an explicit allow-list of tensors,
containers and NumPy arrays (`statefile.load_legacy_pickle`); the resumed run saves format 2.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from archlab.errors import UserError, os_errors_of
from archlab.faults import fault_point
from archlab.runs.lock import pid_alive
from archlab.runs.statefile import load_legacy_pickle, load_state, save_state

__all__ = [
    "CheckpointError", "save_checkpoint", "load_checkpoint", "list_checkpoints", "latest_checkpoint",
    "MODEL_FILE", "TRAINER_FILE", "META_FILE",
    "verify_checkpoint", "verified_weights", "resumable_checkpoint", "holds_trainer_state", "FORMAT_VERSION",
    "nonfinite", "NonFiniteWeightsError",
]

FORMAT_VERSION = 2                 # 1: trainer.pt (pickle); 2: trainer.safetensors + sha256 in meta.json
MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.safetensors"
LEGACY_TRAINER_FILE = "trainer.pt"
META_FILE = "meta.json"
FILE_MODE = 0o644                  # checkpoints and exports are shared: readable by others, as usual
CHECKPOINT_DIR = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint or run folder that cannot be read; the message names the file."""


class NonFiniteWeightsError(CheckpointError):
    """Weights that read fine but hold NaN or infinity (`nonfinite`): a run that diverged."""


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
    with os_errors_of(path):
        save_file(unique, str(path), metadata={"format": "pt", "aliases": json.dumps(aliases)})
    make_readable(path)


def make_readable(path: str | os.PathLike) -> None:
    """Mode 0644 less the umask: safetensors writes 0600 through a temporary file."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, FILE_MODE & ~umask)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def nonfinite(name: str, tensor: torch.Tensor) -> str | None:
    """What is wrong with weight `name` when it is floating point and not all finite ("weight NAME holds NaN (3 of
    1,024 values)"), else None. One isfinite pass per tensor: cheap beside reading it. Such weights load without a
    word, print junk greedily and fail sampling, so every loader of weights for use refuses them with this.
    Example: nonfinite("w", torch.tensor([1.0, float("nan")])) -> 'weight w holds NaN (1 of 2 values)'"""
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):
        return None
    counts = {"NaN": int(torch.isnan(tensor).sum()), "infinity": int(torch.isinf(tensor).sum())}
    kinds = " and ".join(kind for kind, n in counts.items() if n)
    return f"weight {name} holds {kinds} ({sum(counts.values()):,} of {tensor.numel():,} values)"


def load_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A state dict from model.safetensors (on CPU); raises CheckpointError naming a bad file, or the first weight
    that is not finite (`nonfinite`): what generate, chat, serve, convert --to-hf, --init-from and --resume load."""
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
    bad = next(filter(None, (nonfinite(name, tensor) for name, tensor in state.items())), None)
    if bad is not None:
        raise NonFiniteWeightsError(f"{path}: {bad}: the run diverged; resume from an earlier checkpoint")
    for name, target in aliases.items():
        state[name] = state[target]
    return state


# --------------------------------------------------------------------------- checkpoints
def check_free_space(root: Path, model_state: dict[str, torch.Tensor], margin: float = 1.2) -> None:
    """Refuse a save that cannot fit before writing a byte: the newest checkpoint's size (or, for the
    first, the weights times 3 for AdamW's two moments), with a margin, against the free space."""
    newest = latest_checkpoint(root)
    if newest is not None:
        need = sum(f.stat().st_size for f in newest.iterdir() if f.is_file())
    else:
        need = 3 * sum(t.numel() * t.element_size() for t in model_state.values())
    free = shutil.disk_usage(root).free
    if free < need * margin:
        raise CheckpointError(f"not enough disk space to save a checkpoint under {root}: about "
                              f"{need * margin / 2**20:,.0f} MiB needed, {free / 2**20:,.0f} MiB free; "
                              "the previous checkpoint is kept")


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
    """The newest checkpoint folder that has its meta.json (written last by save_checkpoint): a stray `step_*`
    folder without one is not a checkpoint (`archlab check` lists it as damaged)."""
    found = [ckpt for ckpt in list_checkpoints(root) if (ckpt / META_FILE).is_file()]
    return found[-1] if found else None


def save_checkpoint(root: str | os.PathLike, step: int, model_state: dict[str, torch.Tensor],
                    trainer_state: dict[str, Any], *, keep_last: int = 3,
                    extra_meta: dict | None = None) -> Path:
    """Write checkpoint `step` atomically under `root` (the checkpoints/ folder); keep the newest
    `keep_last` (0 or less: keep all). Returns the checkpoint folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    check_free_space(root, model_state)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        save_weights(model_state, tmp / MODEL_FILE)
        fault_point("save:weights")
        save_state(trainer_state, tmp / TRAINER_FILE)
        make_readable(tmp / TRAINER_FILE)
        fault_point("save:trainer")
        names = (MODEL_FILE, TRAINER_FILE)
        meta = {"format": FORMAT_VERSION, "step": int(step),
                "files": {name: (tmp / name).stat().st_size for name in names},
                "sha256": {name: sha256_file(tmp / name) for name in names}, **(extra_meta or {})}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        fault_point("save:meta")
        for name in (MODEL_FILE, TRAINER_FILE, META_FILE):
            _fsync_file(tmp / name)
        _fsync_dir(tmp)
        fault_point("save:fsync")
        old = None
        if final.exists():  # same step saved again (e.g. after a resume): swap, then drop the old one
            old = root / f".old-{step_dir_name(step)}-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(root)
        fault_point("save:rename")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last > 0:
        for stale in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(stale, ignore_errors=True)
    fault_point("save:prune")
    for leftover in root.glob(".tmp-step_*"):  # from runs killed mid-save, never a live process's
        pid = leftover.name.rsplit("-", 1)[-1]
        if leftover != tmp and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)
    return final


def read_meta(path: str | os.PathLike) -> dict:
    """meta.json of a checkpoint folder; CheckpointError if it is missing or not JSON."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"incomplete checkpoint {path}: no {META_FILE}")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"corrupt checkpoint metadata {meta_path}: {exc}") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("files", {}), dict):
        raise CheckpointError(f"corrupt checkpoint metadata {meta_path}: not an archlab meta.json")
    return meta


def verify_checkpoint(path: str | os.PathLike, *, full: bool = False) -> dict:
    """Check every file meta.json lists: present and of its recorded size; with `full`, also its
    sha256 (format 2). Returns the meta; raises CheckpointError naming the first damaged file."""
    path = Path(path)
    meta = read_meta(path)
    for name, size in meta.get("files", {}).items():
        file = confined(path, name, META_FILE)
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint file {file} is corrupt: {file.stat().st_size} bytes, "
                                  f"{META_FILE} says {size}")
        expected = meta.get("sha256", {}).get(name)
        if full and expected is not None and sha256_file(file) != expected:
            raise CheckpointError(f"checkpoint file {file} is corrupt: its sha256 differs from {META_FILE}'s")
    return meta


def confined(folder: Path, name: str, named_by: str) -> Path:
    """folder / name, which must stay inside `folder` once links are resolved: a name in `named_by` that climbs
    out (`../`, an absolute path) or a link to a file elsewhere is a CheckpointError naming it."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(f"{folder / named_by} names {name!r}, not a file inside {folder}")
    file = folder / name
    inside = folder.resolve()
    if not file.resolve().is_relative_to(inside):
        raise CheckpointError(f"{file} is a link to {file.resolve()}, outside {inside}: not loaded")
    return file


def verified_weights(ckpt: Path, run_dir: Path | None = None) -> dict[str, torch.Tensor]:
    """The model state of checkpoint folder `ckpt` once its model.safetensors matched the size and sha256 that
    meta.json records (format 1 records sizes only), no file it lists a link out of `ckpt`, and `ckpt` itself
    inside `run_dir` when given. What generate, serve and convert --to-hf load: a flipped byte or a foreign file
    is a CheckpointError naming it, not text from other weights."""
    meta = verify_checkpoint(ckpt)
    if run_dir is not None:
        confined(run_dir, ckpt.relative_to(run_dir).as_posix(), CHECKPOINT_DIR)
    file = confined(ckpt, MODEL_FILE, META_FILE)
    expected = (meta.get("sha256") or {}).get(MODEL_FILE)
    if expected is not None and sha256_file(file) != expected:
        raise CheckpointError(f"checkpoint file {file} is corrupt or was replaced: its sha256 differs from "
                              f"{ckpt / META_FILE}'s")
    return load_weights(file)


def load_checkpoint(path: str | os.PathLike, *, weights_only_model: bool = False, full_verify: bool = False
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """(model state dict, trainer state) from a checkpoint folder, both on CPU. Sizes are always
    checked against meta.json, sha256 hashes with `full_verify`.

    Raises CheckpointError naming the file when a file is missing, truncated or unreadable."""
    path = Path(path)
    verify_checkpoint(path, full=full_verify)
    model_state = load_weights(path / MODEL_FILE)
    if weights_only_model:
        return model_state, None
    return model_state, load_trainer_state(path)


def load_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint folder: format 2's safetensors, or format 1's pickle through
    an allow-list that admits tensors, containers and NumPy arrays only."""
    if (path / TRAINER_FILE).is_file():
        try:
            return load_state(path / TRAINER_FILE)
        except Exception as exc:  # safetensors raises its own error types for garbled files
            raise CheckpointError(f"corrupt or unreadable trainer state {path / TRAINER_FILE}: {exc}") from exc
    legacy = path / LEGACY_TRAINER_FILE
    if not legacy.is_file():
        raise CheckpointError(f"checkpoint {path} has no {TRAINER_FILE}")
    try:
        return load_legacy_pickle(legacy)
    except Exception as exc:
        raise CheckpointError(
            f"{legacy} (checkpoint format 1) holds objects outside the allow-list of tensors, containers and "
            f"NumPy arrays, so it is not loaded ({type(exc).__name__}); retrain from {path / MODEL_FILE} "
            "or rewrite it with a trusted archlab <= 0.1 install") from exc


def holds_trainer_state(path: Path) -> bool:
    """Whether a checkpoint can be resumed (it has an optimizer state), not only loaded: imported weights
    (`archlab convert --from-hf`) have none. Reads the state file's header, not its tensors."""
    from safetensors import safe_open

    if not (path / TRAINER_FILE).is_file():
        return (path / LEGACY_TRAINER_FILE).is_file()
    try:
        with safe_open(str(path / TRAINER_FILE), framework="pt", device="cpu") as f:
            tree = json.loads((f.metadata() or {}).get("tree", "{}"))
    except Exception as exc:  # safetensors raises its own error types for garbled files
        raise CheckpointError(f"corrupt or unreadable trainer state {path / TRAINER_FILE}: {exc}") from exc
    return isinstance(tree, dict) and "optimizer" in tree


def resumable_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint whose files all match their sha256 (None: there is none at all). A damaged
    one is skipped with a warning naming it; only damaged ones -> CheckpointError."""
    found = list_checkpoints(root)
    damage: list[str] = []
    for ckpt in reversed(found):
        try:
            verify_checkpoint(ckpt, full=True)
            load_trainer_state(ckpt)
        except CheckpointError as exc:
            warnings.warn(f"skipping damaged checkpoint {ckpt.name}: {exc}", stacklevel=2)
            damage.append(str(exc))
            continue
        if damage:
            warnings.warn(f"resuming from {ckpt.name}, the newest checkpoint that verifies", stacklevel=2)
        return ckpt
    if found:
        raise CheckpointError(f"no checkpoint under {Path(root)} verifies, nothing to resume from "
                              f"(newest: {damage[0]})")
    return None
