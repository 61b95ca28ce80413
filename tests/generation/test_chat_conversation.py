"""archlab.generation.chat: the end-of-turn token of each built-in template, and a Conversation's history
(rendered with the generation prompt, oldest turns dropped past the context, a turn that cannot fit refused)."""
from __future__ import annotations

import pytest

from archlab.generation.chat import ContextFull, Conversation, end_of_turn_ids
from archlab.tokenizer import Tokenizer
from archlab.tokenizer.chat import ChatTokenizer, apply_chat_template
from archlab.tokenizer.chat_builtin import CHAT_FORMATS, add_chat_tokens


def chat_tokenizer(name: str | None, template: str | None = None) -> ChatTokenizer:
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    if name is not None:
        tok, _ = add_chat_tokens(tok, name)
        template = CHAT_FORMATS[name].source("<|endoftext|>")
    return ChatTokenizer(tok, template)


@pytest.mark.parametrize("name,token", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>"),
                                        ("plain", "<|endoftext|>")])
def test_each_builtin_template_ends_a_turn_with_its_token(name, token):
    chat = chat_tokenizer(name)
    assert end_of_turn_ids(chat) == [chat.tokenizer.token_to_id(token)]


def test_a_template_with_no_special_token_after_the_answer_has_none():
    chat = chat_tokenizer(None, "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}")
    assert end_of_turn_ids(chat) == []


def test_a_conversation_drops_whole_turns_oldest_first_and_keeps_the_system_message():
    chat = chat_tokenizer("chatml")
    convo = Conversation(chat, context=120, reserve=20, system="S")
    for i in range(4):
        convo.prompt(f"question {i}")
        convo.answer(f"answer {i}")
    ids = convo.prompt("last")
    text = apply_chat_template(chat, [{"role": "system", "content": "S"}, *convo.messages], tokenize=False,
                               add_generation_prompt=True)
    assert ids == chat.tokenizer.encode(text) and len(ids) <= 100
    assert convo.messages[0]["role"] == "user" and convo.messages[-1] == {"role": "user", "content": "last"}
    assert convo.dropped % 2 == 0 and convo.dropped >= 2
    last = convo.dropped // 2 - 1                 # the newest pair dropped would not have fitted
    kept_one_more = [{"role": "user", "content": f"question {last}"},
                     {"role": "assistant", "content": f"answer {last}"}]
    more = apply_chat_template(chat, [{"role": "system", "content": "S"}, *kept_one_more, *convo.messages],
                               tokenize=False, add_generation_prompt=True)
    assert len(chat.tokenizer.encode(more)) > 100


def test_a_turn_that_cannot_fit_is_refused_and_the_history_is_kept():
    convo = Conversation(chat_tokenizer("chatml"), context=64, reserve=8)
    convo.prompt("hi")
    convo.answer("yo")
    with pytest.raises(ContextFull, match="does not fit the model's context of 64"):
        convo.prompt("x" * 60)
    assert convo.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    convo.reset()
    assert convo.messages == []
