"""save_hf on the test-sized twins of real presets: the inferred family is the real one and
transformers computes the same logits (norm weights and biases randomised first)."""
import pytest
import torch

from archlab import TransformerLM
from archlab.models import presets

pytest.importorskip("transformers")

EXPECTED = {
    "gpt2": "gpt2", "llama3-8b": "llama", "mistral-7b": "mistral", "mixtral-8x7b": "mixtral",
    "qwen2.5-0.5b": "qwen2", "qwen3-8b": "qwen3", "olmo-7b": "olmo", "olmo2-7b": "olmo2",
    "gemma2-9b": "gemma2", "gemma3-27b": "gemma3_text",
}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_tiny_preset_saves_to_its_family(preset, hf_roundtrip):
    cfg = presets.tiny(preset)
    scalar = cfg.attention.query_pre_attn_scalar
    if scalar is not None and not float(scalar).is_integer():  # HF types it int
        cfg = cfg.with_overrides({"attention.query_pre_attn_scalar": float(round(scalar))})
    model = TransformerLM(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            else:  # larger weights: attention far from uniform, windows and caps matter
                p.mul_(3.0)
    hf_roundtrip(model, expect_family=EXPECTED[preset])
