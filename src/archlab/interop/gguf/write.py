"""TransformerLM -> GGUF file (f32, f16 or q8_0) for the architectures llama.cpp knows, tokenizer and chat
template included; the inverse of load.py through the same tables.

    save_gguf(model, "model.gguf", qtype="q8_0", tokenizer_dir="runs/x/tokenizer")

The first GGUF architecture (arch.py) whose HF family expresses the config exactly is written; the family's HF
config.json fields become `{arch}.*` metadata, its HF tensors get gguf's names and what
llama.cpp's converter does to them (Q/K row order, Gemma's 1 + w). A config the file cannot express (llama.cpp
hard-codes Gemma 3's local theta and 5:1 pattern, for one) is refused: the header written is read back through
load.py's reader and must give the same ModelConfig, before the file takes its name.
Quantization (gguf.quants): f16 and q8_0 store the 2-D weights so (q8_0: rows in whole blocks of 32, else f16);
1-D tensors (norms, biases) stay f32, as llama.cpp keeps them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from archlab.config import ConfigError, ModelConfig
from archlab.interop.families import Family
from archlab.interop.gguf.arch import ARCHES, GGUFArch
from archlab.interop.gguf.reader import GGUFError
from archlab.progress import progress_bar

QTYPES = ("f32", "f16", "q8_0")
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7}          # general.file_type (llama.cpp's LLAMA_FTYPE_*)
FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "rope.freq_base",
              "attn_logit_softcapping", "final_logit_softcapping")


def export_arch(cfg: ModelConfig) -> tuple[GGUFArch, Family]:
    """The first GGUF architecture (ARCHES' order) whose HF family expresses `cfg` exactly, with that family; a
    ConfigError names why each could not (a Mistral with its sliding window, a BERT, ...)."""
    from archlab.interop.families import FAMILIES
    from archlab.interop.families.base import config_diff

    why = []
    for arch in ARCHES.values():
        fam = FAMILIES.get(arch.model_type)
        try:
            diff = config_diff(cfg, fam.to_config(fam.to_hf(cfg)))
        except (ConfigError, NotImplementedError) as exc:
            why.append(f"{arch.name}: {exc}")
            continue
        if not diff:
            return arch, fam
        why.append(f"{arch.name}: differs in {', '.join(diff[:4])}")
    raise ConfigError("GGUF export: no architecture llama.cpp knows expresses this config: " + "; ".join(why[:4])
                      + (f" (+{len(why) - 4} more)" if len(why) > 4 else ""))


def _quantized(tensor: torch.Tensor, qtype: str) -> tuple[np.ndarray, Any]:
    """(array to write, its ggml type or None for numpy's dtype) of one tensor."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    array = tensor.detach().to(torch.float32).cpu().numpy()
    if array.ndim < 2 or qtype == "f32":
        return array, None
    if qtype == "q8_0" and array.shape[-1] % 32 == 0:
        return quantize(array, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
    return array.astype(np.float16), None


def _metadata(writer: Any, arch: GGUFArch, hf: dict, cfg: ModelConfig) -> None:
    for key, hf_key in arch.fields.items():
        value = hf.get(hf_key)
        if value is None or isinstance(value, bool) or key in ("rope.freq_base", "attention.key_length"):
            continue
        if key in FLOAT_KEYS:
            writer.add_float32(f"{arch.name}.{key}", float(value))
        elif isinstance(value, int):
            writer.add_uint32(f"{arch.name}.{key}", value)
    if cfg.position.kind == "rope":
        writer.add_uint32(f"{arch.name}.rope.dimension_count", int(round(cfg.head_dim * cfg.position.rotary_fraction)))
        writer.add_float32(f"{arch.name}.rope.freq_base", float(cfg.position.rope_theta))
        scaling = cfg.position.rope_scaling
        if scaling is not None:
            if scaling.kind not in ("linear", "yarn"):
                raise ConfigError(f"GGUF export: rope scaling {scaling.kind!r} is not supported (linear, yarn)")
            writer.add_string(f"{arch.name}.rope.scaling.type", scaling.kind)
            writer.add_float32(f"{arch.name}.rope.scaling.factor", float(scaling.factor))
            if scaling.kind == "yarn":
                writer.add_uint32(f"{arch.name}.rope.scaling.original_context_length", scaling.original_max_seq_len)
    if "num_attention_heads" in hf:
        writer.add_uint32(f"{arch.name}.attention.key_length", cfg.head_dim)
        writer.add_uint32(f"{arch.name}.attention.value_length", cfg.head_dim)


def _float32_diff(a: ModelConfig, b: ModelConfig) -> list[str]:
    """config_diff, less the float fields equal once rounded to float32 (what GGUF stores them as)."""
    from archlab.interop.families.base import config_diff

    def value(cfg: ModelConfig, key: str) -> Any:
        for part in key.split("."):
            cfg = getattr(cfg, part, None)     # type: ignore[assignment]
        return cfg

    def same32(x: Any, y: Any) -> bool:
        return isinstance(x, float) and isinstance(y, float) and np.float32(x) == np.float32(y)
    return [k for k in config_diff(a, b) if not same32(value(a, k), value(b, k))]


def save_gguf(model: torch.nn.Module, path: str | os.PathLike, *, qtype: str = "f16",
              tokenizer_dir: str | os.PathLike | None = None, generation: dict | None = None) -> Path:
    """Write `model` (a TransformerLM whose config an HF family llama.cpp knows expresses) as a GGUF file: weights
    in `qtype` (f32, f16, q8_0), tokenizer and chat template from `tokenizer_dir` (an HF-format tokenizer folder;
    None: the file has none), llama.cpp's sampling keys from a generation_config.json dict `generation`. The file
    appears only once complete and read back to the same config (ConfigError naming what differs otherwise).
    Example: save_gguf(model, "out/model.gguf", qtype="q8_0", tokenizer_dir="runs/x/tokenizer")"""
    import gguf

    from archlab.interop.gguf.load import hf_to_gguf_names, read_spec
    from archlab.interop.gguf.tokenizer_out import sampling_metadata, tokenizer_metadata

    if qtype not in QTYPES:
        raise ConfigError(f"GGUF export: type {qtype!r} is not one of {', '.join(QTYPES)}")
    cfg: ModelConfig = model.config      # type: ignore[assignment]
    arch, fam = export_arch(cfg)
    hf = fam.to_hf(cfg)
    names = hf_to_gguf_names(arch, fam, cfg)
    token_meta = tokenizer_metadata(tokenizer_dir, cfg, arch) if tokenizer_dir is not None else {}
    token_meta.update(sampling_metadata(generation))
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(str(partial), arch.name)
    try:
        writer.add_name(cfg.name)
        writer.add_file_type(FILE_TYPES[qtype])
        if qtype == "q8_0":
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _metadata(writer, arch, hf, cfg)
        for key, (kind, value) in token_meta.items():
            getattr(writer, f"add_{kind}")(key, value)
        own = {k: v.detach() for k, v in model.state_dict().items()}
        rules = fam.weight_rules(cfg)
        for rule in progress_bar(rules, desc=f"writing {arch.name} GGUF ({qtype})", unit="tensor",
                                 disable=len(rules) < 200, leave=False):
            for hf_name, value in zip(rule.hf, rule.to_hf([own[n] for n in rule.ours])):
                if hf_name not in names:
                    raise ConfigError(f"GGUF export: llama.cpp's {arch.name} has no tensor for {hf_name}")
                gguf_name = names[hf_name]
                array, raw_dtype = _quantized(arch.to_gguf(gguf_name, value, hf), qtype)
                writer.add_tensor(gguf_name, array, raw_dtype=raw_dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        diff = _float32_diff(cfg, read_spec(partial).config)
        if diff:
            raise ConfigError(f"GGUF export: a {arch.name} GGUF file cannot express {', '.join(diff[:6])} of this "
                              "config (llama.cpp fixes them for the architecture)")
        os.replace(partial, path)
    except GGUFError as exc:
        raise ConfigError(f"GGUF export: the file written does not read back: {exc}") from None
    finally:
        partial.unlink(missing_ok=True)
    return path
