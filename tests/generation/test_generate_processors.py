"""archlab.generation.processors equal transformers' LogitsProcessors of the same names on random
scores and sequences (small vocabularies, so that n-grams and banned sequences recur), and
generation_config.json is read as transformers means it: what is applied, what is warned about."""
import json
import warnings

import pytest
import torch

from archlab.config import ConfigError
from archlab.generation import GenerationConfig, processors, read_generation_config

lp = pytest.importorskip("transformers.generation.logits_process")

V = 12


def _case(seed, rows=6, length=10, vocab=V, ids=5):
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, ids, (rows, length), generator=gen)       # few distinct ids: repeats
    scores = torch.randn(rows, vocab, generator=gen) * 3
    return seqs, scores


def _same(ours, theirs):
    assert ours.shape == theirs.shape
    assert torch.equal(torch.isneginf(ours), torch.isneginf(theirs))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 41])
@pytest.mark.parametrize("seed", range(3))
def test_no_repeat_ngram(n, seed):
    seqs, scores = _case(seed, length=40, ids=3)
    theirs = lp.NoRepeatNGramLogitsProcessor(n)(seqs, scores.clone())
    _same(processors.no_repeat_ngram(seqs, scores.clone(), n), theirs)
    assert n > 40 or bool(torch.isneginf(theirs).any())            # the case bans something


@pytest.mark.parametrize("words", [[[3]], [[1, 2]], [[4, 4, 1], [2], [0, 3]], [[5], [1] * 12]])
@pytest.mark.parametrize("eos", [None, 5, [2, 5]])
@pytest.mark.parametrize("seed", range(3))
def test_bad_words(words, eos, seed):
    seqs, scores = _case(seed)
    theirs = lp.NoBadWordsLogitsProcessor(words, eos_token_id=eos)(seqs, scores.clone())
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    cfg = GenerationConfig(bad_words_ids=words)
    procs = processors.build(cfg, eos=eos_ids, prompt_width=4, max_length=20)
    _same(processors.apply(procs, seqs, scores.clone()), theirs)


@pytest.mark.parametrize("length", [1, 2, 5])
def test_forced_bos(length):
    seqs, scores = _case(0, length=length)
    _same(processors.forced_bos(seqs, scores.clone(), 7), lp.ForcedBOSTokenLogitsProcessor(7)(seqs, scores.clone()))


@pytest.mark.parametrize("length", [8, 9, 10])
@pytest.mark.parametrize("eos", [3, [3, 6]])
def test_forced_eos(length, eos):
    seqs, scores = _case(1, length=length)
    tokens = [eos] if isinstance(eos, int) else eos
    _same(processors.forced_eos(seqs, scores.clone(), tokens, max_length=10),
          lp.ForcedEOSTokenLogitsProcessor(10, eos)(seqs, scores.clone()))


@pytest.mark.parametrize("length", [3, 6, 9])
def test_min_length_and_min_new_tokens(length):
    seqs, scores = _case(2, length=length)
    _same(processors.min_length(seqs, scores.clone(), 6, [1, 4]),
          lp.MinLengthLogitsProcessor(6, [1, 4])(seqs, scores.clone()))
    _same(processors.min_new_tokens(seqs, scores.clone(), 3, 4, [1, 4]),
          lp.MinNewTokensLengthLogitsProcessor(4, 3, [1, 4])(seqs, scores.clone()))


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
@pytest.mark.parametrize("padding", [None, [0, 2, 5, 0, 1, 9]])
def test_repetition_penalty(penalty, padding):
    seqs, scores = _case(3)
    skip = None if padding is None else torch.tensor(padding)
    theirs = lp.RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=skip)(seqs, scores.clone())
    _same(processors.repetition_penalty(seqs, scores.clone(), penalty, skip), theirs)


def test_processors_compose_in_transformers_order():
    seqs, scores = _case(4)
    cfg = GenerationConfig(repetition_penalty=1.4, no_repeat_ngram_size=2, bad_words_ids=[[1, 2], [4]],
                           min_new_tokens=3, forced_eos_token_id=3)
    eos = [3]
    theirs = scores.clone()
    for proc in (lp.RepetitionPenaltyLogitsProcessor(1.4), lp.NoRepeatNGramLogitsProcessor(2),
                 lp.NoBadWordsLogitsProcessor([[1, 2], [4]], eos), lp.MinNewTokensLengthLogitsProcessor(8, 3, eos),
                 lp.ForcedEOSTokenLogitsProcessor(11, 3)):
        theirs = proc(seqs, theirs)
    ours = processors.apply(processors.build(cfg, eos=eos, prompt_width=8, max_length=11), seqs, scores.clone())
    _same(ours, theirs)
    assert [p.func.__name__ for p in processors.build(cfg, eos=eos, prompt_width=8, max_length=11)] == [
        "repetition_penalty", "no_repeat_ngram", "bad_words", "min_new_tokens", "forced_eos"]


def test_padding_ids_outside_the_vocabulary_are_ignored():
    seqs = torch.tensor([[-1, -1, 2, 3, 2], [1, 2, 3, 1, 2]])
    out = processors.no_repeat_ngram(seqs, torch.zeros(2, 4), 2)
    assert torch.isneginf(out).tolist() == [[False, False, False, True], [False, False, False, True]]
    assert torch.isfinite(processors.repetition_penalty(seqs, torch.ones(2, 4), 2.0)).all()


# ---- generation_config.json ------------------------------------------------------------------------------
def _read(tmp_path, **fields):
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    return read_generation_config(tmp_path)


def test_reading_applies_the_named_fields(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = _read(tmp_path, eos_token_id=[2, 7], pad_token_id=0, no_repeat_ngram_size=3, bad_words_ids=[[5], [6, 8]],
                    forced_bos_token_id=1, forced_eos_token_id=2, max_new_tokens=9, num_beams=4, length_penalty=0.6,
                    early_stopping="never", repetition_penalty=1.1, transformers_version="5.24.0",
                    _from_model_config=True, bos_token_id=1, use_cache=True, temperature=0.7, top_p=0.9)
    assert cfg.eos_token_id == (2, 7) and cfg.pad_token_id == 0 and cfg.forced_eos_token_id == (2,)
    assert cfg.bad_words_ids == ((5,), (6, 8)) and cfg.no_repeat_ngram_size == 3 and cfg.forced_bos_token_id == 1
    assert (cfg.max_new_tokens, cfg.num_beams, cfg.length_penalty, cfg.early_stopping) == (9, 4, 0.6, "never")
    assert cfg.temperature is None and cfg.top_p is None        # without do_sample transformers ignores them


def test_do_sample_takes_transformers_defaults(tmp_path):
    cfg = _read(tmp_path, do_sample=True, top_p=0.9)
    assert (cfg.temperature, cfg.top_k, cfg.top_p) == (1.0, 50, 0.9)
    cfg = _read(tmp_path, do_sample=True, temperature=0.6, top_k=0)
    assert (cfg.temperature, cfg.top_k) == (0.6, None)            # top_k 0: no top-k filter


def test_fields_archlab_does_not_apply_are_named_in_one_warning(tmp_path):
    with pytest.warns(UserWarning, match=r"suppress_tokens=\[1, 2\].*typical_p=0.5") as caught:
        cfg = _read(tmp_path, suppress_tokens=[1, 2], typical_p=0.5, num_beam_groups=1, diversity_penalty=0.0,
                    output_scores=True, eos_token_id=3)
    assert len(caught) == 1 and "num_beam_groups" not in str(caught[0].message)
    assert cfg.eos_token_id == (3,)


@pytest.mark.parametrize("fields,message", [
    ({"bad_words_ids": [5, 6]}, "bad_words_ids"),
    ({"eos_token_id": "2"}, "eos_token_id"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"num_beams": 0}, "num_beams"),
])
def test_malformed_fields_are_a_config_error_naming_them(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        _read(tmp_path, **fields)


def test_no_file_reads_as_none_and_bad_json_is_an_error(tmp_path):
    assert read_generation_config(tmp_path) is None
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_generation_config(tmp_path)


def test_merged_lets_arguments_win():
    cfg = GenerationConfig(eos_token_id=3, no_repeat_ngram_size=2, max_new_tokens=5)
    out = cfg.merged(eos_token_id=[], max_new_tokens=None, num_beams=2)
    assert (out.eos_token_id, out.no_repeat_ngram_size, out.max_new_tokens, out.num_beams) == ((), 2, 5, 2)
    with pytest.raises(TypeError, match="not a generation setting"):
        cfg.merged(beams=3)
