"""Speculative decoding (archlab.generation.speculative): greedy decoding with any draft gives plain greedy's
tokens (batch 1 and left-padded batches, several families), sampling draws from the target's distribution
(chi-square against the exact law), prompt lookup equals transformers' PromptLookupCandidateGenerator, the KV
cache crop equals never having written the dropped tokens, and bad arguments are refused."""
import copy

import numpy as np
import pytest
import torch

import archlab
from archlab import TransformerLM
from archlab.generation import NgramDraft, PromptLookupDraft, SpeculativeStats
from archlab.generation.drafts import NgramIndex, lookup
from archlab.nn.kv_cache import KVCache, StaticKVCache

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

FAMILIES = ["llama3-8b", "gpt2", "gemma2-2b", "mistral-7b"]   # RoPE + GQA; learned positions; softcaps + windows


def _model(name: str, seed: int = 0) -> TransformerLM:
    cfg = archlab.presets.tiny(name, vocab_size=128, window=6)
    # a larger init std keeps random logits apart: no argmax near-ties in fp32
    return TransformerLM(cfg.with_overrides({"init.std": 0.2, "seed": seed})).eval()


def _perturbed(model: TransformerLM, scale: float, seed: int = 1) -> TransformerLM:
    """The model with noise on every weight: a draft that agrees often but not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return draft


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Rows that repeat themselves (so prompt lookup and the n-gram draft find matches), of different lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in (9, 5, 7):
        part = torch.randint(0, vocab, (n,), generator=g).tolist()
        rows.append(part + part + part[:3])
    return rows


def _drafts(model):
    return {"prompt_lookup": "prompt_lookup", "ngram": "ngram", "self": model,
            "perturbed": _perturbed(model, 0.3), "other": _model("llama3-8b", seed=5)}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_every_draft_equals_plain_greedy(family):
    model = _model(family)
    rows = _prompts(128)
    for batch in ([rows[0]], rows):                          # batch 1; three rows, left-padded
        plain = archlab.generate(model, batch, max_new_tokens=24)
        for name, draft in _drafts(model).items():
            if name == "other" and family == "gpt2":
                continue
            for k in (1, 3, "auto"):
                stats = SpeculativeStats()
                out = archlab.generate(model, batch, max_new_tokens=24, draft=draft, draft_tokens=k, stats=stats)
                assert torch.equal(out, plain), (family, name, k, len(batch))
                assert stats.new_tokens == 24 and stats.target_forwards == 1 + stats.rounds
                if name == "self":            # a draft that is the target is always right
                    assert stats.alpha == 1.0 and stats.rounds < 24


def test_partial_acceptance_takes_the_batch_minimum():
    """Rows accept runs of different lengths; the batch keeps the shortest and every row stays exact, so a batch
    gets fewer tokens per round than its rows alone."""
    model = _model("llama3-8b")
    draft = _perturbed(model, 0.02)
    rows = _prompts(128, seed=3)
    batch = SpeculativeStats()
    out = archlab.generate(model, rows, max_new_tokens=30, draft=draft, draft_tokens=4, stats=batch)
    assert torch.equal(out, archlab.generate(model, rows, max_new_tokens=30))
    assert 0.3 < batch.alpha < 0.95
    alone = SpeculativeStats()
    for row in rows:
        one = archlab.generate(model, row, max_new_tokens=30, draft=draft, draft_tokens=4, stats=alone)
        assert torch.equal(one, archlab.generate(model, row, max_new_tokens=30))
    assert alone.new_tokens == 90 and alone.prefills == 3
    assert batch.tokens_per_round < alone.tokens_per_round


def test_greedy_identity_with_processors_eos_and_uncached():
    model = _model("llama3-8b")
    rows = _prompts(128, seed=1)
    kw = dict(max_new_tokens=20, repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=4)
    plain = archlab.generate(model, rows, **kw)
    eos = int(plain[0, -15])              # a token the first row produces: it stops there
    plain_eos = archlab.generate(model, rows, eos_token_id=eos, pad_token_id=0, **kw)
    for draft in ("prompt_lookup", "ngram", _perturbed(model, 0.2)):
        assert torch.equal(archlab.generate(model, rows, draft=draft, draft_tokens=3, **kw), plain)
        assert torch.equal(archlab.generate(model, rows, draft=draft, draft_tokens=3, eos_token_id=eos,
                                            pad_token_id=0, **kw), plain_eos)
        assert torch.equal(archlab.generate(model, rows, draft=draft, draft_tokens=2, use_cache=False, **kw), plain)


def test_streamed_tokens_equal_generated():
    model = _model("gemma2-2b")
    row = _prompts(128)[1]
    tokens = [int(t[0]) for t in archlab.generation.stream(model, row, 16, draft="prompt_lookup", draft_tokens=4)]
    assert tokens == archlab.generate(model, row, 16)[len(row):].tolist()


def test_self_draft_accepts_everything_and_the_schedule_grows():
    model = _model("llama3-8b")
    stats = SpeculativeStats()
    archlab.generate(model, _prompts(128)[0], 40, draft=model, draft_tokens="auto", stats=stats)
    assert stats.alpha == 1.0
    assert stats.draft_lengths[:3] == [5, 7, 9]                 # transformers' heuristic: +2 when all accepted
    assert stats.tokens_per_round == pytest.approx(stats.theory)  # alpha = 1: k + 1 per round, as predicted


def test_prompt_lookup_equals_transformers():
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    g = torch.Generator().manual_seed(0)
    for trial in range(100):
        n = int(torch.randint(2, 30, (1,), generator=g))
        row = torch.randint(0, 4 + trial % 6, (n,), generator=g)    # small vocabularies: many matches
        k, ngram = 1 + trial % 7, 1 + trial % 3
        ref = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=ngram, max_length=1000)
        cand, _ = ref.get_candidates(row[None])
        assert lookup(row.tolist(), k, ngram) == cand[0, n:].tolist(), (row.tolist(), k, ngram)
        cut = int(torch.randint(0, n, (1,), generator=g))     # the index a draft grows as tokens are accepted
        assert NgramIndex(ngram).extend(row[:cut].tolist()).extend(row[cut:].tolist()).propose(k) == \
            cand[0, n:].tolist()
    assert lookup([5, 6, 7, 8, 5, 6], 2) == [7, 8]
    assert lookup([5, 6, 7, 2, 8, 5, 6], 5, eos=(2,)) == [7]      # cut before an EOS token


def test_ngram_draft_proposes_kneser_ney_argmax():
    """Without its cache, the n-gram draft's greedy proposal is the most likely token of archlab's Kneser-Ney model
    of the prompt."""
    from archlab.eval.ngram import NgramCounts

    prompt = [3, 4, 5, 3, 4, 6, 3, 4, 5, 3, 4]
    draft = NgramDraft(order=3, cache_max=0)
    from archlab.generation.drafts import Setup
    draft.start(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.bool), Setup(16, 8, False))
    out = draft.propose(torch.tensor([prompt]), 3, lambda logits, seqs: (logits.argmax(-1), None))
    kn = NgramCounts(np.array(prompt), 16, 3).model(3)
    expect, history = [], list(prompt)
    for _ in range(3):
        expect.append(int(np.argmax(kn.distribution(history))))
        history.append(expect[-1])
    assert out.tokens[0].tolist() == expect


def _kn_greedy(data: list[int], row: list[int], vocab: int, n: int) -> list[int]:
    """n greedy tokens of archlab's KN model (order 3) counted on data + row, the reference for the draft's fallback."""
    from archlab.eval.ngram import NgramCounts

    kn = NgramCounts(np.array(data + row), vocab, 3).model(3)
    out, history = [], list(row)
    for _ in range(n):
        out.append(int(np.argmax(kn.distribution(history))))
        history.append(out[-1])
    return out


def _propose(draft: NgramDraft, row: list[int], k: int, vocab: int = 16) -> list[int]:
    from archlab.generation.drafts import Setup

    ids = torch.tensor([row])
    draft.start(ids, torch.ones_like(ids, dtype=torch.bool), Setup(vocab, 8, False))
    return draft.propose(ids, k, lambda logits, seqs: (logits.argmax(-1), None)).tokens[0].tolist()


def test_ngram_draft_prefers_the_rows_own_continuation_then_falls_back_to_kneser_ney():
    """The cache: where the row's last tokens occurred earlier in the row, what followed them is proposed even
    though the KN model (trained on data where 3 4 is followed by 9) says otherwise; the positions past the
    copied stretch are the KN model's greedy continuation."""
    data = [3, 4, 9, 1] * 20
    row = [1, 3, 4, 7, 2, 3, 4]
    assert _kn_greedy(data, row, 16, 1) == [9]                       # the KN model alone would draft 9
    out = _propose(NgramDraft(order=3, data=np.array(data)), row, 6)
    copied = [7, 2, 3, 4]                                            # what followed the earlier 3 4, to the row's end
    assert out == copied + _kn_greedy(data, row + copied, 16, 2)


def test_ngram_draft_falls_back_to_kneser_ney_below_the_cache_minimum():
    """No earlier occurrence of the row's last cache_min tokens: the proposal is the KN model's greedy continuation;
    a single recurring token counts only when cache_min is 1."""
    data = [3, 6, 9, 1] * 20
    row = [1, 2, 6, 8, 5, 3, 6]                                      # 6 recurs, 3 6 does not
    kn = _kn_greedy(data, row, 16, 4)
    assert kn[:2] != [8, 5]
    assert _propose(NgramDraft(order=3, data=np.array(data)), row, 4) == kn
    assert _propose(NgramDraft(order=3, data=np.array(data), cache_min=1), row, 2) == [8, 5]


def test_ngram_draft_with_training_data_keeps_plain_greedy_output():
    """The cache model over a KN model counted on (tiny) training data: plain greedy's tokens, batch 1 and a
    left-padded batch, the cache both used and not."""
    model = _model("llama3-8b")
    rows = _prompts(128)
    data = np.array(torch.randint(0, 128, (400,), generator=torch.Generator().manual_seed(3)).tolist() + rows[0] * 4)
    for batch in ([rows[0]], rows):
        plain = archlab.generate(model, batch, max_new_tokens=20)
        for draft in (NgramDraft(order=3, data=data), NgramDraft(order=3, data=data, cache_min=1),
                      NgramDraft(order=2, data=data, cache_max=0)):
            for k in (3, "auto"):
                stats = SpeculativeStats()
                out = archlab.generate(model, batch, max_new_tokens=20, draft=draft, draft_tokens=k, stats=stats)
                assert torch.equal(out, plain), (draft, k, len(batch))
                assert stats.new_tokens == 20


def test_ngram_draft_cache_bounds_are_checked():
    with pytest.raises(ValueError, match="cache_min=4 must be between 1 and cache_max=3"):
        _propose(NgramDraft(cache_min=4), [1, 2, 3], 2)


@pytest.mark.parametrize("cache_kind", ["static", "static-windowed", "concat"])
def test_cache_crop_equals_never_writing_the_dropped_tokens(cache_kind):
    model = _model("gemma2-2b" if cache_kind == "static-windowed" else "llama3-8b")
    cfg = model.config
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    junk = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))

    def cache():
        return KVCache() if cache_kind == "concat" else StaticKVCache(cfg, 2, 40, rolling=False)

    with torch.no_grad():
        fresh, cropped = cache(), cache()
        model(ids[:, :20], cache=fresh)
        ref = model(ids[:, 20:], cache=fresh)
        model(ids[:, :20], cache=cropped)
        model(junk, cache=cropped)                           # rejected drafts ...
        cropped.crop(20)                                     # ... rolled back
        assert len(cropped) == 20
        out = model(ids[:, 20:], cache=cropped)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_a_wrapped_rolling_buffer_refuses_to_crop():
    model = _model("gemma2-2b")                              # windows of 6: a rolling buffer of 6 slots
    cache = StaticKVCache(model.config, 1, 40)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long), cache=cache)
        cache.crop(3)                                        # not wrapped yet: fine
        model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="rolling=False"):
        cache.crop(5)
    with pytest.raises(ValueError, match="cannot crop"):
        StaticKVCache(model.config, 1, 10, rolling=False).crop(3)


def _exact_law(model, prompt: list[int], n: int, kw: dict) -> dict[tuple[int, ...], float]:
    """P(first n new tokens) under the target: the product of its processed next-token distributions."""
    from archlab.generation.sampling import SamplingParams, filter_logits

    params = SamplingParams(temperature=kw["temperature"], top_k=kw.get("top_k"), top_p=kw.get("top_p"))
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, p in law.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(seq)]))[:, -1]
            probs = filter_logits(logits, params).softmax(-1)[0].double()
            for tok in torch.nonzero(probs > 0)[:, 0].tolist():
                nxt[seq + (tok,)] = p * float(probs[tok])
        law = nxt
    return law


def _chi2_pvalue(counts: dict, law: dict, total: int) -> float:
    from scipy.stats import chi2
    cells, stat, rest_obs, rest_exp = 0, 0.0, 0, 0.0
    for seq, p in law.items():
        expected = p * total
        if expected < 5:                                     # small cells pooled
            rest_obs += counts.get(seq, 0)
            rest_exp += expected
            continue
        stat += (counts.get(seq, 0) - expected) ** 2 / expected
        cells += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        cells += 1
    return float(chi2.sf(stat, cells - 1))


@pytest.mark.slow
@pytest.mark.parametrize("draft_name", ["model", "prompt_lookup", "ngram"])
def test_sampling_draws_from_the_target_distribution(draft_name):
    """Chi-square over the first 3 new tokens (draft_tokens=1: an accepted draft, a residual draw after a rejection,
    and the extra draw after a fully accepted round all occur; batches of 3 rows advancing by their shortest run)
    against the target's exact law; the draft model's
    own law is rejected by the same test (the test has power)."""
    cfg = archlab.presets.tiny("llama3-8b", vocab_size=6, d_model=16).with_overrides({"init.std": 0.5, "seed": 0})
    target = TransformerLM(cfg).eval()
    draft = TransformerLM(cfg.with_overrides({"seed": 7})).eval()
    prompt = [1, 2, 3, 1, 2]
    kw = dict(temperature=0.9, top_k=5)
    law = _exact_law(target, prompt, 3, kw)
    counts: dict[tuple[int, ...], int] = {}
    trials, rows = 1500, 3           # rows of one batch are independent draws (their own random numbers)
    gen = torch.Generator().manual_seed(0)
    chosen = {"model": draft, "prompt_lookup": "prompt_lookup", "ngram": NgramDraft(order=2)}[draft_name]
    for _ in range(trials // rows):
        out = archlab.generate(target, [prompt] * rows, 3, draft=chosen, draft_tokens=1, generator=gen, **kw)
        for row in out[:, len(prompt):].tolist():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert _chi2_pvalue(counts, law, trials) > 1e-3
    if draft_name == "model":
        assert _chi2_pvalue(counts, _exact_law(draft, prompt, 3, kw), trials) < 1e-6


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_rule_keeps_the_target_distribution(one_hot):
    """Leviathan's rule on its own, 40,000 rows in one call: drafts drawn from q, accepted with min(1, p/q), else
    redrawn from norm(max(0, p - q)) (a one-hot q: p without the draft's token); the tokens follow p, not q."""
    from scipy.stats import chisquare

    from archlab.generation.sampling import SamplingParams
    from archlab.generation.speculative import Scorer, check

    v, n = 5, 40_000
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.tensor([1.5, 0.2, -0.5, 0.9, 0.0])
    draft_logits = torch.tensor([-0.5, 1.0, 0.8, 0.0, 0.3])
    scorer = Scorer(SamplingParams(temperature=1.0), [], gen)
    p, q = target_logits.softmax(-1), draft_logits.softmax(-1)
    drafts = torch.multinomial(q.expand(n, v), 1, replacement=True, generator=gen)           # (n, 1)
    if one_hot:
        drafts = torch.full((n, 1), 3)                     # prompt lookup: a fixed proposal
    logits = target_logits.expand(n, 2, v)                 # the same law at both positions
    probs = None if one_hot else q.expand(n, 1, v)
    m, tokens, accepted = check(scorer, logits, drafts, probs, torch.zeros(n, 1, dtype=torch.long),
                                torch.ones(n, dtype=torch.bool))
    assert m == 0 and tokens.shape == (n, 1)
    counts = torch.bincount(tokens[:, 0], minlength=v).double()
    assert chisquare(counts.numpy(), (p.double() * n).numpy()).pvalue > 1e-3
    assert chisquare(counts.numpy(), (q.double() * n).numpy()).pvalue < 1e-9    # the draft's own law is not it
    expected = (torch.minimum(p, q).sum() if not one_hot else p[3]).item()     # P(accept) = sum min(p, q)
    assert accepted.double().mean().item() == pytest.approx(expected, abs=0.01)


def test_bad_arguments_are_refused():
    model = _model("llama3-8b")
    row = _prompts(128)[0]
    other_vocab = TransformerLM(archlab.presets.tiny("llama3-8b", vocab_size=64)).eval()
    with pytest.raises(ValueError, match="vocabulary"):
        archlab.generate(model, row, 4, draft=other_vocab)
    for k in (0, -2):
        with pytest.raises(ValueError, match=">= 1"):
            archlab.generate(model, row, 4, draft="ngram", draft_tokens=k)
    with pytest.raises(ValueError, match="context"):
        archlab.generate(model, row, 4, draft="ngram", draft_tokens=model.config.max_seq_len)
    short = TransformerLM(archlab.presets.tiny("llama3-8b", vocab_size=128, max_seq_len=16)).eval()
    with pytest.raises(ValueError, match="draft model's context"):
        archlab.generate(model, row, 4, draft=short)
    with pytest.raises(ValueError, match="beam search"):
        archlab.generate(model, row, 4, draft="prompt_lookup", num_beams=2)
    with pytest.raises(ValueError, match="draft="):
        archlab.generate(model, row, 4, draft_tokens=3)
    with pytest.raises(ValueError, match="draft="):
        archlab.generate(model, row, 4, draft="medusa")
    with pytest.raises(ValueError, match="decoder-only"):
        archlab.generate(model, row, 4, draft="ngram", sink_window=8)
    assert PromptLookupDraft().max_ngram == 3


def test_an_int8_target_whose_kernel_quantizes_rows_together_is_refused(monkeypatch):
    """fbgemm quantizes a call's activations with one scale, so checking k drafts in one forward gave other tokens
    than plain greedy (7 prompts in 20 on a tiny LLaMA): refused. An int8 draft only proposes, and a kernel that
    keeps rows apart (the dequantize reference) checks exactly."""
    from archlab.nn import int8

    model = _model("llama3-8b")
    quantized = int8.quantize_int8(copy.deepcopy(model)).eval()
    row = _prompts(128)[0]
    if int8.KERNELS.get(int8.decode_kernel()).rows_together:
        for draft in ("prompt_lookup", model):
            with pytest.raises(ValueError, match="int8 layers quantize the activations"):
                archlab.generate(quantized, row, 8, draft=draft)
    plain = archlab.generate(model, row, max_new_tokens=16)
    assert torch.equal(archlab.generate(model, row, max_new_tokens=16, draft=quantized, draft_tokens=3), plain)
    monkeypatch.setattr(int8, "PREFERRED", ("dequantize",))
    plain8 = archlab.generate(quantized, row, max_new_tokens=16)
    for draft in ("prompt_lookup", model):
        assert torch.equal(archlab.generate(quantized, row, max_new_tokens=16, draft=draft, draft_tokens=3), plain8)
