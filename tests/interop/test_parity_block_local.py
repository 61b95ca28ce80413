"""transformers' windowed families (Mistral, Gemma 2, Gemma 3, Cohere 2) on the block-local kernel: logits
equal transformers' eager (dense-mask) attention 24 tokens long, several windows past a window of 5-6,
with blocks of 4 queries (6 blocks), every local layer on block_local."""
import pytest
from test_parity_b_cohere import BASE as COHERE
from test_parity_gemma import gemma_kwargs

from archlab.nn import attention_backends as backends
from archlab.nn.local_attention import BlockLocal

pytest.importorskip("transformers")

ROPE3 = {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}


@pytest.fixture
def block_local_only(monkeypatch):
    """Blocks of 4 queries; local layers forced onto block_local, and a record of what ran."""
    monkeypatch.setattr(BlockLocal, "block", 4)
    ran = []
    choose = backends.choose

    def counted(call):
        backend = choose(call)
        ran.append(backend.name)
        return backend
    monkeypatch.setattr(backends, "choose", counted)
    with backends.forced("block_local"):
        yield ran


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3_text", "cohere2"])
def test_windowed_families_match_transformers_on_block_local(family, block_local_only, hf_parity, tiny_kwargs):
    kwargs = {
        "mistral": lambda: tiny_kwargs(sliding_window=5),
        "gemma2": lambda: gemma_kwargs(tiny_kwargs, query_pre_attn_scalar=20, sliding_window=5,
                                       attn_logit_softcapping=3.0, final_logit_softcapping=2.0),
        "gemma3_text": lambda: gemma_kwargs(tiny_kwargs, num_hidden_layers=6, sliding_window=5,
                                            query_pre_attn_scalar=24, rope_parameters=ROPE3),
        "cohere2": lambda: {**COHERE, "num_hidden_layers": 4, "sliding_window": 6},
    }[family]()
    _, ours, _ = hf_parity(family, **kwargs)              # asserts the logits (rel. error < 1e-4)
    local = sum(ours.config.is_local(i) for i in range(ours.config.n_layers))
    assert block_local_only.count("block_local") == local > 0
