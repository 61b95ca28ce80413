"""Built-in chat templates for tokenizers trained here: `chatml`, `llama3` and `plain`.

Each is a Jinja template in the Hugging Face convention whose assistant text sits in {% generation %}
blocks (so the assistant mask comes from the template itself) and the special tokens it writes. Adding
one to a tokenizer folder adds those tokens to the tokenizer (their ids after the existing vocabulary) and
writes `chat_template.jinja` beside tokenizer.json; the caller resizes a model's embedding for the new ids:

    new_ids = install_chat_template("runs/x/tokenizer", "chatml")    # e.g. [4096, 4097]
    tok, new_ids = add_chat_tokens(tok, "llama3")                    # in memory, nothing written

    chatml   <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n       (Qwen, OpenAI's ChatML)
    llama3   <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\nHi<|eot_id|>...       (Meta Llama 3)
    plain    User:\\nHi\\n\\nAssistant:\\nHello<|endoftext|>\\n\\n   (no new tokens but the end-of-text one)
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archlab.errors import UserError
from archlab.tokenizer.chat import TEMPLATE_FILE

__all__ = ["ChatFormat", "CHAT_FORMATS", "chat_format", "add_chat_tokens", "install_chat_template"]

END_OF_TEXT = "<|endoftext|>"


@dataclass(frozen=True)
class ChatFormat:
    """A built-in template: `source(eot)` gives the Jinja text for a tokenizer whose end-of-text token is `eot`;
    `tokens` are the special tokens it writes (besides eot, for `plain`)."""
    name: str
    tokens: tuple[str, ...]
    source: Callable[[str], str]
    uses_eot: bool = False


def _chatml(eot: str) -> str:
    return ("{% for message in messages %}"
            "{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{% if message['role'] == 'assistant' %}"
            "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
            "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _llama3(eot: str) -> str:
    return ("{{ '<|begin_of_text|>' }}"
            "{% for message in messages %}"
            "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
            "{% if message['role'] == 'assistant' %}"
            "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
            "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def _plain(eot: str) -> str:
    # the answer follows a newline, so its first word tokenizes alike in training and after the generation prompt
    quoted = "'" + eot.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return ("{% for message in messages %}"
            "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
            "{% elif message['role'] == 'user' %}{{ 'User:\\n' + message['content'] + '\\n\\n' }}"
            "{% elif message['role'] == 'assistant' %}{{ 'Assistant:\\n' }}"
            "{% generation %}{{ message['content'] + " + quoted + " }}{% endgeneration %}{{ '\\n\\n' }}"
            "{% else %}{{ raise_exception('the plain chat template has no role ' + message['role']) }}{% endif %}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ 'Assistant:\\n' }}{% endif %}")


CHAT_FORMATS: dict[str, ChatFormat] = {f.name: f for f in (
    ChatFormat("chatml", ("<|im_start|>", "<|im_end|>"), _chatml),
    ChatFormat("llama3", ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), _llama3),
    ChatFormat("plain", (), _plain, uses_eot=True),
)}


def chat_format(name: str) -> ChatFormat:
    if name not in CHAT_FORMATS:
        raise UserError(f"unknown chat template {name!r}: choose one of {', '.join(CHAT_FORMATS)}")
    return CHAT_FORMATS[name]


def _eot(tokenizer: Any) -> str:
    """The tokenizer's end-of-text token as text (END_OF_TEXT when it has none: then it is added)."""
    eot_id = getattr(tokenizer, "eot_id", None)
    specials = {i: s for s, i in getattr(tokenizer, "special_to_id", {}).items()}
    return specials.get(eot_id, END_OF_TEXT) if eot_id is not None else END_OF_TEXT


def add_chat_tokens(tokenizer: Any, name: str) -> tuple[Any, list[int]]:
    """(tokenizer with the special tokens of chat format `name`, the ids that are new). Existing tokens keep
    their ids; new ones follow the vocabulary, in the format's order. The tokenizer given is not changed."""
    fmt = chat_format(name)
    wanted = list(fmt.tokens) + ([_eot(tokenizer)] if fmt.uses_eot else [])
    missing = [t for t in wanted if t not in getattr(tokenizer, "special_to_id", {})]
    if not missing:
        return tokenizer, []
    if getattr(tokenizer, "hf", None) is not None:       # an HFTokenizer: the tokenizers library adds them
        from tokenizers import Tokenizer

        from archlab.tokenizer.hf_wrapper import HFTokenizer
        inner = Tokenizer.from_str(tokenizer.hf.to_str())
        inner.add_special_tokens(missing)
        grown: Any = HFTokenizer(inner, tokenizer.config)
    else:
        from archlab.tokenizer.loading import _native_tokenizer
        data = tokenizer.to_json()
        start = tokenizer.vocab_size
        data["added_tokens"] = list(data.get("added_tokens") or []) + [
            {"id": start + k, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True} for k, t in enumerate(missing)]
        grown = _native_tokenizer(data, fast=getattr(tokenizer, "_fast_requested", True))
    new_ids = [grown.token_to_id(t) for t in missing]
    if any(i is None or i < tokenizer.vocab_size for i in new_ids):
        raise UserError(f"could not add the chat tokens {missing} to {tokenizer!r} as new ids")
    return grown, new_ids


def install_chat_template(folder: str | os.PathLike, name: str, *, overwrite: bool = False) -> list[int]:
    """Add chat format `name` to the tokenizer folder: its tokens into tokenizer.json, its template as
    chat_template.jinja. A folder that has a chat template already is refused unless `overwrite`.
    Returns the new token ids (the rows a model's embedding and head need)."""
    from archlab.tokenizer.chat import read_chat_templates
    from archlab.tokenizer.loading import load

    folder = Path(folder)
    fmt = chat_format(name)
    if not (folder / "tokenizer.json").is_file():
        raise UserError(f"{folder}: not a tokenizer folder (no tokenizer.json)")
    if read_chat_templates(folder) is not None and not overwrite:
        raise UserError(f"{folder} has a chat template already: pass overwrite=True (--overwrite) to replace it")
    tokenizer, new_ids = add_chat_tokens(load(folder), name)
    source = fmt.source(_eot(tokenizer))
    if new_ids:
        tokenizer.save(folder)
    tmp = folder / (TEMPLATE_FILE + ".tmp")
    tmp.write_text(source, encoding="utf-8")
    os.replace(tmp, folder / TEMPLATE_FILE)
    return new_ids
