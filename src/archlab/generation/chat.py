"""A conversation to decode: its history rendered through the model's chat template, fitted to the context,
and the tokens that end the assistant's turn. `archlab chat` and the server's /v1/chat/completions use it, so
a turn's prompt and its stopping tokens are the same wherever a model chats.

    convo = Conversation(ChatTokenizer.of("runs/x/tokenizer"), context=512, reserve=64, system="Be brief.")
    ids = convo.prompt("What is 2+2?")       # the whole history + this turn + the generation prompt, encoded
    ...decode ids, stopping at end_of_turn_ids(convo.chat) ...
    convo.answer("4")                         # the assistant's text joins the history

The prompt is the rendered text encoded as `archlab generate --prompt TEXT` encodes it (special tokens written
by the template become their ids), so a chat turn decodes exactly what `generate` decodes on that text.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from archlab.errors import UserError
from archlab.generation.config import GenerationConfig
from archlab.tokenizer.chat import ChatTemplateError, ChatTokenizer, apply_chat_template

__all__ = ["Conversation", "ContextFull", "end_of_turn_ids", "stopping_at"]

_PROBE = "\u2063archlab-probe\u2063"        # text no template changes, found again in the rendered output


class ContextFull(UserError):
    """One turn (with the system message and the tokens reserved for the answer) does not fit the context."""


def end_of_turn_ids(chat: ChatTokenizer) -> list[int]:
    """The special token(s) the template writes right after an assistant's text (ChatML's <|im_end|>,
    Llama 3's <|eot_id|>, an end-of-text token): decoding stops there. Found by rendering a two-message
    conversation whose answer is a probe string; [] when the template writes no special token after it."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = apply_chat_template(chat, messages, tokenize=False)
    except ChatTemplateError:        # a template that wants another shape of conversation: no probe
        return []
    at = text.find(_PROBE)
    if at < 0:
        return []
    after = text[at + len(_PROBE):].lstrip(" \n")
    specials: dict[str, int] = getattr(chat.tokenizer, "special_to_id", {}) or {}
    # the longest special token the text after the answer starts with (one token is an end of turn)
    found = max((s for s in specials if s and after.startswith(s)), key=len, default=None)
    return [specials[found]] if found is not None else []


def stopping_at(settings: GenerationConfig, end_ids) -> GenerationConfig:
    """`settings` whose EOS ids also hold `end_ids` (a template's end-of-turn tokens), each id once."""
    if not end_ids:
        return settings
    return settings.merged(eos_token_id=tuple(dict.fromkeys([*settings.eos, *end_ids])))


@dataclass
class Conversation:
    """A chat history (the system message, then user / assistant turns) and the prompt of its next answer.
    `context`: the model's max_seq_len; `reserve`: tokens kept free for the answer. A history past the context
    loses its oldest turns (the system message stays); `dropped` counts the messages dropped so far."""
    chat: ChatTokenizer
    context: int
    reserve: int
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    dropped: int = 0

    def reset(self) -> None:
        """Forget every turn (the system message stays)."""
        self.messages.clear()

    def render(self, messages: list[dict]) -> str:
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return apply_chat_template(self.chat, head + messages, tokenize=False, add_generation_prompt=True)

    def prompt(self, user: str) -> list[int]:
        """The ids of the history + `user`'s turn + the generation prompt, the oldest turns dropped until
        they fit `context - reserve`; ContextFull (history unchanged) when the turn alone does not fit."""
        budget = self.context - self.reserve
        turns = [*self.messages, {"role": "user", "content": user}]
        while True:
            ids = self.chat.tokenizer.encode(self.render(turns))
            if len(ids) <= budget:
                break
            if len(turns) == 1:
                raise ContextFull(f"this message makes a prompt of {len(ids)} tokens; with {self.reserve} tokens "
                                  f"for the answer it does not fit the model's context of {self.context} "
                                  "(a shorter message, or a smaller --max-new-tokens)")
            cut = _next_user(turns)
            turns = turns[cut:]
            self.dropped += cut
        self.messages[:] = turns
        return ids

    def answer(self, text: str) -> None:
        """The assistant's answer to the last user turn joins the history."""
        self.messages.append({"role": "assistant", "content": text})


def _next_user(turns: list[dict]) -> int:
    """How many messages to drop: the oldest user turn and everything up to the next user turn (its answer)."""
    for i in range(1, len(turns)):
        if turns[i].get("role") == "user":
            return i
    return len(turns) - 1
