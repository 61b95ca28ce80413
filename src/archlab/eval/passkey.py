"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", arXiv 2305.16300): a random number hidden at
a chosen depth of repeated filler text, the prompt ending in a request to repeat it; the model passes a trial
when its greedy continuation starts with the number. Accuracy by prompt length and depth shows how far into
its context a model can still retrieve (context extension: Chen et al. 2023, Peng et al. 2023 report it).

The prompt, in the paper's words, built from token pieces so its length in tokens is exact up to one filler
sentence:
    PREAMBLE  FILLER x k1  NEEDLE(key)  FILLER x k2  QUESTION      k1 / (k1 + k2) ~ depth

    table = passkey_accuracy(model, tok, lengths=[256, 1024], depths=[0.0, 0.5, 1.0], trials=5)
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["PasskeyPrompt", "passkey_prompt", "greedy_continuation", "passkey_trial", "passkey_accuracy"]

PREAMBLE = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyPrompt:
    ids: list[int]       # the prompt's tokens
    key: str             # the digits to repeat
    depth: float         # where the needle sits: filler sentences before it / all filler sentences


def passkey_prompt(tokenizer, n_tokens: int, depth: float, key: str) -> PasskeyPrompt:
    """A prompt of at most `n_tokens` tokens (as many filler sentences as fit) with `key` at `depth` (0: right
    after the preamble, 1: right before the question). Example: passkey_prompt(tok, 512, 0.5, "40917").ids"""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} must be in [0, 1]")
    head, filler, needle, question = (tokenizer.encode(t) for t in
                                      (PREAMBLE, FILLER, NEEDLE.format(key=key), QUESTION))
    room = n_tokens - len(head) - len(needle) - len(question)
    if room < 0:
        raise ValueError(f"{n_tokens} tokens cannot hold the passkey prompt "
                         f"(at least {n_tokens - room} without filler)")
    n_filler = room // len(filler)
    before = round(depth * n_filler)
    ids = head + filler * before + needle + filler * (n_filler - before) + question
    return PasskeyPrompt(ids, key, before / n_filler if n_filler else depth)


@torch.no_grad()
def greedy_continuation(model: nn.Module, ids: list[int], n_new: int, device: str | torch.device = "cpu") -> list[int]:
    """`n_new` greedy tokens after `ids` over a KV cache. Unlike archlab.generate this does not stop at the
    model's max_seq_len: passkey accuracy past the trained context (a RoPE model before extension) is the point."""
    from archlab.nn.kv_cache import KVCache

    cache, out = KVCache(), []
    x = torch.tensor([ids], dtype=torch.long, device=device)                  # (1, t)
    for _ in range(n_new):
        token = model(x, cache=cache)[:, -1].argmax(-1, keepdim=True)         # (1, 1)
        out.append(int(token))
        x = token
    return out


def passkey_trial(model: nn.Module, tokenizer, prompt: PasskeyPrompt, device: str | torch.device = "cpu") -> bool:
    """True when the greedy continuation of the prompt starts with the key (spaces ignored)."""
    n_new = len(tokenizer.encode(" " + prompt.key)) + 1
    return tokenizer.decode(greedy_continuation(model, prompt.ids, n_new, device)).strip().startswith(prompt.key)


def passkey_accuracy(model: nn.Module, tokenizer, *, lengths: Sequence[int], depths: Sequence[float],
                     trials: int = 5, digits: int = 5, seed: int = 0, device: str | torch.device = "cpu",
                     progress: bool = False) -> dict[int, dict[float, float]]:
    """{length: {depth: share of `trials` random `digits`-digit keys repeated}}; the same keys at every cell.
    Example: passkey_accuracy(model, tok, lengths=[128, 512], depths=[0.0, 0.5, 1.0], trials=4)[512][0.5]"""
    rng = random.Random(seed)
    keys = [str(rng.randrange(10 ** (digits - 1), 10 ** digits)) for _ in range(trials)]
    cells = [(n, d) for n in lengths for d in depths]
    if progress:
        from archlab.progress import progress_bar
        cells = progress_bar(cells, desc="passkey", leave=False)
    was_training = model.training
    model.eval()
    table: dict[int, dict[float, float]] = {n: {} for n in lengths}
    try:
        for n, d in cells:
            hits = sum(passkey_trial(model, tokenizer, passkey_prompt(tokenizer, n, d, k), device) for k in keys)
            table[n][d] = hits / trials
    finally:
        model.train(was_training)
    return table
