"""Sampling filters keep the documented support and draw from the renormalized distribution;
beam search finds the best sequence where greedy does not (hand-made models, hand-computed
expectations)."""
import math

import pytest
import torch
from torch import nn

import archlab
from archlab.generation import SamplingParams, filter_logits, next_token
from archlab.generation.sampling import apply_repetition_penalty

PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
# chi-square critical values at p = 0.001 for df = 1..5 (standard tables)
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def _sample_counts(params, n=20_000, seed=0):
    logits = PROBS.log()[None].expand(n, -1)
    gen = torch.Generator().manual_seed(seed)
    tokens = next_token(logits, params, generator=gen)
    return torch.bincount(tokens, minlength=len(PROBS)).double()


def _chi2(counts, expected_probs):
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the filtered support"
    exp = expected_probs[support] * counts.sum()
    return float(((counts[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1


def _renorm(keep, probs=PROBS):
    p = torch.where(torch.tensor(keep).bool(), probs, torch.zeros_like(probs)).double()
    return p / p.sum()


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0), _renorm([1] * 6)),
    (SamplingParams(temperature=1.0, top_k=2), _renorm([1, 1, 0, 0, 0, 0])),
    # 0.40 + 0.25 = 0.65 < 0.7, so the nucleus needs the third token
    (SamplingParams(temperature=1.0, top_p=0.7), _renorm([1, 1, 1, 0, 0, 0])),
    (SamplingParams(temperature=1.0, top_p=0.65), _renorm([1, 1, 0, 0, 0, 0])),
    # min_p 0.3 x 0.40 = 0.12: tokens with p >= 0.12 stay
    (SamplingParams(temperature=1.0, min_p=0.3), _renorm([1, 1, 1, 0, 0, 0])),
    # temperature 2: p^(1/2) renormalized
    (SamplingParams(temperature=2.0), _renorm([1] * 6, PROBS.sqrt())),
    # order: temperature before top-p. At T=0.5 the probs become p^2/sum: 0.16, 0.0625, 0.0225 ...
    # normalized 0.6283, 0.2454, 0.0884 ...: top_p 0.8 keeps two tokens (0.6283 < 0.8 <= 0.8737)
    (SamplingParams(temperature=0.5, top_p=0.8), _renorm([1, 1, 0, 0, 0, 0], PROBS ** 2)),
    # top-k then top-p: top-3 renormalized (0.5, 0.3125, 0.1875); top_p 0.85 keeps all three
    (SamplingParams(temperature=1.0, top_k=3, top_p=0.85), _renorm([1, 1, 1, 0, 0, 0])),
])
def test_samples_follow_the_filtered_distribution(params, expected):
    counts = _sample_counts(params)
    stat, df = _chi2(counts, expected)
    assert stat < CHI2_CRIT[df], f"chi2={stat:.1f} with df={df}"


def test_filters_remove_exactly_the_documented_tokens():
    logits = PROBS.log()[None]
    kept = lambda p: torch.isfinite(filter_logits(logits, p))[0].tolist()  # noqa: E731
    assert kept(SamplingParams(temperature=1.0, top_k=1)) == [True] + [False] * 5
    assert kept(SamplingParams(temperature=1.0, top_p=0.01)) == [True] + [False] * 5  # top token stays
    assert kept(SamplingParams(temperature=1.0, top_p=1.0)) == [True] * 6
    assert kept(SamplingParams(temperature=1.0, min_p=0.0)) == [True] * 6
    assert kept(SamplingParams(temperature=1.0, min_p=0.5)) == [True, True, False, False, False, False]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, 1.0, -1.0, -3.0]])
    seen = torch.tensor([[True, False, True, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, 1.0, -2.0, -3.0]]


def test_greedy_is_argmax_and_ignores_filters():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 0.0, 4.0]])
    assert next_token(logits, SamplingParams(top_k=1, top_p=0.1)).tolist() == [1, 0]


class TableModel(nn.Module):
    """Next-token log-probabilities from the last token alone (a bigram table)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = nn.Parameter(table.log(), requires_grad=False)   # (v, v)

    def forward(self, input_ids, positions=None, cache=None):
        return self.table[input_ids]                                    # (b, t, v)


def _bigram_trap():
    """From BOS(0): A(1) 0.6, B(2) 0.4. After A: three tokens at 1/3. After B: C(3) 0.9.
    Greedy takes A then 1/3 (joint 0.2); the best 2-token sequence is B C (0.36)."""
    v = 6
    t = torch.full((v, v), 1e-6)
    t[0, 1], t[0, 2] = 0.6, 0.4
    t[1, 3], t[1, 4], t[1, 5] = 0.34, 0.33, 0.33
    t[2, 3] = 0.9
    t[2, 4] = 0.1
    t[3:, 5] = 1.0
    return TableModel(t / t.sum(-1, keepdim=True))


def _logprob(model, seq):
    table = model.table.detach()
    return sum(float(table[a, b]) for a, b in zip(seq[:-1], seq[1:]))


def test_beam_search_finds_the_best_sequence_greedy_misses():
    model = _bigram_trap()
    greedy = archlab.generate(model, [0], max_new_tokens=2, use_cache=False).tolist()
    beam = archlab.generate(model, [0], max_new_tokens=2, num_beams=2, length_penalty=0.0,
                            use_cache=False).tolist()
    assert greedy == [0, 1, 3]
    assert beam == [0, 2, 3]
    assert _logprob(model, beam) > _logprob(model, greedy)
    assert math.isclose(math.exp(_logprob(model, beam)), 0.36, rel_tol=1e-3)


def test_beam_search_stops_at_eos_and_pads():
    model = _bigram_trap()
    out = archlab.generate(model, [[0], [0]], max_new_tokens=4, num_beams=2, length_penalty=0.0,
                           eos_token_id=3, pad_token_id=-1, use_cache=False)
    assert out.tolist() == [[0, 2, 3], [0, 2, 3]]


def test_beam_search_cached_equals_uncached_on_a_transformer():
    from variants import variant
    model = archlab.TransformerLM(variant("local-global").with_overrides({"init.std": 0.2})).eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    a = archlab.generate(model, prompts, max_new_tokens=8, num_beams=3)
    b = archlab.generate(model, prompts, max_new_tokens=8, num_beams=3, use_cache=False)
    assert torch.equal(a, b)
    one = archlab.generate(model, prompts, max_new_tokens=8, num_beams=1)
    assert a.shape == one.shape


def test_sampled_tokens_stay_in_top_k_support_through_generate():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(8, 8), -1)
    model = TableModel(probs)
    prompts = [[i % 8] for i in range(64)]
    out = archlab.generate(model, prompts, max_new_tokens=6, temperature=1.0, top_k=2, seed=0,
                           use_cache=False)
    top2 = probs.topk(2, -1).indices
    for row in out.tolist():
        for prev, nxt in zip(row[:-1], row[1:]):
            assert nxt in top2[prev].tolist()


def _padded_model():
    """A model whose embedding (300 ids) is padded past a 257-id byte tokenizer, the padded rows winning."""
    from variants import BASE

    from archlab import TransformerLM
    model = TransformerLM(BASE.with_overrides({"vocab_size": 300, "bias.head": True})).eval()
    with torch.no_grad():
        model.lm_head.bias[257:] = 50.0                      # untrained padding rows that would win every pick
    return model


def test_vocab_limit_keeps_decoding_inside_the_tokenizers_vocabulary():
    from archlab.generation.stepper import vocab_limit
    from archlab.tokenizer import Tokenizer

    model = _padded_model()
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    limit = vocab_limit(model, tok)
    assert limit == 257 and vocab_limit(_padded_model(), None) is None
    prompt = torch.tensor([[72, 105], [33, 33]])
    free = archlab.generate(model, prompt, max_new_tokens=8)
    assert bool((free[:, 2:] >= 257).all())                 # without the limit the padding wins
    for kw in ({}, {"temperature": 5.0, "seed": 0}, {"num_beams": 3}):
        out = archlab.generate(model, prompt, max_new_tokens=8, vocab_limit=limit, **kw)
        assert bool((out[:, 2:] < 257).all()), kw
        tok.decode(out[0].tolist())                         # decodable


def test_the_server_never_samples_a_padded_id():
    pytest.importorskip("fastapi")
    from archlab.serve import CompletionRequest, Engine
    from archlab.tokenizer import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    engine = Engine(_padded_model(), tok, "padded")
    for temperature in (0.0, 2.0):
        deltas = list(engine.complete(CompletionRequest(prompt="Hi", max_tokens=6, temperature=temperature, seed=1)))
        assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 6   # no decode error
        text = "".join(d.text for d in deltas)
        assert all(t < 257 for t in tok.encode(text))
