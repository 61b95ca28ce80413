"""GGUF file -> TransformerLM, through the same family tables that read Hugging Face folders.

    model = archlab.interop.load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")    # float32, eval mode, .config set

The path: the file's metadata -> an HF config.json dict (gguf/arch.py) -> the family's ModelConfig; each GGUF
tensor -> its HF name (gguf's own tensor-name map, asked for every name the family's weight table holds) ->
dequantized (gguf/reader.py) and un-done of what llama.cpp's converter did (Q/K row order, Gemma's 1 + w) ->
archlab.interop.hf.map_from_hf, the code that maps an HF folder's tensors, with its checks (every tensor used,
every parameter filled, a stored head that differs from the embedding unties it).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import cast

import torch

from archlab.config import ConfigError, ModelConfig
from archlab.interop.families import FAMILIES, Family
from archlab.interop.gguf.arch import GGUFArch, arch_of
from archlab.interop.gguf.reader import GGUFError, GGUFFile
from archlab.models import build_model
from archlab.models.decoder import TransformerLM


def gguf_arch_enum(name: str):
    """gguf's MODEL_ARCH member for an architecture name ("llama" -> MODEL_ARCH.LLAMA)."""
    import gguf
    for member, text in gguf.MODEL_ARCH_NAMES.items():
        if text == name:
            return member
    raise GGUFError(f"the installed gguf package does not know architecture {name!r}")


def hf_to_gguf_names(arch: GGUFArch, fam: Family, cfg: ModelConfig) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name, for every tensor the family's table may hold for `cfg` (a tied config's
    untied head included: a file may store it), from gguf's tensor-name map of the architecture."""
    import gguf
    name_map = gguf.get_tensor_name_map(gguf_arch_enum(arch.name), cfg.n_layers)
    names = {n for c in (cfg, dataclasses.replace(cfg, tie_embeddings=False))
             for rule in fam.weight_rules(c) for n in rule.hf}
    out = {}
    for hf_name in sorted(names):
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            out[hf_name] = gguf_name
    return out


class GGUFTensors:
    """A GGUF file's tensors under their HF names (what archlab.interop.hf.map_from_hf reads), dequantized to
    float32 and converted to HF's layout on first use."""

    def __init__(self, f: GGUFFile, arch: GGUFArch, hf: dict, to_gguf: dict[str, str]):
        self.file, self.arch, self.hf = f, arch, hf
        stored = {g: h for h, g in to_gguf.items() if g in f.tensors}
        unknown = sorted(set(f.tensors) - set(stored))
        if unknown:
            raise GGUFError(f"{f.path}: tensor(s) archlab does not know in a {arch.name} model: "
                            + ", ".join(unknown[:8]) + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else ""))
        self.gguf_name = {h: g for g, h in stored.items()}

    def names(self) -> list[str]:
        return list(self.gguf_name)

    def get(self, name: str) -> torch.Tensor:
        g = self.gguf_name[name]
        return self.arch.from_gguf(g, self.file.dequantized(g), self.hf)


@dataclass
class GGUFModelSpec:
    """What a GGUF file says about its model, before any tensor is read."""

    file: GGUFFile
    arch: GGUFArch
    family: Family
    hf_config: dict
    config: ModelConfig


def read_spec(path: str | os.PathLike) -> GGUFModelSpec:
    """Header, architecture, HF config and ModelConfig of a GGUF file (GGUFError / ConfigError naming the file)."""
    f = GGUFFile(path)
    arch = arch_of(f)
    hf = arch.hf_config(f)
    fam = FAMILIES.get(arch.model_type)
    try:
        cfg = fam.to_config(hf)
    except ConfigError as exc:
        raise GGUFError(f"{f.path}: {exc}") from None
    cfg = dataclasses.replace(cfg, name=str(f.metadata.get("general.name") or cfg.name))
    return GGUFModelSpec(f, arch, fam, hf, cfg)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> TransformerLM:
    """A GGUF file -> TransformerLM in eval mode (`.config` set), its quantized tensors dequantized to `dtype`.
    Example: model = load_gguf(archlab.interop.gguf.packaged_model("smollm2-135m-instruct"))"""
    return load_gguf_spec(read_spec(path), dtype)


def load_gguf_spec(spec: GGUFModelSpec, dtype: torch.dtype = torch.float32) -> TransformerLM:
    """load_gguf for a file whose header `read_spec` has read."""
    from archlab.interop.families.tables import WeightsError
    from archlab.interop.hf import load_our_state, map_from_hf

    source = GGUFTensors(spec.file, spec.arch, spec.hf_config, hf_to_gguf_names(spec.arch, spec.family, spec.config))
    try:
        cfg, tensors = map_from_hf(spec.family, spec.config, source)
    except (WeightsError, ConfigError) as exc:
        raise GGUFError(f"{spec.file.path}: {exc}") from None
    with torch.device("meta"):      # no random init, no second copy of the weights
        model = cast(TransformerLM, build_model(cfg))
    try:
        load_our_state(model, {k: v.to(dtype) for k, v in tensors.items()})
    except WeightsError as exc:
        raise GGUFError(f"{spec.file.path}: {exc}") from None
    return model.eval()
