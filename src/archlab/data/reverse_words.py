"""Reversing a five-letter word as a generated task (nothing downloaded): the text of the post-training demo
(archlab.demo.post_training) and of the lab's `finetune` suites (corpus "reverse-words"), and its held-out words.

    pretraining   plain-text documents `reverse abcde` / `edcba`, one per document (base_documents)
    SFT           chat examples `reverse abcde` -> `edcba` written by two annotators, one in lowercase and one
                  in capitals (write_task_data: SFT_FILE)
    DPO           pairs preferring the lowercase answer to the capitals (write_task_data: dpo.jsonl)
    GRPO          prompts `reverse abcde` with their answer `edcba`, the lowercase reversal, for an exact-match
                  reward (write_grpo_prompts: grpo.jsonl)

A word with crc32(word) % 10 == 0 never appears in any training line: the problems scored are drawn from those
(reverse_problems), so a model that memorised its training lines gains nothing. The scorers are in
archlab.eval.reverse_words; the settings the demo trains with in archlab.training.recipes.
"""
from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

__all__ = ["CORPUS", "SFT_FILE", "DPO_FILE", "INSTRUCTION", "TEMPLATE", "WORD_LENGTH", "SIZES", "GRPO_FILE",
           "reverse_problems", "write_grpo_prompts",
           "user_turn", "plain_prompt", "base_documents", "write_task_data", "prepare_base_data",
           "prepare_task_folder"]

WORD_LENGTH = 5
LETTERS = "abcdefghijklmnopqrstuvwxyz"
INSTRUCTION = "reverse "
TEMPLATE = "chatml"
CORPUS = "reverse-words"     # the name a lab sweep prepares this task's data under (archlab.lab.runner.ensure_data)
SFT_FILE = "sft.jsonl"
DPO_FILE = "dpo.jsonl"
GRPO_FILE = "grpo.jsonl"
# How much of each: base documents, SFT examples, DPO pairs, GRPO prompts, held-out words; "quick" for tests.
SIZES = {"full": {"base_documents": 40_000, "sft_examples": 24_000, "dpo_pairs": 4_000, "grpo_prompts": 2_000,
                  "test_words": 200},
         "quick": {"base_documents": 2_000, "sft_examples": 400, "dpo_pairs": 200, "grpo_prompts": 64,
                   "test_words": 40}}


def _held_out(word: str) -> bool:
    return zlib.crc32(word.encode()) % 10 == 0


def _words(rng: random.Random, held_out: bool):
    while True:
        word = "".join(rng.choice(LETTERS) for _ in range(WORD_LENGTH))
        if _held_out(word) == held_out:
            yield word


def reverse_problems(n: int, seed: int = 1234) -> list[str]:
    """`n` held-out words: no training line of any stage holds them. Example: reverse_problems(3) -> three
    five-letter words, the same on every call"""
    words = _words(random.Random(seed), held_out=True)
    return [next(words) for _ in range(n)]


def user_turn(word: str) -> list[dict]:
    """The task as a chat: user_turn("abcde") -> [{"role": "user", "content": "reverse abcde"}]"""
    return [{"role": "user", "content": INSTRUCTION + word}]


def _write_jsonl(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def write_task_data(out: Path, *, sft_examples: int, dpo_pairs: int, seed: int = 0) -> tuple[Path, Path]:
    """SFT_FILE (messages: the answer reversed, in lowercase or capitals by a coin) and DPO_FILE (prompt /
    chosen = lowercase / rejected = capitals) under `out`, training words only.
    Example: write_task_data(Path("d"), sft_examples=400, dpo_pairs=200) -> (d/sft.jsonl, d/dpo.jsonl)"""
    rng = random.Random(seed)
    words = _words(rng, held_out=False)
    sft = []
    for _ in range(sft_examples):
        word = next(words)
        answer = word[::-1] if rng.random() < 0.5 else word[::-1].upper()
        sft.append({"messages": user_turn(word) + [{"role": "assistant", "content": answer}]})
    pairs = []
    for _ in range(dpo_pairs):
        word = next(words)
        pairs.append({"prompt": user_turn(word), "chosen": [{"role": "assistant", "content": word[::-1]}],
                      "rejected": [{"role": "assistant", "content": word[::-1].upper()}]})
    _write_jsonl(out / SFT_FILE, sft)
    _write_jsonl(out / DPO_FILE, pairs)
    return out / SFT_FILE, out / DPO_FILE


def write_grpo_prompts(out: Path, n: int, seed: int = 0) -> Path:
    """GRPO_FILE under `out`: `n` prompt lines {"prompt": [the user's turn], "answer": the lowercase reversal}
    (archlab finetune --method grpo; its exact_match reward reads `answer`), training words only.
    Example: write_grpo_prompts(Path("d"), 64) -> d/grpo.jsonl"""
    words = _words(random.Random(seed + 2), held_out=False)
    lines = ({"prompt": user_turn(w), "answer": w[::-1]} for w in (next(words) for _ in range(n)))
    _write_jsonl(out / GRPO_FILE, lines)
    return out / GRPO_FILE


def plain_prompt(word: str) -> str:
    """The task as the pretraining text writes it: the instruction, a line break, then the answer."""
    return f"{INSTRUCTION}{word}\n"


def base_documents(n_docs: int, seed: int = 0) -> list[str]:
    """Pretraining text: one `reverse WORD` / reversal pair per document, lowercase, training words only.
    Example: base_documents(1)[0] -> "reverse abcde\\nedcba" (some training word)"""
    words = _words(random.Random(seed + 1), held_out=False)
    return [plain_prompt(w) + w[::-1] for w in (next(words) for _ in range(n_docs))]


def prepare_base_data(folder: Path, n_docs: int, progress: bool) -> int:
    """A byte-level tokenizer with ChatML's tokens and template (as base models ship theirs, untrained) and the
    base corpus prepared with it into `folder`; its vocabulary size. Example: prepare_base_data(Path("d"), 2_000,
    False) -> 259"""
    from archlab.data.prepare import prepare
    from archlab.tokenizer import Tokenizer
    from archlab.tokenizer.chat_builtin import add_chat_tokens, install_chat_template

    tokenizer, _ = add_chat_tokens(Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]), TEMPLATE)
    meta = prepare(base_documents(n_docs), tokenizer, folder, num_workers=0, progress=progress,
                   corpus_name="reverse-a-word documents")
    install_chat_template(Path(folder) / "tokenizer", TEMPLATE)     # the tokens are there: writes the template
    return int(meta["vocab_size"])


def prepare_task_folder(folder: Path, *, quick: bool = False, progress: bool = True) -> Path:
    """The first two stages' data in one folder, what a lab `finetune` run reads (archlab.lab.finetune): the base
    corpus prepared (meta.json, token shards, tokenizer/ with the ChatML template) and SFT_FILE, the SFT examples,
    at the demo's SIZES (`quick`: the test sizes). Example: prepare_task_folder(Path("d"), quick=True)"""
    folder = Path(folder)
    sizes = SIZES["quick" if quick else "full"]
    prepare_base_data(folder, sizes["base_documents"], progress)
    write_task_data(folder, sft_examples=sizes["sft_examples"], dpo_pairs=0)
    (folder / DPO_FILE).unlink()                                 # no preference stage in the lab
    return folder
