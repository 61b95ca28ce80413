"""Chat templates: the one place a conversation becomes text and token ids (training data, `chat`, the server).

A chat template is Jinja, as in the Hugging Face convention: the tokenizer folder's `chat_template.jinja`
(plus named ones in `additional_chat_templates/NAME.jinja`), else `chat_template` in tokenizer_config.json
(a string, or a list of {"name", "template"}). It renders in a sandboxed environment in a worker process
(chat_sandbox.py: the environment transformers uses, a memory and an output limit there; chat_render.py:
the time limit), so a template that raises, loops or floods its output costs one line of error and nothing
else:

    ids = apply_chat_template("runs/x/tokenizer", [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    out = apply_chat_template(folder, messages, return_dict=True, return_assistant_tokens_mask=True)
    out["input_ids"], out["assistant_masks"]        # 1 on the tokens inside {% generation %} blocks

`apply_chat_template` follows `transformers`' signature and gives the text, ids and assistant mask that
`AutoTokenizer.from_pretrained(folder).apply_chat_template(...)` gives on the same folder. Lower-level:
`render_chat(template, messages, ...)` -> `Rendered(text, spans)` and `token_mask(tokenizer, text, spans)`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from archlab.errors import read_json_object
from archlab.tokenizer.chat_render import (
    ChatTemplateError,
    ChatTemplateTimeout,
    NoChatTemplate,
    Rendered,
    RenderJob,
    RenderLimits,
    has_generation_blocks,
    render_chat,
    render_many,
)

__all__ = ["ChatTemplateError", "NoChatTemplate", "ChatTemplateTimeout", "RenderLimits", "Rendered", "RenderJob",
           "ChatTokenizer",
           "render_chat", "render_many", "token_mask",
           "apply_chat_template", "read_chat_templates", "read_special_tokens", "has_generation_blocks",
           "TEMPLATE_FILE", "TEMPLATE_DIR", "SPECIAL_TOKEN_ROLES"]

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# ---- template and special tokens of a folder ----------------------------------------------------------------
def read_chat_templates(folder: str | os.PathLike) -> str | dict[str, str] | None:
    """The folder's chat template(s) as transformers reads them: chat_template.jinja and
    additional_chat_templates/*.jinja (one string when only the first exists, else {name: source} with
    "default" for the file) take priority over tokenizer_config.json's `chat_template` (a string, or a list
    of {"name", "template"} read as a dict). None when the folder has none."""
    folder = Path(folder)
    found: dict[str, str] = {}
    if (folder / TEMPLATE_FILE).is_file():
        found["default"] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / TEMPLATE_DIR).is_dir():
        for file in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
            found[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if found:
        return found["default"] if list(found) == ["default"] else found
    value = _config(folder).get("chat_template")
    if isinstance(value, list):
        try:
            return {str(t["name"]): str(t["template"]) for t in value}
        except (TypeError, KeyError) as exc:
            raise ChatTemplateError(f"{folder / CONFIG_FILE}: chat_template as a list needs "
                                    f"{{'name', 'template'}} entries ({exc!r} is missing)") from None
    return value if isinstance(value, str) else None


def read_special_tokens(folder: str | os.PathLike) -> dict[str, str]:
    """{role: token} for SPECIAL_TOKEN_ROLES from tokenizer_config.json (a token is a string or an
    AddedToken dict); without an `added_tokens_decoder` there, special_tokens_map.json's roles win, as in
    transformers. These are the variables a template reads as bos_token, eos_token, ... A folder with
    tokenizer.json alone (a tokenizer trained here) takes the roles its export will name (tokenizer/roles.py)."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() and (folder / "tokenizer.json").is_file():
        from archlab.tokenizer.roles import added_specials, special_roles
        roles = special_roles(added_specials(_json_object(folder / "tokenizer.json")))
        return {role: roles[role] for role in SPECIAL_TOKEN_ROLES if role in roles}
    config = _config(folder)
    roles = {role: _content(config.get(role)) for role in SPECIAL_TOKEN_ROLES}
    legacy = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        mapping = _json_object(legacy)
        roles.update({role: _content(mapping[role]) for role in SPECIAL_TOKEN_ROLES if role in mapping})
    return {role: token for role, token in roles.items() if isinstance(token, str)}


def _content(value: Any) -> Any:
    return value.get("content") if isinstance(value, dict) else value


def _config(folder: Path) -> dict:
    file = folder / CONFIG_FILE
    return _json_object(file) if file.is_file() else {}


def _json_object(file: Path) -> dict:
    return read_json_object(file, ChatTemplateError)


@dataclass
class ChatTokenizer:
    """A tokenizer with its chat template(s) and the special tokens templates read (bos_token, eos_token, ...)."""
    tokenizer: Any
    templates: str | dict[str, str] | None = None
    special: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, source: Any) -> ChatTokenizer:
        """From a ChatTokenizer, a tokenizer folder (or a run folder: its tokenizer/), or a tokenizer object (an
        HFTokenizer brings the template of the tokenizer_config.json it was loaded with; an archlab tokenizer
        brings no template (pass chat_template=) and the roles of its special tokens, as its folder would)."""
        if isinstance(source, ChatTokenizer):
            return source
        if isinstance(source, (str, os.PathLike)):
            from archlab.tokenizer.loading import load
            folder = Path(source)
            if not (folder / "tokenizer.json").is_file() and (folder / "tokenizer" / "tokenizer.json").is_file():
                folder = folder / "tokenizer"          # a run folder keeps its tokenizer there
            if not (folder / "tokenizer.json").is_file():
                raise ChatTemplateError(f"{folder}: not a tokenizer folder (no tokenizer.json)")
            return cls(load(folder), read_chat_templates(folder), read_special_tokens(folder))
        config = getattr(source, "config", None)
        if isinstance(config, dict):
            templates = config.get("chat_template")
            if isinstance(templates, list):
                templates = {str(t.get("name")): str(t.get("template")) for t in templates if isinstance(t, dict)}
            special = {r: _content(config.get(r)) for r in SPECIAL_TOKEN_ROLES}
            special = {r: t for r, t in special.items() if isinstance(t, str)}
            return cls(source, templates if isinstance(templates, (str, dict)) else None, special)
        from archlab.tokenizer.roles import special_roles
        roles = special_roles(list(getattr(source, "special_tokens", None) or []))
        return cls(source, None, {role: roles[role] for role in SPECIAL_TOKEN_ROLES if role in roles})

    def template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template source to use, by transformers' rules: a name among several templates (else
        "tool_use" when tools are given, else "default"), or a source passed in, or the one template."""
        if isinstance(self.templates, dict):
            if chat_template is not None:
                return self.templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in self.templates:
                return self.templates["tool_use"]
            if "default" in self.templates:
                return self.templates["default"]
            raise ChatTemplateError(f"this tokenizer has several chat templates and no default: pass "
                                    f"chat_template= one of {sorted(self.templates)}")
        if chat_template is not None:
            return chat_template
        if self.templates is None:
            raise NoChatTemplate("this tokenizer has no chat template (chat_template.jinja or tokenizer_config.json "
                                    "chat_template): add one (archlab.tokenizer.chat_builtin) or pass chat_template=")
        return self.templates

    def template_token_ids(self, chat_template: str | None = None) -> list[int]:
        """Ids of the special tokens the template writes, sorted: those whose text the source holds (ChatML's
        `<|im_start|>`, `<|im_end|>`) and those it reads by role (`{{ bos_token }}`). Read off the source, so a
        branch no probe conversation takes (a system turn, tools) counts too."""
        source = self.template(chat_template)
        specials: dict[str, int] = getattr(self.tokenizer, "special_to_id", None) or {}
        written = {text for text in specials if text and text in source}
        written |= {text for role, text in self.special.items() if re.search(rf"\b{role}\b", source)}
        return sorted({specials[text] for text in written if text in specials})


# ---- token ids and the assistant mask -----------------------------------------------------------------------
def token_mask(tokenizer: Any, text: str, spans: tuple[tuple[int, int], ...] | list) -> tuple[list[int], list[int]]:
    """(ids of `text`, mask): mask[i] = 1 where token i overlaps a character span, as transformers marks
    assistant tokens. An HF tokenizer gives character offsets; archlab's byte-level tokenizers give byte
    offsets, and the spans are moved to bytes (the same overlaps: spans start and end on characters)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        encoding = hf.encode(_clean(text), add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)                  # (n, 2)
        return list(encoding.ids), _overlaps(offsets[:, 0], offsets[:, 1], spans)
    ids = tokenizer.encode(text)
    clean = _clean(text)
    table = getattr(tokenizer, "id_to_bytes", None)
    if table is not None:                           # archlab decodes by concatenating token bytes
        lengths = np.fromiter((len(table[i]) for i in ids), dtype=np.int64, count=len(ids))
    else:
        lengths = np.fromiter((len(tokenizer.token_bytes(i)) for i in ids), dtype=np.int64, count=len(ids))
    ends = np.cumsum(lengths)                                                                  # (n,) byte offsets
    byte_spans = [(len(clean[:a].encode("utf-8")), len(clean[:b].encode("utf-8"))) for a, b in spans]
    return ids, _overlaps(ends - lengths, ends, byte_spans)


def _clean(text: str) -> str:
    from archlab.tokenizer.base import clean_surrogates
    return clean_surrogates(text)


def _overlaps(starts: np.ndarray, ends: np.ndarray, spans) -> list[int]:
    """1 for each token [starts[i], ends[i]) that overlaps a span, as transformers' one pass decides it: the
    span of token i is the first one ending after the token starts (spans in order), and the token is marked
    when it ends after that span starts."""
    if not spans or len(starts) == 0:
        return [0] * len(starts)
    span_starts, span_ends = (np.asarray(column, dtype=np.int64) for column in zip(*spans))
    if np.any(np.diff(span_ends) < 0):             # out-of-order spans: transformers' pass, step by step
        return _overlaps_in_order(starts.tolist(), ends.tolist(), spans)
    k = np.searchsorted(span_ends, starts, side="right")                                       # (n,)
    inside = k < len(span_ends)
    mask = np.zeros(len(starts), dtype=np.int64)
    mask[inside] = ends[inside] > span_starts[k[inside]]
    return mask.tolist()


def _overlaps_in_order(starts: list[int], ends: list[int], spans) -> list[int]:
    mask, k = [0] * len(starts), 0
    for i, (start, end) in enumerate(zip(starts, ends)):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask


# ---- transformers' apply_chat_template ----------------------------------------------------------------------
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _normalized(messages: Any) -> list[dict]:
    """Messages as transformers hands them to a template: keys whose value is None dropped, reasoning
    copied under `thinking` and `reasoning_content`."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("a conversation must be a non-empty list of messages")
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise ChatTemplateError(f"a chat message must be an object with role and content, not {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _render_one(template: str, chat: list[dict], *, continue_final_message: bool | str, **kw: Any) -> Rendered:
    if not continue_final_message:
        return render_chat(template, chat, **kw)
    key = continue_final_message if isinstance(continue_final_message, str) else "content"
    final = chat[-1].get(key)
    if not isinstance(final, str):
        raise ChatTemplateError(f'continue_final_message: the final message has no text "{key}" to continue')
    chat = [*chat[:-1], {**chat[-1], key: final + _CONTINUE_TAG}]
    text = render_chat(template, chat, **kw).text
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ChatTemplateError("continue_final_message: the template drops part of the final message")
    at = text.rindex(_CONTINUE_TAG.strip())
    return Rendered(text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip())


def apply_chat_template(folder_or_tokenizer: Any, conversation: list, tools: list | None = None,
                        documents: list | None = None, chat_template: str | None = None,
                        add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                        tokenize: bool = True, return_dict: bool = False, return_assistant_tokens_mask: bool = False,
                        limits: RenderLimits | None = None, **kwargs: Any) -> Any:
    """A conversation (or a list of them) -> text (tokenize=False), ids, or {"input_ids", "attention_mask"
    [, "assistant_masks"]} (return_dict=True), as transformers' `apply_chat_template`. The template sees
    messages, tools, documents, add_generation_prompt, the folder's special tokens and `kwargs`.
    Example: apply_chat_template("tok/", [{"role": "user", "content": "2+2?"}], add_generation_prompt=True)"""
    chat_tok = ChatTokenizer.of(folder_or_tokenizer)
    return_dict = return_dict and tokenize
    if return_assistant_tokens_mask and not return_dict:
        raise ChatTemplateError("return_assistant_tokens_mask=True needs return_dict=True and tokenize=True")
    if continue_final_message and (add_generation_prompt or return_assistant_tokens_mask):
        raise ChatTemplateError("continue_final_message cannot go with add_generation_prompt or "
                                "return_assistant_tokens_mask")
    template = chat_tok.template(chat_template, tools)
    batched = isinstance(conversation, (list, tuple)) and bool(conversation) and isinstance(conversation[0],
                                                                                          (list, tuple))
    chats = [_normalized(c) for c in (conversation if batched else [conversation])]
    variables = {**chat_tok.special, **kwargs}
    rendered = [_render_one(template, chat, continue_final_message=continue_final_message, tools=tools,
                            documents=documents, add_generation_prompt=add_generation_prompt,
                            track_generation=return_assistant_tokens_mask, limits=limits, **variables)
                for chat in chats]
    if not tokenize:
        outs: list[Any] = [r.text for r in rendered]
    else:
        encoded = [token_mask(chat_tok.tokenizer, r.text, r.spans) for r in rendered]
        if not return_dict:
            outs = [ids for ids, _ in encoded]
        else:
            fields = {"input_ids": [ids for ids, _ in encoded],
                      "attention_mask": [[1] * len(ids) for ids, _ in encoded]}
            if return_assistant_tokens_mask:
                fields["assistant_masks"] = [mask for _, mask in encoded]
            return fields if batched else {k: v[0] for k, v in fields.items()}
    return outs if batched else outs[0]
