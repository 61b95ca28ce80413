"""Scoring the reverse-a-word task (archlab.data.reverse_words) by greedy decoding on held-out words: through the
chat template (score_reversal: exact match with case ignored, and the share in the preferred lowercase), by sampling
(sample_reversal: pass@1 and pass@k of the exact lowercase answer, GRPO's reward) and in the pretraining text's own
format (score_plain). The post-training demo and the lab's `finetune` runs report these."""
from __future__ import annotations

from pathlib import Path

from archlab.data.reverse_words import WORD_LENGTH, plain_prompt, user_turn

__all__ = ["score_reversal", "sample_reversal", "pass_at_k", "score_plain"]


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


def pass_at_k(correct: list[list[bool]], k: int) -> float:
    """The unbiased pass@k of Chen et al. 2021 (Codex), averaged over problems: 1 - C(n - c, k) / C(n, k) for n
    samples of which c are right. Example: pass_at_k([[True, False], [False, False]], 1) -> 0.25"""
    from math import comb

    scores = []
    for row in correct:
        n, c = len(row), sum(row)
        if k > n:
            raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
        scores.append(1.0 - comb(n - c, k) / comb(n, k))
    return sum(scores) / len(scores)


def _until(row: list[int], end: list[int]) -> list[int]:
    """The tokens before the first end token."""
    return next((row[:i] for i, t in enumerate(row) if t in end), row)


def sample_reversal(folder: Path, words: list[str], *, samples: int = 8, temperature: float = 1.0,
                    seed: int = 0, ks: tuple[int, ...] | None = None) -> dict[str, float]:
    """`samples` sampled answers per word (at `temperature`, a seeded generator) of the chat model in `folder`,
    scored right when exactly the lowercase reversal (GRPO's exact-match reward): {"pass@1", f"pass@{samples}"},
    or f"pass@{k}" for each k in `ks` (every k <= samples; the pass@k curve of the lab's rlvr suite).
    Example: sample_reversal(Path("runs/p/grpo"), reverse_problems(200)) -> {"pass@1": 0.97, "pass@8": 1.0}"""
    import torch

    from archlab.generation.chat import end_of_turn_ids
    from archlab.generation.decode import generate
    from archlab.generation.stepper import vocab_limit
    from archlab.runs.model_folder import load_model_and_tokenizer
    from archlab.tokenizer.chat import ChatTokenizer, apply_chat_template

    model, tokenizer = load_model_and_tokenizer(folder)
    chat = ChatTokenizer.of(folder)
    prompts = apply_chat_template(chat, [user_turn(w) for w in words], add_generation_prompt=True)
    ids = torch.tensor(prompts).repeat_interleave(samples, dim=0)      # (n * samples, t): word i's rows together
    end = end_of_turn_ids(chat) + [tokenizer.eot_id]
    out = generate(model, ids, max_new_tokens=WORD_LENGTH + 1, eos_token_id=end, temperature=temperature,
                   generator=torch.Generator().manual_seed(seed),
                   vocab_limit=vocab_limit(model, tokenizer))                         # (n * samples, t + k)
    rows = [_until(row, end) for row in out[:, ids.shape[1]:].tolist()]
    right = [tokenizer.decode(row).strip() == words[j // samples][::-1] for j, row in enumerate(rows)]
    correct = [right[i * samples:(i + 1) * samples] for i in range(len(words))]
    return {f"pass@{k}": pass_at_k(correct, k) for k in (ks or (1, samples))}


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

