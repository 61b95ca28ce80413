"""A GGUF file's tokenizer (`tokenizer.ggml.*`) as the files of a Hugging Face tokenizer folder: tokenizer.json
(the `tokenizers` library's format, which archlab.tokenizer.load reads), tokenizer_config.json (special tokens,
add_bos_token, the chat template) and generation_config.json (bos / eos / pad ids, llama.cpp's sampling
defaults `general.sampling.*` when the file names them). Built as data; no tokenizer library is needed.

    tokenizer.ggml.model   what is built (transformers' GGUF tokenizers are the reference, same structure)
    gpt2                   byte-level BPE: the file's vocabulary and merges, GPT-2's ByteLevel pre-tokenizer
                           or the regex llama.cpp's `tokenizer.ggml.pre` names (llama-bpe, qwen2, ...)
    llama                  SentencePiece BPE with byte fallback: the merges the vocabulary implies, ranked by
                           the tokens' scores (Gemma: by their order in the file, as its scores do not rank)
Token types (llama.cpp): 3 = control -> a special added token, 4 = user-defined -> an added token matched whole.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from archlab.interop.gguf.reader import GGUFError, GGUFFile
from archlab.tokenizer.pretokenize import bytes_to_unicode

CONTROL, USER_DEFINED = 3, 4
SPACE = "\u2581"       # SentencePiece's visible space

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex that splits text before byte-level BPE (llama.cpp's names); others: GPT-2's
PRE_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
              "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
              "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
SENTENCEPIECE_BY_ORDER = ("gemma", "gemma2", "gemma3")     # merges ranked by token order, not score


def tokenizer_files(f: GGUFFile, vocab_size: int) -> dict[str, dict[str, Any]]:
    """{file name: JSON content} of the tokenizer folder the file describes (generation_config.json alone for a file
    without a tokenizer); a GGUFError for one archlab cannot build or whose vocabulary does not fit the model's
    `vocab_size`."""
    kind = f.field("tokenizer.ggml.model", str)
    if kind is None and "tokenizer.ggml.tokens" not in f.metadata:      # a file without a tokenizer
        return {"generation_config.json": {"_from_model_config": False, **_sampling(f)}}
    if kind is None:
        raise GGUFError(f"{f.path}: tokenizer.ggml.tokens without tokenizer.ggml.model")
    tokens = f.field("tokenizer.ggml.tokens", list)
    if not tokens:
        raise GGUFError(f"{f.path}: no tokenizer.ggml.tokens in the metadata")
    if len(tokens) > vocab_size:
        raise GGUFError(f"{f.path}: the tokenizer has {len(tokens)} tokens but the model's embedding only "
                        f"{vocab_size} rows: the tokenizer does not match the vocabulary")
    types = _array(f, "tokenizer.ggml.token_type", len(tokens), [1] * len(tokens))
    arch = f.field("general.architecture", str)
    if kind == "gpt2":
        data = _byte_level(f, tokens, types)
    elif kind == "llama":
        data = _sentencepiece(f, tokens, types, by_order=arch in SENTENCEPIECE_BY_ORDER)
    else:
        raise GGUFError(f"{f.path}: tokenizer.ggml.model={kind!r} is not supported (supported: gpt2, llama)")
    roles = {}
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        i = f.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None:
            if not isinstance(i, int) or not 0 <= i < len(tokens):
                raise GGUFError(f"{f.path}: tokenizer.ggml.{key}_token_id={i!r} is not a token of the "
                                f"{len(tokens)}-token vocabulary")
            roles[role] = i
    add_bos = f.field("tokenizer.ggml.add_bos_token", bool, kind == "llama")   # llama.cpp's default for SP
    add_eos = f.field("tokenizer.ggml.add_eos_token", bool, False)
    data["post_processor"] = _post_processor(data["added_tokens"], roles, add_bos, add_eos)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
                              "add_eos_token": add_eos, "clean_up_tokenization_spaces": False,
                              "model_max_length": int(f.metadata.get(f"{arch}.context_length") or 2048)}
    config.update({f"{role}_token": _spelled(data, i) for role, i in roles.items()})
    template = f.field("tokenizer.chat_template", str)
    if template is not None:
        config["chat_template"] = template
    generation: dict[str, Any] = {"_from_model_config": False,
                                  **{f"{r}_token_id": roles[r] for r in ("bos", "eos", "pad") if r in roles}}
    generation.update(_sampling(f))
    return {"tokenizer.json": data, "tokenizer_config.json": config, "generation_config.json": generation}


def _array(f: GGUFFile, key: str, n: int, default: list) -> list:
    value = f.metadata.get(key)
    if value is None:
        return default
    if not isinstance(value, (list, np.ndarray)) or len(value) != n:
        raise GGUFError(f"{f.path}: {key} has {len(value) if hasattr(value, '__len__') else 'no'} entries for "
                        f"{n} tokens")
    return list(value.tolist() if isinstance(value, np.ndarray) else value)


def _spelled(data: dict, i: int) -> str:
    for added in data["added_tokens"]:
        if added["id"] == i:
            return added["content"]
    vocab = data["model"]["vocab"]
    return next(t for t, j in vocab.items() if j == i)


def _added(tokens: list[str], types: list[int], allowed=None) -> list[dict]:
    """Control tokens as special added tokens, user-defined ones as plain added tokens (matched whole)."""
    out = []
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind in (CONTROL, USER_DEFINED) and (allowed is None or allowed(token)):
            out.append({"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
                        "normalized": False, "special": kind == CONTROL})
    return out


def _unique_vocab(f: GGUFFile, tokens: list[str]) -> dict[str, int]:
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))     # type: ignore[func-returns-value]
        raise GGUFError(f"{f.path}: tokenizer.ggml.tokens lists {dup!r} twice")
    return vocab


def _byte_level(f: GGUFFile, tokens: list[str], types: list[int]) -> dict:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = _unique_vocab(f, spelled)
    merges = []
    for i, merge in enumerate(f.field("tokenizer.ggml.merges", list, [])):
        parts = merge.split(" ")
        if len(parts) != 2 or parts[0] + parts[1] not in vocab:
            raise GGUFError(f"{f.path}: tokenizer.ggml.merges[{i}]={merge!r} does not merge two tokens into a "
                            "token of the vocabulary")
        merges.append(parts)
    split = PRE_SPLITS.get(f.field("tokenizer.ggml.pre", str, "default"))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    pre = byte_level if split is None else {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
        {**byte_level, "use_regex": False}]}
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": _added(tokens, types, lambda t: set(t) <= alphabet),
            "normalizer": None, "pre_tokenizer": pre, "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                      "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges}}


def _sentencepiece(f: GGUFFile, stored: list[str], types: list[int], by_order: bool) -> dict:
    tokens = stored
    if by_order:    # a token of 2+ spaces is stored with real spaces; the vocabulary spells them with SPACE
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in stored]
    vocab = _unique_vocab(f, tokens)
    # added tokens as the file spells them; a user-defined one only where the vocabulary spells it alike
    added = [a for a in _added(stored, types) if a["special"] or a["content"] in vocab]
    if by_order:
        rank: Mapping[str, float] = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = _array(f, "tokenizer.ggml.scores", len(tokens), [])
        if not scores:
            raise GGUFError(f"{f.path}: a SentencePiece tokenizer needs tokenizer.ggml.scores")
        rank = dict(zip(tokens, scores))
    unk = f.metadata.get("tokenizer.ggml.unknown_token_id")
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
            "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                              "invert": False},
            "post_processor": None,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]},
            "model": {"type": "BPE", "dropout": None,
                      "unk_token": tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                      "byte_fallback": True, "ignore_merges": False, "vocab": vocab,
                      "merges": implied_merges(vocab, rank)}}


def implied_merges(vocab: dict[str, int], rank: Mapping[str, float]) -> list[list[str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens, best-ranked
    token first (ties: shorter left part first), as transformers' generate_merges orders them."""
    merges: list[tuple[float, str, str]] = []
    for token, score in rank.items():
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((score, left, right) for left, right in local)
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [[left, right] for _, left, right in merges]


def _post_processor(added: list[dict], roles: dict[str, int], add_bos: bool, add_eos: bool) -> dict:
    """TemplateProcessing adding bos before / eos after each sequence as the file's add_*_token flags ask."""
    content = {a["id"]: a["content"] for a in added}
    bos = [content[roles["bos"]]] if add_bos and roles.get("bos") in content else []
    eos = [content[roles["eos"]]] if add_eos and roles.get("eos") in content else []

    def around(seq: str, type_id: int) -> list[dict]:
        return ([{"SpecialToken": {"id": t, "type_id": type_id}} for t in bos]
                + [{"Sequence": {"id": seq, "type_id": type_id}}]
                + [{"SpecialToken": {"id": t, "type_id": type_id}} for t in eos])
    ids = {content[i]: i for i in content}
    return {"type": "TemplateProcessing", "single": around("A", 0), "pair": around("A", 0) + around("B", 1),
            "special_tokens": {t: {"id": t, "ids": [ids[t]], "tokens": [t]} for t in bos + eos}}


SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                 "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p"}


def _sampling(f: GGUFFile) -> dict:
    """llama.cpp's recommended sampling (general.sampling.*) as generation_config.json fields."""
    out: dict[str, Any] = {}
    for key, field in SAMPLING_KEYS.items():
        value = f.metadata.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[field] = value
    if out:
        out["do_sample"] = out.get("temperature", 1.0) > 0
    return out
