"""archlab.generate: cached decoding equals uncached for every switch and preset, left padding is
invisible, stopping rules, streaming, and the context-length error."""
import pytest
import torch
from variants import BASE, VARIANTS, variant

import archlab
from archlab import TransformerLM
from archlab.generation import stream

EXTRA = {  # switches whose interaction with the cache is worth its own case
    "alibi-window": {"position.kind": "alibi", "attention.window": 4},
    "t5-local-global": {"position.kind": "t5", "attention.window": 4, "attention.layer_pattern": "GLL"},
    "gqa-window-sinks": {"attention.n_kv_heads": 2, "attention.window": 5, "attention.learned_sinks": True},
    "sinusoidal-window": {"position.kind": "sinusoidal", "attention.window": 4},
}
ALL = {**VARIANTS, **EXTRA}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _config(name):
    if name in EXTRA:
        return BASE.with_overrides(EXTRA[name])
    return variant(name)


def _model(cfg, seed=0):
    # a larger init std than training's keeps random logits apart: no argmax near-ties in fp32
    model = TransformerLM(cfg.with_overrides({"init.std": 0.2, "seed": seed}))
    return model.eval()


def _presets():
    try:
        import archlab.models.presets as presets
        return [n for n in presets.names() if presets.get(n).arch == "decoder"]   # generation: decoders
    except ImportError:  # presets not available: the switch variants still cover every option
        return []


@pytest.mark.parametrize("name", sorted(ALL))
def test_cached_greedy_equals_uncached(name):
    """Past the sliding window too: 30 new tokens with windows of 3-5."""
    model = _model(_config(name))
    torch.manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (2, 6))
    cached = archlab.generate(model, prompt, max_new_tokens=30)
    uncached = archlab.generate(model, prompt, max_new_tokens=30, use_cache=False)
    assert cached.shape == (2, 36)
    assert torch.equal(cached[:, :6], prompt)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("name", sorted(ALL))
def test_left_padded_batch_equals_each_prompt_alone(name):
    model = _model(_config(name))
    torch.manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,)).tolist() for n in (3, 8, 5)]
    batch = archlab.generate(model, prompts, max_new_tokens=12)
    for row, prompt in zip(batch, prompts):
        alone = archlab.generate(model, prompt, max_new_tokens=12)
        assert torch.equal(row[-len(alone):], alone)


@pytest.mark.parametrize("name", _presets())
def test_preset_cached_equals_uncached_and_padding_invisible(name):
    import archlab.models.presets as presets
    cfg = presets.tiny(name)
    model = _model(cfg)
    torch.manual_seed(3)
    window = cfg.attention.window or 0
    new = min(max(12, window + 6), cfg.max_seq_len - 10)
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (4, 9)]
    batch = archlab.generate(model, prompts, max_new_tokens=new)
    uncached = archlab.generate(model, prompts, max_new_tokens=new, use_cache=False)
    assert torch.equal(batch, uncached)
    alone = archlab.generate(model, prompts[0], max_new_tokens=new)
    assert torch.equal(batch[0, -len(alone):], alone)


def test_prefill_logits_over_static_cache_match_full_forward():
    """Chunked prefill through the rolling buffer (chunks wrap the window) gives the full logits."""
    from archlab.nn.kv_cache import StaticKVCache
    model = _model(variant("local-global"))
    ids = torch.randint(0, 97, (2, 20))
    full = model(ids)
    cache = StaticKVCache(model.config, 2, 20)
    pieces = [model(ids[:, a:b], cache=cache) for a, b in ((0, 7), (7, 8), (8, 15), (15, 20))]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_stream_yields_the_tokens_generate_returns():
    model = _model(BASE)
    prompt = [5, 6, 7]
    full = archlab.generate(model, prompt, max_new_tokens=10)
    streamed = [int(t[0]) for t in stream(model, prompt, max_new_tokens=10)]
    assert streamed == full[3:].tolist()
    seen = []
    archlab.generate(model, prompt, max_new_tokens=10, callback=lambda t: seen.append(int(t[0])))
    assert seen == streamed


def test_eos_stops_a_row_and_pads_it_while_others_go_on():
    model = _model(BASE)
    a, b = [5, 6, 7], [9, 1, 2, 3]
    free_a = archlab.generate(model, a, max_new_tokens=10)[3:].tolist()
    eos = free_a[3]
    assert eos not in free_a[:3]
    free_b = archlab.generate(model, b, max_new_tokens=10)[4:].tolist()
    out = archlab.generate(model, [a, b], max_new_tokens=10, eos_token_id=eos, pad_token_id=-1)
    row_a = out[0, 4:].tolist()
    assert row_a[:4] == free_a[:4]                  # stops right after emitting EOS...
    assert set(row_a[4:]) <= {-1}                   # ...and is padded afterwards
    if eos not in free_b:
        assert out[1, 4:].tolist() == free_b[:out.shape[1] - 4]
    single = archlab.generate(model, a, max_new_tokens=10, eos_token_id=eos)
    assert single[3:].tolist() == free_a[:4]        # all rows done: generation ends early


class _CharTokenizer:
    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def test_stop_string_ends_generation_after_the_completing_token():
    model = _model(BASE)
    prompt = [5, 6, 7]
    free = archlab.generate(model, prompt, max_new_tokens=12)[3:].tolist()
    text = _CharTokenizer().decode(free)
    stop = text[4:6]
    first = text.index(stop)
    out = archlab.generate(model, prompt, max_new_tokens=12, stop_strings=[stop],
                           tokenizer=_CharTokenizer())
    assert out[3:].tolist() == free[:first + 2]


def test_prompt_longer_than_context_raises_clear_error():
    model = _model(BASE)  # max_seq_len 64
    with pytest.raises(ValueError, match="longer than the model's context max_seq_len=64"):
        archlab.generate(model, list(range(65)), max_new_tokens=1)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        archlab.generate(model, list(range(60)), max_new_tokens=10)


def test_bad_arguments_raise_before_decoding():
    model = _model(BASE)
    with pytest.raises(ValueError, match="top_p"):
        stream(model, [1, 2], top_p=1.5, temperature=1.0)
    with pytest.raises(ValueError, match="left padding"):
        archlab.generate(model, torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[1, 0, 1]]))
    with pytest.raises(ValueError, match="stop_strings needs a tokenizer"):
        archlab.generate(model, [1, 2], stop_strings=["x"])


def test_seed_makes_sampling_reproducible():
    model = _model(BASE)
    kw = dict(max_new_tokens=20, temperature=1.0, top_k=20)
    a = archlab.generate(model, [1, 2, 3], seed=7, **kw)
    b = archlab.generate(model, [1, 2, 3], seed=7, **kw)
    c = archlab.generate(model, [1, 2, 3], seed=8, **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_repetition_penalty_changes_greedy_choice_away_from_seen_tokens():
    model = _model(BASE)
    free = archlab.generate(model, [1, 2, 3], max_new_tokens=30)[3:].tolist()
    assert len(set(free)) < len(free)   # a random tiny model repeats itself greedily
    penal = archlab.generate(model, [1, 2, 3], max_new_tokens=30, repetition_penalty=1e6)[3:].tolist()
    assert len(set(penal + [1, 2, 3])) == len(penal) + 3   # with a huge penalty it never repeats
