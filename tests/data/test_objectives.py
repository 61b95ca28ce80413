"""BERT's masking: 15% chosen, 80/10/10, specials never, whole words together, the same draw for the same step."""
import math

import pytest
import torch

from archlab.data.objectives import IGNORE, mask_tokens, masked_lm_for, word_starts
from archlab.errors import UserError
from archlab.tokenizer import train
from archlab.tokenizer.wordpiece import WordPieceTokenizer

V, MASK = 1000, 3


def _draw(n=400_000, **kw):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, V, (n // 1000, 1000), generator=gen)
    inputs, labels = mask_tokens(ids, mask_id=MASK, vocab_size=V, generator=gen, **kw)
    return ids, inputs, labels


def _within(value, p, n, sigmas=5):
    return abs(value - p) < sigmas * math.sqrt(p * (1 - p) / n)


def test_fifteen_percent_chosen_then_80_10_10():
    ids, inputs, labels = _draw()
    chosen = labels != IGNORE
    n, k = ids.numel(), int(chosen.sum())
    assert _within(k / n, 0.15, n)
    assert torch.equal(labels[chosen], ids[chosen])                     # labels are the original tokens
    masked = (inputs == MASK) & chosen
    kept = (inputs == ids) & chosen
    replaced = chosen & ~masked & ~kept
    assert _within(masked.sum().item() / k, 0.8, k)
    assert _within(kept.sum().item() / k, 0.1 + 0.1 / V, k)             # a random draw may hit the same id
    assert _within(replaced.sum().item() / k, 0.1 - 0.1 / V, k)
    assert torch.equal(inputs[~chosen], ids[~chosen])                   # unchosen slots are untouched
    # random replacements are spread over the vocabulary, not one id
    assert inputs[replaced].unique().numel() > 0.5 * V


def test_special_tokens_are_never_chosen_nor_drawn_as_replacements():
    special = torch.zeros(V, dtype=torch.bool)
    special[:10] = True
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 20, (200, 500), generator=gen)               # half of them special
    inputs, labels = mask_tokens(ids, mask_id=MASK, vocab_size=V, generator=gen, special=special)
    assert not (labels[special[ids]] != IGNORE).any()
    chosen = labels != IGNORE
    replaced = chosen & (inputs != MASK) & (inputs != ids)
    assert replaced.any() and not special[inputs[replaced]].any()


def test_whole_word_masking_takes_every_piece_of_a_chosen_word():
    starts = torch.zeros(V, dtype=torch.bool)
    starts[: V // 2] = True                                             # ids < 500 begin a word
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (100, 400), generator=gen)
    _, labels = mask_tokens(ids, mask_id=MASK, vocab_size=V, generator=gen, starts=starts)
    word = starts[ids].long().cumsum(-1)
    chosen = labels != IGNORE
    for row in range(ids.shape[0]):
        for w in word[row].unique().tolist():
            if w == 0:
                continue
            in_word = chosen[row][word[row] == w]
            assert bool(in_word.all()) or not bool(in_word.any())       # all of a word, or none of it
    words = (word > 0) & starts[ids]
    chosen_words = (chosen & words).sum().item() / words.sum().item()
    assert _within(chosen_words, 0.15, words.sum().item())


def test_the_same_step_masks_the_same_way_and_another_step_differently():
    special = torch.zeros(V, dtype=torch.bool)
    from archlab.data.objectives import MaskedLM
    objective = MaskedLM(MASK, V, special, seed=7)
    x = torch.randint(10, V, (4, 64))
    a, b = objective.batch(x, step=5), objective.batch(x, step=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(objective.batch(x, step=6)[1], a[1])
    assert not torch.equal(objective.batch(x, step=5, micro=1)[1], a[1])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("mlm") / "text.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 50 + "unbelievably unremarkable words\n")
    return path


def test_wordpiece_word_starts_follow_the_continuation_prefix(corpus):
    tok = train([corpus], 560, ["<|endoftext|>", "[MASK]"], kind="wordpiece")
    assert isinstance(tok, WordPieceTokenizer)
    starts = word_starts(tok, tok.vocab_size + 4)
    for i, piece in enumerate(tok.tokens):
        assert bool(starts[i]) == (not (piece.startswith("##") and len(piece) > 2)), piece
    assert starts[tok.vocab_size:].all()
    objective = masked_lm_for(tok, tok.vocab_size, whole_word=True)
    assert objective.mask_id == tok.token_to_id("[MASK]") and objective.special[objective.mask_id]


def test_byte_bpe_word_starts_are_pieces_with_a_leading_space(corpus):
    tok = train([corpus], 300, ["<|endoftext|>", "[MASK]"], kind="bpe")
    starts = word_starts(tok, tok.vocab_size)
    for i in range(tok.vocab_size):
        if i in (tok.token_to_id("<|endoftext|>"), tok.token_to_id("[MASK]")):
            assert starts[i]
        else:
            assert bool(starts[i]) == (tok.id_to_token(i)[:1] in (b" ", b"\n", b"\t")), tok.id_to_token(i)


def test_a_tokenizer_without_a_mask_token_is_one_line_naming_the_fix(corpus):
    tok = train([corpus], 300, ["<|endoftext|>"], kind="bpe")
    with pytest.raises(UserError, match=r"\[MASK\].*--special-tokens"):
        masked_lm_for(tok, tok.vocab_size)
