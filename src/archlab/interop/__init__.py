"""Interoperability with Hugging Face checkpoints (see archlab.interop.hf).

    model = archlab.interop.load_hf("path/to/hf_folder")   # config.json + *.safetensors
    archlab.interop.save_hf(model, "out_folder")            # loadable by transformers
    model = archlab.interop.load_gguf("model.gguf")         # llama.cpp's format (archlab.interop.gguf)
Families live in archlab.interop.families (one module each; base.py explains how to add one).
Run folders (archlab's own format) are archlab.runs.checkpoint's business; `archlab convert` bridges.
"""
from archlab.interop.families import FAMILIES, Family, register_family
from archlab.interop.gguf import load_gguf
from archlab.interop.hf import WeightsError, infer_family, load_hf, read_hf_config, save_hf

__all__ = [
    "FAMILIES", "Family", "WeightsError", "infer_family", "load_gguf", "load_hf", "read_hf_config",
    "register_family", "save_hf",
]
