"""Shared helpers for HF parity tests: tiny random `transformers` model -> save_pretrained ->
archlab.interop.load_hf -> same logits; and our model -> save_hf -> transformers -> same logits.

Use from a test file through the fixtures (tests/ is not a package, so import nothing):

    def test_llama_parity(hf_parity, hf_roundtrip, tiny_kwargs):
        _, ours, _ = hf_parity("llama", **tiny_kwargs(attention_bias=True))
        hf_roundtrip(ours, expect_family="llama")

`hf_parity(model_type, **config_kwargs)` returns (hf_model, our_model, folder) after asserting
logits agree; `hf_roundtrip(our_model)` asserts save_hf -> transformers agrees and returns the
HF model. Both use SEQ tokens in BATCH rows, float32, eager attention.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

SEQ, BATCH = 24, 2
TOLERANCE = 1e-4   # max |ours - theirs| / max |theirs|


def _dtype_kw() -> str:
    """transformers >= 4.56 calls the argument `dtype` (and warns on `torch_dtype`)."""
    try:
        import transformers
    except ImportError:
        return "dtype"
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


DTYPE_KW = _dtype_kw()


def _tiny_kwargs(**overrides) -> dict:
    """Tiny LLaMA-style HF config fields (GQA: 4 heads, 2 kv heads, head_dim 16)."""
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                initializer_range=0.1, tie_word_embeddings=False)
    base.update(overrides)
    return base


def randomize_norms(model: torch.nn.Module, seed: int = 0) -> None:
    """Every 1-D parameter (norm weights, all biases) random, so that (1 + w) vs w, a missing bias
    or a swapped norm shows up in the logits (HF initialises them to constants)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                mean = 1.0 if name.endswith("weight") else 0.0
                p.copy_(mean + 0.2 * torch.randn(p.shape, generator=gen))


def build_hf(model_type: str, seed: int = 0, **config_kwargs):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **config_kwargs)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", **{DTYPE_KW: torch.float32})
    randomize_norms(model, seed)
    return model.eval()


def tokens(vocab_size: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=gen)


def rel_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max())


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


@torch.no_grad()
def assert_same_logits(ours_model, hf_model, vocab_size: int) -> float:
    ids = tokens(vocab_size)
    ours, theirs = ours_model(ids).detach(), hf_logits(hf_model, ids)
    assert ours.shape == theirs.shape
    err = rel_error(ours, theirs)
    assert err < TOLERANCE, f"logits differ: max relative error {err:.2e}"
    return err


@pytest.fixture
def tiny_kwargs():
    """The function tiny_kwargs(**overrides) -> HF config kwargs of a tiny LLaMA-style model."""
    return _tiny_kwargs


@pytest.fixture
def hf_parity(tmp_path: Path):
    from archlab.interop import load_hf

    def run(model_type: str, seed: int = 0, **config_kwargs):
        hf_model = build_hf(model_type, seed, **config_kwargs)
        folder = tmp_path / f"hf-{model_type}"
        hf_model.save_pretrained(folder, safe_serialization=True)
        ours = load_hf(folder)
        assert not ours.training
        assert_same_logits(ours, hf_model, hf_model.config.vocab_size)
        return hf_model, ours, folder

    return run


@pytest.fixture
def hf_roundtrip(tmp_path: Path):
    from archlab.interop import save_hf

    def run(ours, family: str | None = None, expect_family: str | None = None):
        transformers = pytest.importorskip("transformers")
        folder = tmp_path / "roundtrip"
        fam = save_hf(ours, folder, family=family)
        if expect_family is not None:
            assert fam.model_type == expect_family
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="eager", **{DTYPE_KW: torch.float32}).eval()
        assert_same_logits(ours, hf_model, ours.config.vocab_size)
        return hf_model

    return run
