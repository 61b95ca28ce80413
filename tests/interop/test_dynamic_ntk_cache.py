"""Dynamic NTK scaling with a KV cache (the trap of transformers#25104): each step's new key is rotated under the
base of the length so far, and the keys already cached keep the bases they were rotated under. archlab does what
transformers does, step for step; past the original context that differs from recomputing the whole sequence
(where every key gets the latest base), and within it the two agree."""
from __future__ import annotations

import pytest
import torch

from archlab.config import ModelConfig
from archlab.interop import save_hf
from archlab.models.decoder import TransformerLM
from archlab.nn.kv_cache import KVCache

transformers = pytest.importorskip("transformers")
ORIGINAL, PROMPT, STEPS = 16, 10, 16          # decoding runs from 10 to 26 tokens: past the original 16


def model(kind: str = "dynamic") -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(
        vocab_size=128, d_model=64, n_layers=2, max_seq_len=4 * ORIGINAL, init={"std": 0.1},
        attention={"n_heads": 4, "n_kv_heads": 2},
        position={"rope_theta": 100.0, "rope_scaling": {"kind": kind, "factor": 4.0,
                                                         "original_max_seq_len": ORIGINAL}})).eval()


@torch.no_grad()
def cached_steps(ours: TransformerLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """Logits of each next token, (1, v) per step: the prompt, then one token at a time over the cache."""
    cache = KVCache()
    out = [ours(ids[:, :PROMPT], cache=cache)[:, -1]]
    for t in range(PROMPT, ids.shape[1]):
        out.append(ours(ids[:, t:t + 1], cache=cache)[:, -1])
    return out


@torch.no_grad()
def test_cached_dynamic_ntk_decoding_matches_transformers_cache(tmp_path):
    ours = model()
    save_hf(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(0))
    out = hf(ids[:, :PROMPT], use_cache=True)
    theirs, past = [out.logits[:, -1]], out.past_key_values
    for t in range(PROMPT, ids.shape[1]):
        out = hf(ids[:, t:t + 1], past_key_values=past, use_cache=True)
        theirs.append(out.logits[:, -1])
        past = out.past_key_values
    for step, (a, b) in enumerate(zip(cached_steps(ours, ids), theirs)):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-4, f"step {step}"


@torch.no_grad()
def test_cached_dynamic_ntk_differs_from_recomputing_only_past_the_original_context():
    ours = model()
    ids = torch.randint(0, 128, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(0))
    cached = cached_steps(ours, ids)
    for i, logits in enumerate(cached):
        length = PROMPT + i                                    # tokens seen when predicting the next one
        fresh = ours(ids[:, :length])[:, -1]                   # every key rotated under the base of `length`
        err = float((logits - fresh).abs().max() / fresh.abs().max())
        if length <= ORIGINAL:
            assert err < 1e-5, f"length {length}"
        else:                                                  # earlier keys cached under older bases
            assert err > 1e-4, f"length {length}: cached decoding should show the stale bases"
    # a scaling with fixed frequencies (YaRN) has no such difference
    yarn = model("yarn")
    for i, logits in enumerate(cached_steps(yarn, ids)):
        fresh = yarn(ids[:, :PROMPT + i])[:, -1]
        assert float((logits - fresh).abs().max() / fresh.abs().max()) < 1e-5
