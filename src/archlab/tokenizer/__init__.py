"""Tokenizers trained from scratch: byte-level BPE (GPT-2 rules, compiled merge loop with a pure-Python
fallback), WordPiece and Unigram, all saved as an HF-style tokenizer.json folder.

    vocab, merges = train_bpe("corpus.txt", 10_000, ["<|endoftext|>"])
    tok = Tokenizer(vocab, merges, ["<|endoftext|>"])
    tok.save("out/tok"); tok = load("out/tok")       # also loads HF byte-level BPE tokenizer.json folders

Chat templates (chat.py: `apply_chat_template`, rendered in a sandboxed worker process) and the built-in
formats chatml, llama3 and plain (chat_builtin.py) live beside them.

Any other HF tokenizer.json (SentencePiece-style: Llama 2, Gemma, Mistral) loads as an `HFTokenizer`
wrapping the `tokenizers` library, when it is installed (archlab[hf]). Loading lives in loading.py alone.
"""
from archlab.tokenizer.base import BaseTokenizer
from archlab.tokenizer.bpe import Tokenizer
from archlab.tokenizer.bpe_train import bpe_from_counts, c_backend_available, train_bpe
from archlab.tokenizer.chat import apply_chat_template
from archlab.tokenizer.hf_wrapper import HFTokenizer
from archlab.tokenizer.loading import load
from archlab.tokenizer.pretokenize import GPT2_PATTERN
from archlab.tokenizer.unigram import UnigramTokenizer, train_unigram
from archlab.tokenizer.wordpiece import WordPieceTokenizer, train_wordpiece

load_tokenizer = from_pretrained = load   # older names of the one loader (loading.py)

__all__ = [
    "BaseTokenizer", "GPT2_PATTERN", "HFTokenizer", "Tokenizer", "UnigramTokenizer", "WordPieceTokenizer",
    "apply_chat_template",
    "bpe_from_counts", "c_backend_available", "from_pretrained", "load", "load_tokenizer",
    "train", "train_bpe", "train_unigram", "train_wordpiece",
]


def train(input_path, vocab_size: int, special_tokens=(), *, kind: str = "bpe", num_workers=None,
          progress=None) -> BaseTokenizer:
    """Train a tokenizer of `kind` ("bpe", "wordpiece", "unigram") and return it ready to encode/save.
    A special token must be a non-empty string of more than one byte: a single byte is already a token of
    every byte-level vocabulary, and tokenizer.json cannot hold the same string twice."""
    special = list(special_tokens)
    for token in special:
        if len(token.encode("utf-8")) < 2:
            raise ValueError(f"special token {token!r} must be at least two bytes long (a single byte is already "
                             "a token of the byte-level vocabulary): use e.g. '<|...|>'")
    if kind == "bpe":
        vocab, merges = train_bpe(input_path, vocab_size, special, num_workers=num_workers, progress=progress)
        return Tokenizer(vocab, merges, special)
    if kind == "wordpiece":
        return train_wordpiece(input_path, vocab_size, special, num_workers=num_workers, progress=progress)
    if kind == "unigram":
        return train_unigram(input_path, vocab_size, special, num_workers=num_workers, progress=progress)
    raise ValueError(f"kind={kind!r} must be 'bpe', 'wordpiece' or 'unigram'")
