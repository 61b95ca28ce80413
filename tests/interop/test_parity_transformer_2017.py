"""The 2017 Transformer against transformers' MarianMTModel, the same architecture family: post-norm LayerNorm
after every sublayer (MarianConfig has no pre-norm switch), no final norm, biases everywhere, sinusoids added at
the input, one embedding shared by both stacks and the softmax, scaled by sqrt(d) (scale_embedding=True), here
with activation_function="relu".

Two things of the paper MarianConfig cannot express: its sinusoids are split (all sines, then all cosines) where
the paper interleaves them, and its LayerNorm eps is torch's 1e-5 where the preset keeps tensor2tensor's 1e-6.
So a tiny transformer-2017 is exported through a twin that differs in exactly those two switches (plus how
Marian stores what the preset computes: a frozen sinusoid table per stack and a zero `final_logits_bias`), and:
  1. the export is exact: transformers' logits equal the twin's;
  2. transformers' model with the paper's interleaved table (computed here from the formula) written into both
     `embed_positions` and eps 1e-6 on every LayerNorm equals the transformer-2017 model itself; before that
     patch it does not. (Measured: 0.9 relative before, 5e-6 with the table alone, 3e-7 with both: the layout
     is what the comparison can see, the eps is set so that nothing is left to differ.)
"""
import math

import pytest
import torch

from archlab.interop import save_hf
from archlab.models import build_model, presets

TOLERANCE = 1e-4   # max |ours - theirs| / max |theirs|, fp32

# how Marian holds what the preset computes; eps and layout are what it cannot express
MARIAN_STORAGE = {"position.sinusoid_table": True, "position.per_stack": True, "bias.head": True,
                  "bias.head_buffer": True}
MARIAN_MATH = {"position.sinusoid_layout": "split", "norm.eps": 1e-5}


def _paper_sinusoids(n: int, d: int) -> torch.Tensor:
    """(n, d): PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(the same) (Vaswani et al. sec. 3.5)."""
    angle = lambda pos, j: pos / 10_000 ** (2 * (j // 2) / d)  # noqa: E731
    return torch.tensor([[math.sin(angle(p, j)) if j % 2 == 0 else math.cos(angle(p, j)) for j in range(d)]
                         for p in range(n)])


def _batch(vocab: int):
    """A right-padded source batch (row 1: 3 padded slots; right padding counts positions alike in both)."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(1, vocab, (2, 11), generator=gen)
    dec = torch.randint(1, vocab, (2, 9), generator=gen)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 8:] = 0
    return src, dec, mask


@torch.no_grad()
def _rel_error(ours, hf_model, vocab: int) -> float:
    src, dec, mask = _batch(vocab)
    theirs = hf_model(input_ids=src, attention_mask=mask, decoder_input_ids=dec, use_cache=False).logits
    mine = ours(src, dec, attention_mask=mask)
    assert mine.shape == theirs.shape == (2, 9, vocab)
    return float((mine - theirs).abs().max() / theirs.abs().max())


def test_transformer_2017_equals_marian_with_the_papers_sinusoids_and_eps(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = presets.tiny("transformer-2017", vocab_size=96, d_model=32, max_seq_len=24)
    torch.manual_seed(0)
    ours = build_model(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():          # norm gains and biases off their init constants; larger weights
        for name, p in ours.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if name.endswith("norm.weight")
                    else 0.2 * torch.randn(p.shape, generator=gen) if p.dim() == 1 else 3.0 * p)

    twin = build_model(cfg.with_overrides({**MARIAN_STORAGE, **MARIAN_MATH})).eval()
    result = twin.load_state_dict(ours.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) == {"abs_position.table", "decoder_abs_position.table", "lm_head.bias"}
    assert not twin.lm_head.bias.any()                                      # a zero final_logits_bias
    assert save_hf(twin, tmp_path / "hf").model_type == "marian"
    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    c = hf.config
    assert (c.activation_function, c.scale_embedding, c.encoder_layers, c.decoder_layers) == ("relu", True, 2, 2)
    assert c.share_encoder_decoder_embeddings and c.tie_word_embeddings
    assert hf.get_output_embeddings().weight.data_ptr() == hf.model.shared.weight.data_ptr()

    assert _rel_error(twin, hf, cfg.vocab_size) < TOLERANCE             # 1. the export is exact
    before = _rel_error(ours, hf, cfg.vocab_size)
    with torch.no_grad():                                                # 2. the paper's math in transformers
        table = _paper_sinusoids(cfg.max_seq_len, cfg.d_model)
        for stack in (hf.model.encoder, hf.model.decoder):
            stack.embed_positions.weight.copy_(table)
    norms = [m for m in hf.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 * 2 + 2 * 3                                   # 2 per encoder layer, 3 per decoder layer
    for m in norms:
        m.eps = cfg.norm.eps
    after = _rel_error(ours, hf, cfg.vocab_size)
    assert after < TOLERANCE < before, (after, before)
