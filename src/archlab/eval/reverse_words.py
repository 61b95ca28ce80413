"""Scoring the reverse-a-word task (archlab.data.reverse_words) by greedy decoding on held-out words: through the
chat template (score_reversal: exact match with case ignored, and the share in the preferred lowercase) and in the
pretraining text's own format (score_plain). The post-training demo and the lab's `finetune` runs report these."""
from __future__ import annotations

from pathlib import Path

from archlab.data.reverse_words import WORD_LENGTH, plain_prompt, user_turn

__all__ = ["score_reversal", "score_plain"]


def score_reversal(folder: Path, words: list[str]) -> dict[str, float]:
    """Greedy answers of the model in `folder` (a run folder with a chat template) to `reverse WORD`:
    exact (the reversal, case ignored) and preferred (exactly the lowercase reversal).
    Example: score_reversal(Path("runs/demo-post-training/dpo"), reverse_problems(200)) -> {"exact": ..., ...}"""
    import torch

    from archlab.generation.chat import end_of_turn_ids
    from archlab.generation.decode import generate
    from archlab.runs.model_folder import load_model_and_tokenizer
    from archlab.tokenizer.chat import ChatTokenizer, apply_chat_template

    model, tokenizer = load_model_and_tokenizer(folder)
    chat = ChatTokenizer.of(folder)
    prompts = apply_chat_template(chat, [user_turn(w) for w in words], add_generation_prompt=True)
    ids = torch.tensor(prompts)                 # (n, t): every prompt has the same length (one word length)
    end = end_of_turn_ids(chat)
    out = generate(model, ids, max_new_tokens=WORD_LENGTH + 1, eos_token_id=end)     # (n, t + k)
    exact = preferred = 0
    for word, row in zip(words, out[:, ids.shape[1]:].tolist()):
        answer = tokenizer.decode([i for i in row if i not in end]).strip()
        exact += answer.lower() == word[::-1]
        preferred += answer == word[::-1]
    return {"exact": exact / len(words), "preferred": preferred / len(words)}


def score_plain(folder: Path, words: list[str]) -> float:
    """Greedy exact match of the model in `folder` on the task in the pretraining text's own format
    (`reverse WORD` and a line break, then the answer). Example: score_plain(Path("runs/p/base"), words) -> 1.0"""
    import torch

    from archlab.generation.decode import generate
    from archlab.runs.model_folder import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(folder)
    ids = torch.tensor([tokenizer.encode(plain_prompt(w)) for w in words])          # (n, t), one length
    out = generate(model, ids, max_new_tokens=WORD_LENGTH)                          # (n, t + 5)
    answers = [tokenizer.decode(row) for row in out[:, ids.shape[1]:].tolist()]
    return sum(a == w[::-1] for a, w in zip(answers, words)) / len(words)

