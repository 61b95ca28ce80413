"""The files beside an exported tokenizer.json that tell transformers what its special tokens are for:
tokenizer_config.json, special_tokens_map.json, generation_config.json (and the ids in config.json).

Two sources, one rule each:
  * an HF tokenizer (the run's tokenizer/ holds the tokenizer_config.json that `convert --from-hf` copied):
    its files are kept as they are. They name roles (BERT's [CLS]/[SEP]/[MASK]/[PAD], T5's </s>, <pad> and
    <extra_id_N> sentinels as additional_special_tokens, BART's <s>/</s>/<mask>) and settings (do_lower_case,
    extra_ids, model_max_length) that archlab's tokenizers do not model; the post-processor ([CLS] $A [SEP],
    T5's trailing </s>, RoBERTa's <s> $A </s>) lives in tokenizer.json, copied as is.
  * a tokenizer archlab trained (tokenizer.json alone): the roles come from its own special tokens (ROLES,
    archlab.tokenizer.roles), so a tokenizer with [CLS]/[SEP]/[MASK]/[PAD] exports them; archlab's
    `<|endoftext|>` ends a document and serves as bos, eos and pad where nothing else fills those roles.
    Specials without a role become additional_special_tokens. Its chat template (chat_template.jinja,
    archlab.tokenizer.chat_builtin) goes into tokenizer_config.json's `chat_template` as well.
config.json gains bos/eos/pad ids only where the family wrote none: a family's own ids can carry meaning
(RoBERTa numbers its positions from pad_token_id + 1, T5 and BART start the decoder from theirs).
"""
from __future__ import annotations

import json
from pathlib import Path

from archlab.tokenizer.chat import read_chat_templates
from archlab.tokenizer.roles import ROLES, added_specials, special_roles

__all__ = ["ROLES", "special_roles", "write_tokenizer_files"]

_IDS = ("bos", "eos", "pad")        # roles whose ids config.json and generation_config.json carry


def write_tokenizer_files(folder: str | Path, max_length: int, *, decoder_start_token_id: int | None = None) -> dict:
    """Beside folder/tokenizer.json: tokenizer_config.json and special_tokens_map.json unless the folder holds
    an HF tokenizer_config.json already (kept), generation_config.json unless present (its bos/eos/pad ids, and
    decoder_start_token_id for an encoder-decoder), and the missing bos/eos/pad ids in config.json. Returns the
    roles {role: token}."""
    folder = Path(folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        roles = _roles_of(json.loads(config_file.read_text()))
    else:
        roles = special_roles(added_specials(data))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                  "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False, **roles}
        template = read_chat_templates(folder)      # chat_template.jinja of a tokenizer given a chat format here
        if isinstance(template, str):
            config["chat_template"] = template
        _write(config_file, config)
        _write(folder / "special_tokens_map.json", roles)
    ids = {f"{role}_token_id": _token_id(data, roles.get(f"{role}_token")) for role in _IDS}
    ids = {k: v for k, v in ids.items() if v is not None}
    if not (folder / "generation_config.json").is_file():
        start = {} if decoder_start_token_id is None else {"decoder_start_token_id": decoder_start_token_id}
        _write(folder / "generation_config.json", {"_from_model_config": False, **ids, **start})
    model_config = folder / "config.json"
    if ids and model_config.is_file():
        hf = json.loads(model_config.read_text())
        missing = {k: v for k, v in ids.items() if hf.get(k) is None}
        if missing:
            model_config.write_text(json.dumps({**hf, **missing}, indent=2, sort_keys=True) + "\n")
    return roles


def _roles_of(config: dict) -> dict:
    """The roles a tokenizer_config.json names (a token is a string or an AddedToken dict {"content": ...})."""
    def text(value):
        return value.get("content") if isinstance(value, dict) else value
    return {role: text(config[role]) for role in ROLES if isinstance(text(config.get(role)), str)}


def _token_id(data: dict, token: str | None) -> int | None:
    if token is None:
        return None
    for added in data.get("added_tokens") or []:
        if added.get("content") == token:
            return int(added["id"])
    vocab = data.get("model", {}).get("vocab")
    if isinstance(vocab, dict):                   # BPE, WordPiece: {token: id}
        return vocab.get(token)
    if isinstance(vocab, list):                   # Unigram: [[piece, score], ...], the id is the index
        return next((i for i, entry in enumerate(vocab) if entry and entry[0] == token), None)
    return None


def _write(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n")
