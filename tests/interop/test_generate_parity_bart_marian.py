"""Encoder-decoder generation for BART and Marian: archlab.generate on a model loaded through archlab.interop
equals transformers' generate token for token (tiny random models with random norms, biases and
final_logits_bias; a right-padded source batch of two; greedy and 3-beam search with an EOS made likely)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_parity_bart_marian import TINY, _batch, _hf_model  # noqa: E402

import archlab  # noqa: E402
from archlab.interop import load_hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

EOS, NEW = 2, 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    built = {}

    def get(kind):
        if kind not in built:
            hf = _hf_model(kind)
            with torch.no_grad():
                hf.final_logits_bias[0, EOS] += 3.0          # hypotheses end within the budget
            hf.generation_config.eos_token_id = None         # every call names its settings
            hf.generation_config.forced_eos_token_id = None
            hf.generation_config.no_repeat_ngram_size = 0
            hf.generation_config.bad_words_ids = None
            folder = tmp_path_factory.mktemp(kind)
            hf.save_pretrained(folder)
            built[kind] = (hf, load_hf(folder))
        return built[kind]

    return get


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("kind", ["bart", "marian"])
def test_generate_equals_transformers(pair, kind, num_beams):
    hf, ours = pair(kind)
    src, _, mask = _batch()
    start = hf.config.decoder_start_token_id
    pad = 3 if TINY["pad_token_id"] == 0 else TINY["pad_token_id"]
    # no repeated bigrams: tiny random models otherwise repeat one token, which would test little
    kw = dict(max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=pad, num_beams=num_beams, no_repeat_ngram_size=2)
    with torch.inference_mode():
        expected = hf.generate(src, attention_mask=mask, do_sample=False, decoder_start_token_id=start,
                               early_stopping=True, length_penalty=1.0, **kw)
    got = archlab.generate(ours, src, attention_mask=mask, decoder_start_token_id=start, early_stopping=True,
                           length_penalty=1.0, **kw)
    assert torch.equal(got, expected), (got.tolist(), expected.tolist())
    assert (got[:, 0] == start).all()
    assert got.shape[1] > 3 and ((got == EOS).any() or got.shape[1] == NEW + 1)   # ran on, or ended at EOS
