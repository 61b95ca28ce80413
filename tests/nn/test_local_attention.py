"""Block-local attention (nn/local_attention.py, backend "block_local") equals the dense eager reference:
sequences of several blocks with a ragged tail, windows that do not divide the length, every position kind,
GQA/MQA, soft-capping, sinks, prefix-LM and padding masks, local/global patterns; values and gradients."""
import pytest
import torch
from variants import variant

from archlab import TransformerLM
from archlab.nn import attention_backends as backends
from archlab.nn.attention_backends import AttnCall, forced
from archlab.nn.local_attention import BlockLocal
from archlab.nn.masks import MaskSpec

pytestmark = pytest.mark.usefixtures("one_thread")

T, WINDOW, BLOCK = 23, 5, 4          # 6 blocks of 4, the last with 3 rows; the window does not divide 23

CASES = {
    "rope": {},
    "gqa": {"attention.n_kv_heads": 2},
    "mqa": {"attention.n_kv_heads": 1},
    "nope": {"position.kind": "none"},
    "alibi": {"position.kind": "alibi"},
    "t5": {"position.kind": "t5"},
    "sinusoidal": {"position.kind": "sinusoidal"},
    "softcap": {"attention.logit_softcap": 5.0},
    "sinks": {"attention.learned_sinks": True},
    "lllg": {"attention.layer_pattern": "LLLG", "n_layers": 4},
    "rope-local-nope-global": {"attention.layer_pattern": "LG", "position.global_kind": "none"},
    "rope-local-theta": {"attention.layer_pattern": "LG", "position.local_rope_theta": 100.0},
    "prefix-lm": {"attention.prefix_lm": True},
    "dilated": {"attention.dilation": 2},
    "dilated-alibi-gqa": {"attention.dilation": 3, "position.kind": "alibi", "attention.n_kv_heads": 2},
    "global-tokens": {"attention.global_tokens": 2},
    "global-tokens-t5-prefix": {"attention.global_tokens": 3, "position.kind": "t5", "attention.prefix_lm": True},
    "global-tokens-sinks-softcap": {"attention.global_tokens": 1, "attention.learned_sinks": True,
                                    "attention.logit_softcap": 5.0},
    "fixed": {"attention.window": None, "attention.sparse": "fixed", "attention.sparse_stride": 3,
              "attention.sparse_summary": 2},
    "strided": {"attention.window": None, "attention.sparse": "strided", "attention.sparse_stride": 3},
    "strided-t5-sinks-lg": {"attention.window": None, "attention.sparse": "strided", "attention.sparse_stride": 4,
                            "position.kind": "t5", "attention.learned_sinks": True, "attention.layer_pattern": "LG"},
    "fixed-global-alibi": {"attention.window": None, "attention.sparse": "fixed", "attention.sparse_stride": 4,
                           "attention.global_tokens": 2, "position.kind": "alibi"},
}


@pytest.fixture()
def small_blocks(monkeypatch):
    monkeypatch.setattr(BlockLocal, "block", BLOCK)


def _ran(monkeypatch) -> list[str]:
    ran: list[str] = []
    choose = backends.choose

    def counted(call):
        backend = choose(call)
        ran.append(backend.name)
        return backend
    monkeypatch.setattr(backends, "choose", counted)
    return ran


def _logits_and_grads(model, x, backend, **kw):
    model.zero_grad()
    with forced(backend):
        logits = model(x, **kw)
    (logits.float().square().mean() + logits.float().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel_close(got, ref, tol, msg=""):
    err = (got - ref).abs().max() / ref.abs().max().clamp(min=1e-12)
    assert err <= tol, f"{msg}: relative error {err:.2e}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_block_local_equals_dense_eager_with_gradients(name, small_blocks, monkeypatch):
    overrides = {"attention.window": WINDOW, "attention.dropout": 0.0, **CASES[name]}
    cfg = variant("base").with_overrides(overrides)
    model = TransformerLM(cfg).train()
    torch.manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (2, T))
    kw = {"prefix_lengths": torch.tensor([7, 2])} if cfg.attention.prefix_lm else {}
    ref, ref_grads = _logits_and_grads(model, x, "eager", **kw)
    ran = _ran(monkeypatch)
    kernel = "strided" if cfg.attention.sparse == "strided" else "block_local"
    got, grads = _logits_and_grads(model, x, kernel, **kw)
    local_layers = sum(cfg.is_local(i) for i in range(cfg.n_layers))
    assert ran.count(kernel) == local_layers > 0, ran               # every local layer, no global one
    _rel_close(got, ref, 1e-5, "logits")
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        _rel_close(grads[key], ref_grads[key], 1e-5, key)


def _dense_reference(call: AttnCall):
    """The same call with the spec compiled to a dense mask and bias: what the eager backend computes."""
    dense = AttnCall(call.q, call.k, call.v, call.scale, mask=call.dense_mask(), bias=call.dense_bias(),
                     softcap=call.softcap, sinks=call.sinks)
    return backends.BACKENDS.get("eager")(dense)[0]


@pytest.mark.parametrize("causal", [True, False])
def test_blocked_kernels_with_padding_prefix_dilation_globals_patterns_and_symmetric_windows(causal, small_blocks):
    torch.manual_seed(0)
    b, h, kv, t, e = 3, 4, 2, 19, 8
    q = torch.randn(b, h, t, e, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, kv, t, e, dtype=torch.float64, requires_grad=True) for _ in range(2))
    pos = torch.arange(t)[None]
    padding = torch.ones(b, t, dtype=torch.bool)
    padding[1, 2:6] = False                            # row 1: a hole (every query keeps a key)
    padding[2, -3:] = False                            # row 2 right-padded
    sparse_holes = padding.clone()
    sparse_holes[1] = True
    sparse_holes[1, 6:8] = False                       # with dilation 3 a key 3 and 6 back remains
    specs = [MaskSpec(causal=causal, key_padding=padding).with_window(6),
             MaskSpec(causal=causal, prefix_lengths=torch.tensor([5, 0, 9])).with_window(3),
             MaskSpec(causal=causal, key_padding=sparse_holes, dilation=3).with_window(4),
             MaskSpec(causal=causal, key_padding=padding, global_indices=(0, 3)).with_window(3),
             MaskSpec(causal=causal, key_padding=sparse_holes, pattern="fixed", block_size=3, summary=1),
             MaskSpec(causal=causal, key_padding=sparse_holes, pattern="strided", block_size=3),
             MaskSpec(causal=causal, pattern="strided", block_size=5)]
    for spec in specs:
        call = AttnCall(q, k, v, e ** -0.5, spec=spec, q_pos=pos, k_pos=pos, aligned=True)
        backend = backends.BACKENDS.get("strided" if spec.pattern == "strided" else "block_local")
        assert backend.supports(call) is None
        got = backend(call)[0]
        ref = _dense_reference(call)
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
        g = torch.randn_like(ref)
        grads = torch.autograd.grad(got, (q, k, v), g)
        ref_grads = torch.autograd.grad(ref, (q, k, v), g)
        for a, r in zip(grads, ref_grads):
            torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_block_local_is_chosen_only_where_the_window_saves_pairs():
    backend = backends.BACKENDS.get("block_local")
    for t, window, chosen in ((8192, 256, True), (1024, 256, True), (512, 256, False), (512, 4096, False)):
        q = torch.empty(1, 4, t, 8, device="meta")
        pos = torch.arange(t, device="meta")[None]
        call = AttnCall(q, q, q, 1.0, spec=MaskSpec().with_window(window), q_pos=pos, k_pos=pos, aligned=True)
        assert (backends.choose(call) is backend) == chosen, (t, window)
    full = AttnCall(q, q, q, 1.0, spec=MaskSpec(), q_pos=pos, k_pos=pos, aligned=True)
    assert "bounded" in backend.supports(full)
    cached = AttnCall(q, q, q, 1.0, spec=MaskSpec().with_window(8), q_pos=pos, k_pos=pos, aligned=False)
    assert "no cache" in backend.supports(cached)


def test_a_windowed_model_trains_on_block_local_at_length():
    cfg = variant("base").with_overrides({"attention.window": 16, "attention.layer_pattern": "LG",
                                          "max_seq_len": 1024})
    model = TransformerLM(cfg)
    assert [blk.attn.attention_backend(1024) for blk in model.blocks] == ["block_local", "sdpa"]
    assert [blk.attn.attention_backend(64) for blk in model.blocks] == ["sdpa", "sdpa"]


def _pairs(spec: MaskSpec, t: int) -> set[tuple[int, int]]:
    pos = torch.arange(t)[None]
    return {(i, j) for i, j in spec.allows(pos, pos)[0, 0].nonzero().tolist()}


def test_sparse_patterns_hand_computed():
    """Each pattern's (query, key) pairs written out from its definition, over 10 causal positions."""
    t, causal = 10, {(i, j) for i in range(10) for j in range(i + 1)}
    dilated = {(i, j) for i, j in causal if (i - j) % 2 == 0 and i - j <= 4}             # w 3, d 2: i, i-2, i-4
    assert _pairs(MaskSpec(dilation=2).with_window(3), t) == dilated
    window = {(i, j) for i, j in causal if i - j <= 1}
    globals_ = {(i, j) for i, j in causal if i == 0 or j == 0 or i == 1 or j == 1}        # the first 2 tokens
    assert _pairs(MaskSpec(global_indices=(0, 1)).with_window(2), t) == window | globals_
    strided = {(i, j) for i, j in causal if i - j < 3 or (i - j) % 3 == 0}
    assert _pairs(MaskSpec(pattern="strided", block_size=3), t) == strided
    fixed = {(i, j) for i, j in causal if i // 4 == j // 4 or j % 4 == 3}                 # l 4, c 1
    assert _pairs(MaskSpec(pattern="fixed", block_size=4), t) == fixed
    fixed2 = {(i, j) for i, j in causal if i // 4 == j // 4 or j % 4 >= 2}                # c 2
    assert _pairs(MaskSpec(pattern="fixed", block_size=4, summary=2), t) == fixed2
    bidirectional = {(i, j) for i in range(t) for j in range(t) if i // 4 == j // 4 or j % 4 == 3}
    assert _pairs(MaskSpec(causal=False, pattern="fixed", block_size=4), t) == bidirectional
    both_ways = {(i, j) for i in range(t) for j in range(t) if abs(i - j) <= 1 or {i, j} & {0}}
    assert _pairs(MaskSpec(causal=False, global_indices=(0,)).with_window(3), t) == both_ways


PATTERNS = {
    "window": {"attention.window": 4},
    "dilated": {"attention.window": 3, "attention.dilation": 3},
    "global": {"attention.window": 3, "attention.global_tokens": 2},
    "dilated-global": {"attention.window": 3, "attention.dilation": 2, "attention.global_tokens": 3},
    "strided": {"attention.sparse": "strided", "attention.sparse_stride": 4},
    "fixed": {"attention.sparse": "fixed", "attention.sparse_stride": 5, "attention.sparse_summary": 2},
    "strided-global-lg": {"attention.sparse": "strided", "attention.sparse_stride": 3,
                          "attention.global_tokens": 1, "attention.layer_pattern": "LG"},
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("prefix", [0, 6])
def test_keys_per_query_counts_the_predicates_pairs(name, prefix):
    from archlab.models import accounting
    from archlab.nn.masks import LocalPattern

    cfg = variant("base").with_overrides(PATTERNS[name])
    t, pos = 37, torch.arange(37)[None]
    for layer in range(cfg.n_layers):
        local = LocalPattern.of(cfg.attention) if cfg.is_local(layer) else None
        spec = MaskSpec(prefix_lengths=torch.tensor([prefix]) if prefix else None).restricted(local)
        pairs = int(spec.allows(pos, pos).sum())
        assert accounting.keys_per_query(cfg, layer, t, prefix) * t == pytest.approx(pairs), layer


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_cached_decoding_equals_the_full_forward_for_every_pattern(name):
    """A KV cache keeps what each pattern reaches ((w-1)·d + 1 rolling slots for a dilated window, everything
    for global tokens and sparse patterns): token-by-token decoding gives the full forward's logits, and the
    cache holds the bytes accounting says."""
    from archlab.models.accounting import kv_cache_bytes
    from archlab.nn.kv_cache import StaticKVCache

    cfg = variant("base").with_overrides(PATTERNS[name])
    model = TransformerLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    cache = StaticKVCache(cfg, 2, 24)
    with torch.no_grad():
        steps = [model(ids[:, :5], cache=cache)] + [model(ids[:, i:i + 1], cache=cache) for i in range(5, 24)]
        full = model(ids)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    assert cache.nbytes == kv_cache_bytes(cfg, 24, batch=2, dtype="float32")


@pytest.mark.parametrize("name", ["window", "dilated", "strided", "global"])
def test_a_cached_prefill_runs_the_blocked_kernels_and_equals_the_dense_one(name, small_blocks, monkeypatch):
    """Prefilling a fresh KV cache (left-padded rows, positions from the padding) is aligned: the blocked
    kernels run it, the logits equal the dense prefill's, and decoding continues from the cache."""
    from archlab.generation.stepper import positions_from_mask
    from archlab.nn.kv_cache import StaticKVCache

    cfg = variant("base").with_overrides(PATTERNS[name])
    model = TransformerLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 21))
    mask = torch.ones(2, 21, dtype=torch.bool)
    mask[1, :6] = False                                                 # row 1: 6 pad tokens on the left
    pos = positions_from_mask(mask)
    ran = _ran(monkeypatch)
    kernel = "strided" if cfg.attention.sparse == "strided" else "block_local"
    with torch.no_grad():
        with forced("eager"):
            ref = model(ids, positions=pos, cache=StaticKVCache(cfg, 2, 24))
        ran.clear()
        cache = StaticKVCache(cfg, 2, 24)
        with forced(kernel):
            got = model(ids, positions=pos, cache=cache)
            local = sum(cfg.is_local(i) for i in range(cfg.n_layers))
            # global tokens are positions, not indices: padded rows keep them off the blocks (dense instead)
            assert ran.count(kernel) == (0 if cfg.attention.global_tokens else local) and local > 0, ran
            step = model(ids[:, -1:], positions=pos[:, -1:] + 1, cache=cache)   # a decode step after it
    real = mask[:, :, None].expand_as(ref)
    torch.testing.assert_close(got[real], ref[real], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(step).all()
