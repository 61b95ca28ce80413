"""GRPO on chat prompts: the built-in rewards read a conversational completion's text (TRL passes it as messages),
and a completion ends at the template's end of turn (what a chat model writes after its answer, ChatML's <|im_end|>)."""
from __future__ import annotations

import json

from archlab.data.prompts import load_prompts
from archlab.data.reverse_words import prepare_base_data
from archlab.training.methods import rewards
from archlab.training.methods.rollout import end_ids


def test_builtin_rewards_read_the_text_of_a_conversational_completion():
    exact = rewards.BUILTINS.get("exact_match")()
    as_messages = [[{"role": "assistant", "content": " olleh "}], [{"role": "assistant", "content": "OLLEH"}]]
    assert exact(["p", "p"], as_messages, answer=["olleh", "olleh"]) == [1.0, 0.0]
    assert exact(["p"], ["olleh\n"], answer=["olleh"]) == [1.0]                         # plain text as before
    fmt = rewards.BUILTINS.get("format")(format_regex=r"[a-z]+")
    assert fmt(["p", "p"], as_messages) == [1.0, 0.0]


def test_chat_prompts_stop_at_the_end_of_turn_and_text_prompts_at_end_of_text(tmp_path):
    prepare_base_data(tmp_path / "d", 20, False)
    tokenizer = tmp_path / "d" / "tokenizer"
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "reverse abc"}]}) + "\n")
    (tmp_path / "text.jsonl").write_text(json.dumps({"prompt": "reverse abc\n"}) + "\n")
    chat, text = load_prompts(tmp_path / "chat.jsonl", tokenizer), load_prompts(tmp_path / "text.jsonl", tokenizer)
    from archlab.tokenizer.loading import load

    tok = load(tokenizer)
    assert end_ids(text) == [tok.eot_id]
    assert end_ids(chat) == [tok.eot_id, tok.token_to_id("<|im_end|>")]
