"""An HF-format tokenizer folder (tokenizer.json, tokenizer_config.json) as GGUF `tokenizer.ggml.*` metadata:
tokenizer.py's inverse, for the two kinds it reads.

    byte-level BPE (a ByteLevel pre-tokenizer, archlab's own tokenizers and GPT-2 / Llama 3 / Qwen / SmolLM)
        -> tokenizer.ggml.model "gpt2": tokens in id order, merges "a b", `pre` named by its split regex
    SentencePiece BPE with byte fallback (Gemma) -> "llama": tokens in id order, scores -id (Gemma's merge order)
Special roles (bos, eos, unk, pad) come from tokenizer_config.json, or for a tokenizer archlab trained from its
special tokens (archlab.tokenizer.roles); the chat template from the folder (archlab.tokenizer.chat); sampling
defaults from a generation_config.json as llama.cpp's general.sampling.* keys.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from archlab.config import ConfigError, ModelConfig
from archlab.errors import read_json_object
from archlab.interop.gguf.arch import GGUFArch
from archlab.interop.gguf.tokenizer import CONTROL, PRE_SPLITS, SENTENCEPIECE_BY_ORDER, SPACE, USER_DEFINED

NORMAL = 1
_ROLE_KEYS = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}


def _roles(folder: Path) -> dict[str, str]:
    from archlab.tokenizer.chat import read_special_tokens
    special = read_special_tokens(folder)         # tokenizer_config.json's roles, or a trained tokenizer's
    return {role: special[f"{role}_token"] for role in _ROLE_KEYS if isinstance(special.get(f"{role}_token"), str)}


def tokenizer_metadata(folder: str | os.PathLike, cfg: ModelConfig, arch: GGUFArch) -> dict[str, tuple[str, Any]]:
    """{GGUF key: (GGUFWriter add_<kind>, value)} for the tokenizer in `folder`; a ConfigError names a tokenizer
    GGUF cannot hold or one larger than the model's vocabulary."""
    from archlab.tokenizer.chat import read_chat_templates

    folder = Path(folder)
    data = read_json_object(folder / "tokenizer.json", ConfigError)
    model = data.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict):
        raise ConfigError(f"GGUF export: {folder / 'tokenizer.json'} is a {model.get('type')} tokenizer; GGUF "
                          "holds byte-level BPE and SentencePiece BPE")
    by_id = {int(i): t for t, i in vocab.items()}
    kinds = {}
    for added in data.get("added_tokens") or []:
        by_id[int(added["id"])] = added["content"]
        kinds[int(added["id"])] = CONTROL if added.get("special", True) else USER_DEFINED
    n = max(by_id) + 1
    if n > cfg.vocab_size or len(by_id) != n:
        raise ConfigError(f"GGUF export: {folder / 'tokenizer.json'} has ids 0..{n - 1} with {n - len(by_id)} "
                          f"missing, for a model of {cfg.vocab_size} tokens")
    tokens = [by_id[i] for i in range(n)]
    meta: dict[str, tuple[str, Any]] = {}
    if _byte_level(data):
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
        meta["tokenizer.ggml.model"] = ("string", "gpt2")
        meta["tokenizer.ggml.pre"] = ("string", _pre_name(data))
        meta["tokenizer.ggml.merges"] = ("array", merges)
    elif model.get("byte_fallback") and arch.name in SENTENCEPIECE_BY_ORDER:
        meta["tokenizer.ggml.model"] = ("string", "llama")
        tokens = [t.replace(SPACE, " ") if set(t) == {SPACE} and len(t) > 1 else t for t in tokens]
        meta["tokenizer.ggml.scores"] = ("array", [float(-i) for i in range(n)])
    else:
        raise ConfigError(f"GGUF export: the tokenizer in {folder} is neither byte-level BPE nor a Gemma "
                          "SentencePiece; export the model without it (--no-tokenizer)")
    meta["tokenizer.ggml.tokens"] = ("array", tokens)
    meta["tokenizer.ggml.token_type"] = ("array", [kinds.get(i, NORMAL) for i in range(n)])
    index = {t: i for i, t in by_id.items()}
    for role, token in _roles(folder).items():
        if token in index:
            meta[f"tokenizer.ggml.{_ROLE_KEYS[role]}_token_id"] = ("uint32", index[token])
    config_file = folder / "tokenizer_config.json"
    config = read_json_object(config_file, ConfigError) if config_file.is_file() else {}
    for flag in ("add_bos_token", "add_eos_token"):
        value = config.get(flag, _post_processor_adds(data, flag))
        meta[f"tokenizer.ggml.{flag}"] = ("bool", bool(value))
    template = read_chat_templates(folder)
    if isinstance(template, dict):
        template = template.get("default")
    if isinstance(template, str):
        meta["tokenizer.chat_template"] = ("string", template)
    return meta


def _byte_level(data: dict) -> bool:
    pre = data.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return any(p.get("type") == "ByteLevel" for p in parts) and not (data.get("model") or {}).get("byte_fallback")


def _pre_name(data: dict) -> str:
    """llama.cpp's name for the tokenizer's split regex (tokenizer.PRE_SPLITS), "gpt-2" for ByteLevel's own."""
    pre = data.get("pre_tokenizer") or {}
    for part in pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []:
        regex = (part.get("pattern") or {}).get("Regex") if part.get("type") == "Split" else None
        for name, split in PRE_SPLITS.items():
            if regex == split:
                return name
        if regex is not None:
            raise ConfigError(f"GGUF export: llama.cpp has no name for the split regex {regex[:40]!r}...")
    return "gpt-2"


def _post_processor_adds(data: dict, flag: str) -> bool:
    """Whether tokenizer.json's TemplateProcessing puts a special token before (bos) / after (eos) the text."""
    single = (data.get("post_processor") or {}).get("single") or []
    if not single:
        return False
    edge = single[0] if flag == "add_bos_token" else single[-1]
    return "SpecialToken" in edge


def sampling_metadata(generation: dict | None) -> dict[str, tuple[str, Any]]:
    """llama.cpp's general.sampling.* keys from a generation_config.json dict that samples (do_sample)."""
    from archlab.interop.gguf.tokenizer import SAMPLING_KEYS
    if not (generation or {}).get("do_sample"):
        return {}
    out: dict[str, tuple[str, Any]] = {}
    for key, field in SAMPLING_KEYS.items():
        value = (generation or {}).get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = ("uint32", int(value)) if field == "top_k" else ("float32", float(value))
    return out
