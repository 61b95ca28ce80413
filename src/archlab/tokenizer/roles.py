"""The roles of a tokenizer's special tokens (bos, eos, pad, ...) when no tokenizer_config.json names them.

A tokenizer archlab trained has a tokenizer.json alone; its exported tokenizer_config.json
(archlab.interop.tokenizer_files) and the variables its chat templates read (archlab.tokenizer.chat) both take
the roles from its special tokens by this one table, so a template renders alike here and after export.
"""
from __future__ import annotations

__all__ = ["ROLES", "special_roles", "added_specials"]

ROLES = {   # role -> the special tokens that fill it, the first one present wins
    "bos_token": ("<s>", "<bos>", "<|begin_of_text|>", "<|endoftext|>"),
    "eos_token": ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"),    # BERT's [SEP] is no eos in transformers
    "unk_token": ("[UNK]", "<unk>"),
    "sep_token": ("[SEP]",),
    "pad_token": ("[PAD]", "<pad>", "<|endoftext|>"),
    "cls_token": ("[CLS]",),
    "mask_token": ("[MASK]", "<mask>"),
}


def special_roles(specials: list[str]) -> dict:
    """{role: token} for a tokenizer's special tokens (ROLES), the rest as additional_special_tokens.
    Example: special_roles(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])["cls_token"] == "[CLS]" """
    present = set(specials)
    roles: dict = {}
    for role, candidates in ROLES.items():
        token = next((t for t in candidates if t in present), None)
        if token is not None:
            roles[role] = token
    rest = [t for t in specials if t not in roles.values()]
    if rest:
        roles["additional_special_tokens"] = rest
    return roles


def added_specials(data: dict) -> list[str]:
    """The special tokens of a parsed tokenizer.json, in id order."""
    return [t["content"] for t in sorted(data.get("added_tokens") or [], key=lambda t: t["id"])
            if t.get("special", True)]
