"""What produced a run folder, and what it was trained on.

- `provenance(...)`: archlab version (and git sha where the package sits in a checkout), torch version,
  device name and CPU flags, resolved dtype, attention backend per layer. Written to each run folder
  (`provenance.json`) and printed by each benchmark, so figures from different machines can be told
  apart.
- `data_fingerprint(data_dir)`: a cheap identity of a prepared data folder (its meta.json and the first
  and last MiB of each split), recorded in config.yaml and compared on resume.
- `check_resume_matches(...)`: a resume continues the same model on the same tokenizer and data; checked
  before anything in the run folder changes.

>>> sorted(provenance(device="cpu"))[:3]
['archlab', 'attention_backends', 'cpu_capability']
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from archlab.errors import DataError
from archlab.training.precision import cpu_model

__all__ = ["provenance", "provenance_line", "write_provenance", "device_name", "data_fingerprint",
           "tokenizer_fingerprint", "check_resume_matches", "ENCODING_SECTIONS",
           "PROVENANCE_FILE"]

PROVENANCE_FILE = "provenance.json"
_EDGE = 1 << 20


@functools.cache
def _git_sha() -> str | None:
    """The commit of the archlab checkout this package is imported from (None for an installed wheel)."""
    root = Path(__file__).resolve().parents[3]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_flags() -> list[str]:
    """The CPU flags that decide kernel speed (SIMD width, bf16/AMX units)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "fma")
    return [flag for flag in wanted if flag in flags]


def device_name(device: str | torch.device) -> str:
    """What figures were measured on: GPU name, or CPU model and the SIMD level torch dispatches to."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()}, {torch.backends.cpu.get_cpu_capability()}"


def attention_backends(model: torch.nn.Module) -> list[str]:
    """The attention implementation each layer runs (as the layer reports it), in layer order."""
    found = []
    for module in model.modules():
        describe = getattr(module, "attention_backend", None)
        if callable(describe):
            found.append(describe())
    return found


def provenance(*, device: str | torch.device = "cpu", dtype: str | None = None,
               model: torch.nn.Module | None = None) -> dict:
    """Everything that makes a figure from this process differ from another machine's."""
    from archlab import __version__

    return {
        "archlab": __version__, "git_sha": _git_sha(), "torch": torch.__version__,
        "python": platform.python_version(), "device": device_name(device),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": _cpu_flags(),
        "threads": torch.get_num_threads(), "dtype": dtype,
        "attention_backends": attention_backends(model) if model is not None else [],
    }


def provenance_line(device: str | torch.device = "cpu", **extra) -> str:
    """One line for a benchmark's output: `provenance: {...}` (JSON), so its figures say where they came from."""
    record = {k: v for k, v in provenance(device=device).items() if k != "attention_backends"}
    return "provenance: " + json.dumps({**record, **{k: v for k, v in extra.items() if v is not None}})


def write_provenance(run_dir: str | os.PathLike, record: dict) -> None:
    """Append this process's record to the run folder's history (a resume adds one)."""
    path = Path(run_dir) / PROVENANCE_FILE
    history = []
    if path.is_file():
        try:
            history = json.loads(path.read_text()).get("sessions", [])
        except (ValueError, AttributeError):
            history = []
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"sessions": [*history, record]}, indent=2) + "\n")
    os.replace(tmp, path)


# ---- identity of the inputs --------------------------------------------------------------------
def _hash_edges(digest, path: Path) -> None:
    size = path.stat().st_size
    digest.update(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(_EDGE))
        if size > 2 * _EDGE:
            f.seek(size - _EDGE)
            digest.update(f.read(_EDGE))


def tensors_sha256(tensors: dict) -> str:
    """sha256 of named tensors: each name, dtype, shape and bytes, in name order (a model's weights, a file's
    tensors), so the same values under the same names give the same digest wherever they were loaded from.
    Example: tensors_sha256(model.state_dict()) -> "9f2c..." (64 hex digits)"""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def data_fingerprint(data_dir: str | os.PathLike) -> str:
    """sha256 (16 hex digits) of a data file, or of a data folder's meta.json and the edges of each split's files
    (a token stream's "file"; a pairs folder's "source_file", "target_file", "offsets_file")."""
    data_dir = Path(data_dir)
    if data_dir.is_file():                              # a .jsonl of preference pairs: the whole file
        return hashlib.sha256(data_dir.read_bytes()).hexdigest()[:16]
    meta = json.loads((data_dir / "meta.json").read_text())
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for split in sorted(meta.get("splits", {})):
        info = meta["splits"][split]
        for key in sorted(k for k in info if k == "file" or k.endswith("_file")):
            _hash_edges(digest, data_dir / info[key])
    return digest.hexdigest()[:16]


ENCODING_SECTIONS = ("model", "normalizer", "pre_tokenizer", "post_processor", "added_tokens")


def tokenizer_fingerprint(tok_dir: str | os.PathLike) -> str | None:
    """sha256 (16 hex digits) of what a tokenizer folder encodes with, so that the same tokenizer matches
    whichever side files sit beside it (an HF folder's tokenizer_config.json, generation_config.json, a
    prepared data folder's vocab.json): the tokenizer as archlab loads it, in tokenizer.json form, reduced
    to its ENCODING_SECTIONS; a byte tokenizer by its spec file; vocab.json + merges.txt where there is no
    tokenizer.json. None: the folder holds no tokenizer."""
    tok_dir = Path(tok_dir)
    if not tok_dir.is_dir():
        return None
    from archlab.data.tokenizer_adapter import ByteTokenizer

    digest = hashlib.sha256()
    if (tok_dir / ByteTokenizer.FILE).is_file():
        digest.update(b"bytes:" + _canonical(json.loads((tok_dir / ByteTokenizer.FILE).read_text())))
    elif (tok_dir / "tokenizer.json").is_file():
        data = _loaded_tokenizer_json(tok_dir)
        digest.update(b"tokenizer.json:" + _canonical({k: data.get(k) for k in ENCODING_SECTIONS}))
    elif (tok_dir / "vocab.json").is_file() and (tok_dir / "merges.txt").is_file():
        for name in ("vocab.json", "merges.txt"):
            digest.update(name.encode() + b":" + (tok_dir / name).read_bytes())
    else:
        return None
    return digest.hexdigest()[:16]


def _canonical(data) -> bytes:
    return json.dumps(data, sort_keys=True, ensure_ascii=False).encode()


def _loaded_tokenizer_json(tok_dir: Path) -> dict:
    """The tokenizer.json archlab would save for the tokenizer it loads from `tok_dir` (what `data prepare`
    copies), so a file and its re-saved copy compare equal; the file as written when no reader takes it."""
    from archlab.tokenizer import load

    try:
        tok = load(tok_dir, fast=False)       # the pure-Python encoder: no merge tables built
    except Exception:  # noqa: BLE001 - any reader failure: compare the file itself
        tok = None
    if tok is not None and callable(getattr(tok, "to_json", None)):
        return tok.to_json()
    if tok is not None and hasattr(getattr(tok, "hf", None), "to_str"):
        return json.loads(tok.hf.to_str())
    data = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {"model": data}


def check_resume_matches(run_dir: Path, model_cfg, data_info: dict, tok_src: Path, allow_new_data: bool) -> None:
    """Raise (ConfigError / DataError) when a resume would continue a different model, tokenizer or data."""
    from archlab.config import ConfigError, ModelConfig
    from archlab.runs.model_folder import read_run_config

    saved = read_run_config(run_dir)
    # through ModelConfig, so a run saved before a field existed compares with that field's default
    if ModelConfig.from_dict(saved["model"]).to_dict() != model_cfg.to_dict():
        raise ConfigError(f"cannot resume {run_dir}: its config.yaml has a different model config")
    ours, theirs = tokenizer_fingerprint(tok_src), tokenizer_fingerprint(run_dir / "tokenizer")
    if ours is not None and theirs is not None and ours != theirs:
        raise DataError(f"cannot resume {run_dir}: --data {data_info['dir']} has a different tokenizer than the "
                        "one the run was trained with")
    before = saved.get("data") or {}
    same = before.get("fingerprint", data_info["fingerprint"]) == data_info["fingerprint"]
    if not same and not allow_new_data:
        raise DataError(f"cannot resume {run_dir}: it was trained on {before.get('dir')}, and --data "
                        f"{data_info['dir']} holds other data; pass --allow-new-data to continue on it")
