"""Encoder-decoder generation: archlab.generate on a T5 loaded through archlab.interop equals transformers'
T5ForConditionalGeneration.generate token for token (tiny random v1.0: ReLU, tied head rescaled by d**-0.5;
v1.1: gated-GeLU, a separate head, a decoder deeper than the encoder): greedy and beam search (num_beams 3,
length penalties, every early_stopping mode, an EOS made likely so hypotheses end) on a source batch of two
whose second row is padded (right or left). The encoder runs once per generation, each cross-attention layer
projects its keys and values once, and cached decoding equals the full decoder forward at every step."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import archlab  # noqa: E402
from archlab.interop import load_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

EOS, PAD, START, NEW = 1, 3, 0, 12   # PAD != 0: transformers fills short beam rows with EOS when pad is 0
TINY = dict(vocab_size=128, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
            relative_attention_max_distance=16, dropout_rate=0.0, decoder_start_token_id=START, eos_token_id=EOS,
            pad_token_id=0, initializer_factor=3.0)
VERSIONS = {"v1.0": dict(feed_forward_proj="relu"),
            "v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, num_decoder_layers=3)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """pair(version) -> (transformers model, archlab model): random norms, the EOS row of the head doubled."""
    built = {}

    def get(version):
        if version not in built:
            torch.manual_seed(0)
            hf = transformers.T5ForConditionalGeneration(transformers.T5Config(**TINY, **VERSIONS[version]))
            if version == "v1.1":
                hf.lm_head.weight = torch.nn.Parameter(torch.randn(TINY["vocab_size"], TINY["d_model"]))
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in hf.parameters():
                    if p.dim() == 1:
                        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                hf.get_output_embeddings().weight[EOS] *= 2.0
            hf.eval().generation_config.eos_token_id = None      # every call names its EOS
            folder = tmp_path_factory.mktemp(version)
            hf.save_pretrained(folder)
            built[version] = (hf, load_hf(folder))
        return built[version]

    return get


def sources(side="right", seed=1):
    """Two sources of 9 slots, the second padded by 3 (on `side`) with T5's pad id 0."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(2, TINY["vocab_size"], (2, 9), generator=gen)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    if side == "left":
        mask[1] = mask[1].flip(0)
    return src.masked_fill(mask == 0, 0), mask


def theirs(hf, version, src, mask, **kw):
    # transformers 5 sizes its decoder cache by num_layers: with a deeper decoder (v1.1 here) it decodes uncached
    with torch.inference_mode():
        return hf.generate(src, attention_mask=mask, do_sample=False, use_cache=version == "v1.0",
                           decoder_start_token_id=START, **kw)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_greedy_equals_transformers(pair, version, side):
    hf, ours = pair(version)
    src, mask = sources(side)
    kw = dict(max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    expected = theirs(hf, version, src, mask, **kw)
    got = archlab.generate(ours, src, attention_mask=mask, **kw)
    assert torch.equal(got, expected), (got.tolist(), expected.tolist())
    assert (got[:, 0] == START).all()


BEAMS = [  # (num_beams, length_penalty, early_stopping)
    (3, 1.0, False), (3, 1.0, True), (3, 0.0, "never"), (3, 2.0, True), (3, 2.0, "never"), (3, -1.0, False),
]


@pytest.mark.parametrize("beams,length_penalty,early_stopping", BEAMS)
@pytest.mark.parametrize("version", sorted(VERSIONS))
def test_beam_search_equals_transformers(pair, version, beams, length_penalty, early_stopping):
    hf, ours = pair(version)
    src, mask = sources()
    kw = dict(max_new_tokens=NEW, num_beams=beams, length_penalty=length_penalty, early_stopping=early_stopping,
              eos_token_id=EOS, pad_token_id=PAD)
    expected = theirs(hf, version, src, mask, **kw)
    got = archlab.generate(ours, src, attention_mask=mask, **kw)
    assert torch.equal(got, expected), (got.tolist(), expected.tolist())


def test_the_planted_eos_ends_hypotheses_early(pair):
    """The beam cases above are only worth their name if hypotheses finish before the length limit."""
    hf, _ = pair("v1.1")
    src, mask = sources()
    out = theirs(hf, "v1.1", src, mask, max_new_tokens=NEW, num_beams=3, length_penalty=0.0, early_stopping=True,
                 eos_token_id=EOS, pad_token_id=PAD)
    assert out.shape[1] < 1 + NEW and bool((out == EOS).any())


def test_another_start_token_and_t5s_own_pad(pair):
    hf, ours = pair("v1.0")
    src, mask = sources(seed=3)
    kw = dict(max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=0)
    with torch.inference_mode():
        expected = hf.generate(src, attention_mask=mask, do_sample=False, decoder_start_token_id=7, **kw)
    got = archlab.generate(ours, src, attention_mask=mask, decoder_start_token_id=7, **kw)
    assert torch.equal(got, expected) and (got[:, 0] == 7).all()


@pytest.mark.parametrize("beams", [1, 3])
def test_cached_equals_uncached_with_processors(pair, beams):
    _, ours = pair("v1.1")
    src, mask = sources(side="left", seed=2)
    kw = dict(max_new_tokens=NEW, num_beams=beams, eos_token_id=EOS, pad_token_id=PAD, no_repeat_ngram_size=2,
              bad_words_ids=[[7], [9, 10]], repetition_penalty=1.3)
    cached = archlab.generate(ours, src, attention_mask=mask, **kw)
    for fast in (True, False):
        assert torch.equal(cached, archlab.generate(ours, src, attention_mask=mask, use_cache=False,
                                                    fast_decode=fast, **kw))


@pytest.mark.parametrize("beams", [1, 3])
def test_the_encoder_runs_once_and_cross_keys_are_projected_once(pair, beams):
    _, ours = pair("v1.1")
    src, mask = sources()
    calls = {"encoder": 0, "cross_kv": 0, "cross_q": 0}

    def count(name):
        def hook(module, args, output):
            calls[name] += 1
        return hook

    handles = [ours.encoder.register_forward_hook(count("encoder"))]
    for block in ours.decoder:
        handles.append(block.cross_attn.k_proj.register_forward_hook(count("cross_kv")))
        handles.append(block.cross_attn.q_proj.register_forward_hook(count("cross_q")))
    try:
        out = archlab.generate(ours, src, attention_mask=mask, max_new_tokens=NEW, num_beams=beams,
                               eos_token_id=[], pad_token_id=PAD, fast_decode=False)
    finally:
        for h in handles:
            h.remove()
    layers = len(ours.decoder)
    assert out.shape == (2, 1 + NEW)
    assert calls == {"encoder": 1, "cross_kv": layers, "cross_q": layers * NEW}


def test_sampling_is_seeded_and_single_sources_come_back_1d(pair):
    _, ours = pair("v1.0")
    src, mask = sources()
    kw = dict(max_new_tokens=NEW, temperature=1.0, top_k=20, seed=5, eos_token_id=EOS, pad_token_id=PAD)
    first = archlab.generate(ours, src, attention_mask=mask, **kw)
    assert torch.equal(first, archlab.generate(ours, src, attention_mask=mask, **kw))
    assert (first[:, 0] == START).all()
    one = archlab.generate(ours, src[0].tolist(), max_new_tokens=4, eos_token_id=[])
    assert one.shape == (5,) and int(one[0]) == START
    rows = archlab.generate(ours, [src[0].tolist(), src[1, :6].tolist()], max_new_tokens=NEW, eos_token_id=EOS,
                            pad_token_id=PAD)   # lists of different lengths: padded here
    assert torch.equal(rows, archlab.generate(ours, src, attention_mask=mask, max_new_tokens=NEW,
                                              eos_token_id=EOS, pad_token_id=PAD))


def _write_t5_tokenizer(folder):
    """A small Unigram tokenizer.json in T5's layout (<pad> 0, </s> 1, <unk> 2) whose post-processor appends </s>."""
    tokenizers = pytest.importorskip("tokenizers")
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += [(w, -1.0 - i * 0.01) for i, w in enumerate(letters + ["▁" + c for c in letters] + ["▁"])]
    pieces += [(f"<extra_id_{i}>", 0.0) for i in range(TINY["vocab_size"] - len(pieces))]
    tok = tokenizers.Tokenizer(tokenizers.models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "</s>", "pad_token": "<pad>"}')
    return tok


@pytest.mark.parametrize("beams", ["1", "3"])
def test_cli_generates_from_a_source(pair, tmp_path, capsys, beams):
    """`archlab generate FOLDER --source TEXT`: the source through the tokenizer's post-processor (</s> appended),
    the target decoded from the start token, printed without it and up to EOS."""
    from archlab.cli import main

    hf, ours = pair("v1.0")
    hf.save_pretrained(tmp_path)
    tok = _write_t5_tokenizer(tmp_path)
    text = "the cat sat"
    source = tok.encode(text).ids
    assert source[-1] == EOS
    out = archlab.generate(ours, source, max_new_tokens=NEW, num_beams=int(beams), eos_token_id=EOS)
    new = out[1:].tolist()
    new = new[:new.index(EOS)] if EOS in new else new
    capsys.readouterr()
    assert main(["generate", str(tmp_path), "--source", text, "--max-new-tokens", str(NEW),
                 "--num-beams", beams]) == 0
    assert capsys.readouterr().out == tok.decode(new) + "\n"
