"""archlab.generate equals transformers' generate token for token on tiny random HF models loaded
through archlab.interop: greedy and beam search (num_beams 3-4, length penalties, every
early_stopping mode, an EOS made likely so hypotheses finish early, several EOS ids, a left-padded
batch of two), Mistral's window shorter than prompt + generation, Gemma 2's soft-caps; and a folder's
generation_config.json (no_repeat_ngram_size, bad_words_ids, forced EOS, repetition penalty, beams)
read by archlab equals transformers reading the same file. Every setting is pinned on both sides."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import archlab  # noqa: E402
from archlab.generation import read_generation_config  # noqa: E402
from archlab.interop import load_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

EOS, PAD, NEW = 5, 3, 12
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False)
FAMILIES = {
    "llama": ("llama", TINY, 3.0),
    "gpt2": ("gpt2", dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), 3.0),
    "gemma2": ("gemma2", {**TINY, "head_dim": 24, "tie_word_embeddings": True, "query_pre_attn_scalar": 20,
                          "sliding_window": 5, "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0,
                          "initializer_range": 0.02}, 2.0),   # tied: larger weights only echo the input
    "mistral": ("mistral", {**TINY, "sliding_window": 5}, 3.0),   # 6 prompt + 12 new tokens: past the window
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """pair(name) -> (transformers model, archlab model) with the EOS row of the head scaled up, so that
    EOS wins at some steps (built once per module)."""
    built = {}

    def get(name):
        if name not in built:
            model_type, kwargs, boost = FAMILIES[name]
            torch.manual_seed(0)
            config = transformers.AutoConfig.for_model(model_type, **kwargs)
            hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
            with torch.no_grad():
                hf.get_output_embeddings().weight[EOS] *= boost
            hf.generation_config.eos_token_id = None     # every call names its EOS ids (or none)
            folder = tmp_path_factory.mktemp(name)
            hf.save_pretrained(folder)
            built[name] = (hf, load_hf(folder), folder)
        return built[name][:2]

    return get


def prompts(seed=1):
    """Two rows, the first left-padded by two slots (PAD ids there)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 128, (2, 6), generator=gen)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    return torch.where(mask.bool(), ids, PAD), mask


def theirs(hf, ids, mask, **kw):
    with torch.inference_mode():
        return hf.generate(ids, attention_mask=mask, do_sample=False, num_return_sequences=1, **kw)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_equals_transformers(pair, name):
    hf, ours = pair(name)
    ids, mask = prompts()
    kw = dict(max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    expected = theirs(hf, ids, mask, num_beams=1, **kw)
    got = archlab.generate(ours, ids, attention_mask=mask, **kw)
    assert torch.equal(got, expected)


BEAMS = [  # (num_beams, length_penalty, early_stopping)
    (3, 1.0, False), (4, 1.0, True), (3, 0.0, "never"), (4, 2.0, True), (3, 2.0, "never"), (4, -1.0, False),
]


@pytest.mark.parametrize("beams,length_penalty,early_stopping", BEAMS)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_beam_search_equals_transformers(pair, name, beams, length_penalty, early_stopping):
    hf, ours = pair(name)
    ids, mask = prompts()
    kw = dict(max_new_tokens=NEW, num_beams=beams, length_penalty=length_penalty, early_stopping=early_stopping,
              eos_token_id=EOS, pad_token_id=PAD)
    expected = theirs(hf, ids, mask, **kw)
    got = archlab.generate(ours, ids, attention_mask=mask, **kw)
    assert torch.equal(got, expected), (got[:, 6:].tolist(), expected[:, 6:].tolist())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_planted_eos_ends_beams_early(pair, name):
    """The beam cases above are only worth their name if hypotheses finish before the length limit."""
    hf, _ = pair(name)
    ids, mask = prompts()
    out = theirs(hf, ids, mask, max_new_tokens=NEW, num_beams=3, length_penalty=0.0, early_stopping=True,
                 eos_token_id=EOS, pad_token_id=PAD)
    assert out.shape[1] < 6 + NEW or bool((out[:, 6:-1] == EOS).any())


def test_beam_search_with_two_eos_ids_and_no_padding(pair):
    """Two EOS ids: transformers keeps (1 + 2) x num_beams continuations per step."""
    hf, ours = pair("llama")
    ids = prompts(seed=4)[0][1:].repeat(2, 1)
    ids[1, :2] = torch.tensor([40, 41])
    free = theirs(hf, ids, torch.ones_like(ids), max_new_tokens=NEW, num_beams=1, pad_token_id=PAD)
    second = int(free[0, 8])                          # a token greedy decoding reaches: likely in the beams
    for early in (False, True):
        kw = dict(max_new_tokens=NEW, num_beams=3, length_penalty=1.0, early_stopping=early,
                  eos_token_id=[EOS, second], pad_token_id=PAD)
        expected = theirs(hf, ids, torch.ones_like(ids), **kw)
        assert torch.equal(archlab.generate(ours, ids, **kw), expected)


def test_beam_search_uncached_equals_cached_with_processors(pair):
    _, ours = pair("mistral")
    ids, mask = prompts()
    kw = dict(max_new_tokens=NEW, num_beams=3, eos_token_id=EOS, pad_token_id=PAD, no_repeat_ngram_size=2,
              bad_words_ids=[[7], [9, 10]], repetition_penalty=1.3)
    assert torch.equal(archlab.generate(ours, ids, attention_mask=mask, **kw),
                       archlab.generate(ours, ids, attention_mask=mask, use_cache=False, **kw))


# ---- a folder's generation_config.json ---------------------------------------------------------------
def _with_generation_config(folder, **fields):
    """transformers' model and archlab's, both reading the folder's generation_config.json."""
    (folder / "generation_config.json").write_text(json.dumps(fields))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return hf, load_hf(folder), read_generation_config(folder)


@pytest.mark.parametrize("extra", [
    {},
    {"num_beams": 3, "length_penalty": 0.5, "early_stopping": True},
    {"repetition_penalty": 1.5, "forced_eos_token_id": 4},
    {"num_beams": 4, "repetition_penalty": 1.5, "forced_eos_token_id": 4, "min_new_tokens": 3},
])
def test_generation_config_json_applies_as_in_transformers(pair, tmp_path, extra):
    hf, _ = pair("llama")
    hf.save_pretrained(tmp_path)
    ids, mask = prompts(seed=2)
    beams = {k: v for k, v in extra.items() if k in ("num_beams", "length_penalty", "early_stopping")}
    plain = theirs(hf, ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD, **beams)
    row0, row1 = ([t for t in row if t not in (EOS, PAD)] for row in plain[:, 6:].tolist())
    bad = [[row0[0]], row1[1:3]]                      # a token and a pair that decoding would produce
    fields = dict(no_repeat_ngram_size=2, bad_words_ids=bad, eos_token_id=EOS, pad_token_id=PAD,
                  max_new_tokens=NEW, **extra)
    hf, ours, cfg = _with_generation_config(tmp_path, **fields)
    assert cfg.no_repeat_ngram_size == 2 and cfg.bad_words_ids == tuple(map(tuple, bad))
    with torch.inference_mode():
        expected = hf.generate(ids, attention_mask=mask)     # the folder's settings, nothing else
    got = archlab.generate(ours, ids, attention_mask=mask, generation_config=cfg)
    assert torch.equal(got, expected), (got[:, 6:].tolist(), expected[:, 6:].tolist())
    assert not torch.equal(got[:, :plain.shape[1]], plain)      # the folder's rules changed the output
    for row in got[:, 6:].tolist():
        pairs = [tuple(row[i:i + 2]) for i in range(len(row) - 1) if PAD not in row[i:i + 2]]
        assert len(pairs) == len(set(pairs))                    # no repeated bigram
        assert bad[0][0] not in row and tuple(bad[1]) not in pairs


def test_explicit_arguments_override_the_folder(pair, tmp_path):
    hf, _ = pair("llama")
    hf.save_pretrained(tmp_path)
    _, ours, cfg = _with_generation_config(tmp_path, no_repeat_ngram_size=1, max_new_tokens=4, eos_token_id=EOS,
                                           num_beams=3)
    ids, mask = prompts()
    overridden = archlab.generate(ours, ids, attention_mask=mask, generation_config=cfg, max_new_tokens=NEW,
                                  no_repeat_ngram_size=0, num_beams=1, eos_token_id=[], pad_token_id=PAD)
    plain = archlab.generate(ours, ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=PAD)
    assert torch.equal(overridden, plain)
    assert archlab.generate(ours, ids, attention_mask=mask, generation_config=cfg).shape[1] <= 6 + 4
