"""Greedy decoding of tiny random HF models loaded through archlab.interop equals transformers'
own generate, token for token (Mistral with a sliding window smaller than the generation)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
interop = pytest.importorskip("archlab.interop")

import archlab  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _tiny(kind):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False, initializer_range=0.2)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=6))


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_greedy_equals_transformers_generate(kind, tmp_path):
    torch.manual_seed(0)
    hf = _tiny(kind).eval()
    hf.generation_config.eos_token_id = None   # no EOS: both sides decode exactly `new` tokens
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = interop.load_hf(tmp_path)
    if kind == "mistral":
        assert ours.config.attention.window == 6
    prompt = torch.randint(0, 128, (2, 7))
    new = 24  # well past the window of 6
    with torch.inference_mode():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                               do_sample=False, pad_token_id=0)
    got = archlab.generate(ours, prompt, max_new_tokens=new)
    assert torch.equal(got, expected)


def test_left_padded_batch_equals_transformers_generate(tmp_path):
    torch.manual_seed(1)
    hf = _tiny("llama").eval()
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = interop.load_hf(tmp_path)
    prompt = torch.randint(1, 128, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    prompt = prompt * mask
    with torch.inference_mode():
        expected = hf.generate(prompt, attention_mask=mask, max_new_tokens=10,
                               do_sample=False, pad_token_id=0)
    got = archlab.generate(ours, prompt, attention_mask=mask, max_new_tokens=10)
    assert torch.equal(got, expected)
