"""One attention seam (archlab.nn.attention_backends): every backend equals the eager reference over
tests/variants.py, logits and gradients, wherever it declares it supports the call; what it refuses
it says; the usual choice picks what the lecture expects."""
import pytest
import torch
from variants import VARIANTS, variant

from archlab import TransformerLM
from archlab.nn import attention_backends as backends
from archlab.nn.attention_backends import AttnCall, forced
from archlab.nn.local_attention import BlockLocal

pytestmark = pytest.mark.usefixtures("one_thread")

OTHERS = [name for name in backends.BACKENDS.names() if name not in ("eager", "decode")]   # decode: one query per
# row, which no variant's full forward is (its own tests below and tests/generation/test_compiled_step.py)
FORWARD_ONLY = ["flex"]                  # torch 2.13 has no FlexAttention backward on CPU: forward under no_grad


class _Counting:
    """Records which backend ran each call, and why `wanted` did not where it did not (wraps choose)."""

    def __init__(self, monkeypatch, wanted: str):
        self.ran: list[str] = []
        self.refusals: list[str | None] = []
        choose = backends.choose

        def counted(call):
            backend = choose(call)
            self.ran.append(backend.name)
            self.refusals.append(backends.BACKENDS.get(wanted).supports(call))
            return backend
        monkeypatch.setattr(backends, "choose", counted)


def _logits_and_grads(model, x, backend):
    model.zero_grad()
    with forced(backend):
        logits = model(x)
    (logits.float().square().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", [name for name in OTHERS if name not in FORWARD_ONLY])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_backend_equals_the_eager_reference_with_gradients(name, backend, monkeypatch):
    cfg = variant(name).with_overrides({"attention.dropout": 0.0})
    model = TransformerLM(cfg).train()
    torch.manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (2, 9))
    ref, ref_grads = _logits_and_grads(model, x, "eager")
    counter = _Counting(monkeypatch, backend)
    got, grads = _logits_and_grads(model, x, backend)
    for ran, why in zip(counter.ran, counter.refusals):    # forced wherever it supports the call, never elsewhere
        assert (ran == backend) == (why is None), (ran, why)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("backend", FORWARD_ONLY)
@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_forward_only_backend_equals_the_eager_reference(name, backend, monkeypatch):
    cfg = variant(name).with_overrides({"attention.dropout": 0.0})
    model = TransformerLM(cfg).eval()
    torch.manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        with forced("eager"):
            ref = model(x)
        counter = _Counting(monkeypatch, backend)
        with forced(backend):
            got = model(x)
    for ran, why in zip(counter.ran, counter.refusals):
        assert (ran == backend) == (why is None), (ran, why)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def _call(t=5, s=5, **kw) -> AttnCall:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, t, 8), torch.randn(2, 2, s, 8), torch.randn(2, 2, s, 8)
    return AttnCall(q, k, v, 8 ** -0.5, **kw)


def test_masks_bias_and_padding_agree_with_eager_in_every_backend_that_takes_them():
    mask = torch.rand(2, 1, 5, 7) > 0.3
    mask[..., 0] = True                                       # every query sees at least one key
    bias = torch.randn(2, 4, 5, 7)
    cases = ({"mask": mask}, {"bias": bias}, {"mask": mask, "bias": bias}, {"is_causal": True, "bias": bias[..., :5]})
    for kw in cases:
        s = 5 if kw.get("is_causal") else 7
        call = _call(s=s, **kw)
        ref, _ = backends.BACKENDS.get("eager")(call)
        for name in OTHERS:
            backend = backends.BACKENDS.get(name)
            if backend.supports(call) is None:
                torch.testing.assert_close(backend(call)[0], ref, rtol=1e-5, atol=1e-5)


def test_refusals_name_what_is_missing_and_the_usual_choice():
    assert "soft-cap" in backends.BACKENDS.get("sdpa").supports(_call(is_causal=True, softcap=30.0))
    assert "causal" in backends.BACKENDS.get("cpu_causal").supports(_call(mask=torch.ones(1, 1, 5, 5, dtype=bool)))
    assert backends.choose(_call(is_causal=True)).name == "sdpa"          # float32: SDPA
    assert backends.choose(_call(is_causal=True, sinks=torch.zeros(4))).name == "eager"
    assert backends.choose(_call(is_causal=True, keep_probs=True)).name == "eager"
    with forced("cpu_causal"):
        assert backends.choose(_call(is_causal=True)).name == "cpu_causal"
        assert backends.choose(_call(mask=torch.ones(1, 1, 5, 5, dtype=bool))).name == "sdpa"  # falls back
    with forced("sdpa", strict=True), pytest.raises(ValueError, match="cannot run this call: no soft-cap"):
        backends.choose(_call(is_causal=True, softcap=30.0))
    with pytest.raises(Exception, match="unknown attention backend 'flash9'"):
        with forced("flash9"):
            pass


def test_kept_probabilities_are_the_softmax_rows():
    out, probs = backends.run(_call(is_causal=True, keep_probs=True))
    assert probs.shape == (2, 4, 5, 5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 5))
    assert torch.all(probs.triu(1) == 0)                                 # causal: nothing above the diagonal


def test_provenance_names_each_layers_backend():
    model = TransformerLM(variant("base"))
    assert {blk.attn.attention_backend() for blk in model.blocks} == {"sdpa"}
    capped = TransformerLM(variant("base").with_overrides({"attention.logit_softcap": 50.0}))
    assert {blk.attn.attention_backend() for blk in capped.blocks} == {"eager"}


def test_backends_are_tried_by_their_registered_priority():
    assert backends.ORDER[-1] == "eager"                                  # the reference: last, supports all
    assert backends.ORDER.index("block_local") < backends.ORDER.index("sdpa")
    assert set(backends.ORDER) == set(backends.BACKENDS.names())


def test_a_layer_hands_its_spec_and_positions_and_the_dense_mask_is_built_only_on_demand(monkeypatch):
    from archlab.nn.masks import MaskSpec
    calls, allows = [], MaskSpec.allows
    monkeypatch.setattr(MaskSpec, "allows", lambda self, q, k: calls.append(q.shape) or allows(self, q, k))
    seen = []
    model = TransformerLM(variant("window"))
    with backends.observe(seen.append), forced("sdpa"):
        model(torch.randint(0, 97, (2, 9)))
    assert all(c.spec is not None and c.spec.window == (2, 0) and c.q_pos is not None for c in seen)
    assert len(calls) == 1                                # two windowed layers, one mask per forward
    calls.clear()
    with forced("block_local"):
        model(torch.randint(0, 97, (2, 9)))               # the blocked kernel: per-block masks, no (t, s) one
    assert calls and all(shape[-1] == BlockLocal.block for shape in calls)


def test_dense_masks_are_shared_by_spec_never_by_length_alone():
    from archlab.nn.masks import AttnInputs, MaskSpec
    pos = torch.arange(6)[None]
    inputs = AttnInputs(pos, MaskSpec(causal=True))
    causal = inputs.dense(MaskSpec(causal=True).with_window(2), pos, pos)[0]
    bidirectional = inputs.dense(MaskSpec(causal=False).with_window(2), pos, pos)[0]
    assert not torch.equal(causal, bidirectional)                         # same lengths, different specs
    assert inputs.layer_spec(2) is inputs.layer_spec(2)                   # one spec per window and forward


def test_the_predicate_refuses_patterns_it_does_not_know():
    from archlab.nn.masks import MaskSpec
    with pytest.raises(ValueError, match="pattern='banded'"):
        MaskSpec(pattern="banded", block_size=4)
    with pytest.raises(ValueError, match="block size"):
        MaskSpec(pattern="strided")


def test_one_query_with_grouped_heads_folds_them_and_equals_eager(monkeypatch):
    """A decode step's call (one query, GQA 4:2): SDPA runs a kv head's query heads as one matrix; the output equals
    the eager reference with no mask, a padding mask per batch row (b, 1, 1, s), and a mask shared by the batch."""
    queries = []
    sdpa_fn = backends.F.scaled_dot_product_attention
    monkeypatch.setattr(backends.F, "scaled_dot_product_attention",
                        lambda q, *args, **kw: queries.append(tuple(q.shape)) or sdpa_fn(q, *args, **kw))
    padding = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    padding[0, ..., :3] = False                               # row 0's first keys are padding
    sdpa, eager = backends.BACKENDS.get("sdpa"), backends.BACKENDS.get("eager")
    for kw in ({}, {"mask": padding}, {"mask": padding[1:]}):
        call = _call(t=1, s=7, **kw)
        assert sdpa.supports(call) is None
        torch.testing.assert_close(sdpa(call)[0], eager(call)[0], rtol=1e-5, atol=1e-6)
    q = torch.randn(2, 1, 4, 8).transpose(1, 2)               # heads split from (b, t, h*e): not contiguous
    call = _call(t=1, s=7)
    call = AttnCall(q, call.k, call.v, call.scale)
    torch.testing.assert_close(sdpa(call)[0], eager(call)[0], rtol=1e-5, atol=1e-6)
    assert queries == [(2, 2, 2, 8)] * 4                      # (b, kv heads, query heads per kv head, e)


@pytest.mark.parametrize("traced", [False, True], ids=["matmuls", "broadcast"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
def test_decode_attention_equals_the_eager_reference(heads, traced):
    """One query per row, each kv head's query heads folded into one matrix, in both written forms (batched matmuls
    eagerly; broadcast products summed, what inductor fuses in a compiled step): the eager reference's output with
    no mask, a padding mask per row (b, 1, 1, s) and a mask shared by the batch; bf16 within its resolution."""
    h, kv = heads
    torch.manual_seed(0)
    q, k, v = torch.randn(2, h, 1, 8), torch.randn(2, kv, 7, 8), torch.randn(2, kv, 7, 8)
    padding = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    padding[0, ..., :3] = False
    eager = backends.BACKENDS.get("eager")
    for mask in (None, padding, padding[1:]):
        ref = eager(AttnCall(q, k, v, 8 ** -0.5, mask=mask))[0]
        got = backends.decode_attention(q, k, v, 8 ** -0.5, mask, traced=traced)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        half = backends.decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 8 ** -0.5, mask, traced=traced)
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), ref, rtol=0.05, atol=0.05)


def test_the_decode_backend_takes_one_query_and_is_chosen_only_when_compiling(monkeypatch):
    """It supports a decode step's call and says why not elsewhere; an eager decode step stays on SDPA (as fast
    there), so the backend is chosen only inside a compiled step, and there for one row only (SDPA was faster at 8)."""
    decode = backends.BACKENDS.get("decode")
    assert decode.supports(_call(t=1, s=7)) is None
    assert decode.supports(_call(t=1, s=7, mask=torch.ones(2, 1, 1, 7, dtype=torch.bool))) is None
    assert "one query" in decode.supports(_call(t=5, s=7))
    assert "soft-cap" in decode.supports(_call(t=1, s=7, softcap=30.0))
    assert "bias" in decode.supports(_call(t=1, s=7, bias=torch.zeros(2, 4, 1, 7)))
    assert backends.choose(_call(t=1, s=7)).name == "sdpa"
    with monkeypatch.context() as patch:
        patch.setattr(torch.compiler, "is_compiling", lambda: True)
        one = _call(t=1, s=7)
        one = AttnCall(one.q[:1], one.k[:1], one.v[:1], one.scale)
        assert backends.choose(one).name == "decode" and backends.choose(_call(t=1, s=7)).name == "sdpa"
    with forced("decode", strict=True):
        call = _call(t=1, s=7)
        torch.testing.assert_close(backends.run(call)[0], backends.BACKENDS.get("eager")(call)[0], rtol=1e-5,
                                   atol=1e-6)
