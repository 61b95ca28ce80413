"""GGUF (llama.cpp's file format) in and out.

    model = archlab.interop.load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")     # TransformerLM, float32
    path = archlab.interop.gguf.packaged_model("smollm2-135m-instruct")      # the `models` extra's files
    archlab convert --from-gguf FILE --out RUN                               # a run folder with its tokenizer

reader.py reads the header with every claim checked against the file's size; arch.py maps each architecture's
metadata onto the Hugging Face family that names its tensors; load.py builds the model; tokenizer.py rebuilds
the tokenizer folder; packaged.py finds the packaged models.
"""
from archlab.interop.gguf.load import load_gguf
from archlab.interop.gguf.packaged import PACKAGED, packaged_model, resolve_gguf
from archlab.interop.gguf.reader import GGUFError, GGUFFile

__all__ = ["GGUFError", "GGUFFile", "PACKAGED", "load_gguf", "packaged_model", "resolve_gguf"]
