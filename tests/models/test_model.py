"""TransformerLM over every switch: causality, shapes, dtypes, gradients, and the claims behind them."""
import math

import pytest
import torch
from variants import BASE, VARIANTS, variant

from archlab import ModelConfig, TransformerLM
from archlab.nn.kv_cache import StaticKVCache
from archlab.nn.masks import MaskSpec
from archlab.nn.position import RotaryEmbedding, T5RelativeBias, alibi_slopes

NAMES = sorted(VARIANTS)


def build(cfg: ModelConfig) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    with torch.no_grad():  # move norms and biases off their init so wiring bugs show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("name", NAMES)
def test_future_tokens_do_not_change_past_logits(name):
    model = build(variant(name))
    ids = torch.randint(0, BASE.vocab_size, (2, 12))
    changed = ids.clone()
    changed[:, 7:] = torch.randint(0, BASE.vocab_size, (2, 5))
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("name", NAMES)
def test_shapes_dtypes_and_gradients_reach_every_parameter(name):
    cfg = variant(name)
    model = build(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    logits = model(ids)
    assert logits.shape == (2, 10, cfg.vocab_size) and logits.dtype == torch.float32
    out = model.loss(ids[:, :-1], ids[:, 1:])
    assert torch.isfinite(out.total)
    out.total.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient reaches {missing}"
    with torch.no_grad():
        half = model.to(torch.bfloat16)(ids)
    assert half.dtype == torch.bfloat16 and torch.isfinite(half.float()).all()


@pytest.mark.parametrize("name", ["base", "gqa", "window", "pos-alibi", "pos-t5", "local-global",
                                  "gated-attention", "qk-norm-full"])
def test_sdpa_path_equals_eager_reference(name):
    model = build(variant(name))
    ids = torch.randint(0, BASE.vocab_size, (2, 11))
    with torch.no_grad():
        fast = model(ids)
        for block in model.blocks:
            block.attn.record_probs = True   # forces the eager path
        eager = model(ids)
    torch.testing.assert_close(fast, eager, rtol=1e-5, atol=1e-5)


def test_gqa_with_full_kv_heads_equals_mha():
    mha = BASE
    gqa = BASE.with_overrides({"attention.n_kv_heads": BASE.attention.n_heads})
    torch.testing.assert_close(build(mha)(torch.arange(9)[None]), build(gqa)(torch.arange(9)[None]))


def test_gqa_equals_mha_with_repeated_kv_weights():
    """Each group of query heads shares one kv head: MHA with those k/v rows repeated is the same."""
    gqa_model = build(variant("gqa"))
    mha_model = build(BASE)
    groups = BASE.attention.n_heads // 2
    e = BASE.head_dim
    state = gqa_model.state_dict()
    for key, value in list(state.items()):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            state[key] = value.view(2, e, -1).repeat_interleave(groups, 0).reshape(-1, value.shape[-1])
    mha_model.load_state_dict(state)
    ids = torch.randint(0, BASE.vocab_size, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(gqa_model(ids), mha_model(ids))


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_scores_depend_only_on_offset(layout, fraction):
    cfg = BASE.with_overrides({"position.rope_layout": layout, "position.rotary_fraction": fraction})
    rope = RotaryEmbedding(cfg, cfg.layer_spec(0))
    q, k = torch.randn(1, 1, 1, cfg.head_dim), torch.randn(1, 1, 1, cfg.head_dim)

    def score(m, n):
        qm = rope.rotate(q, torch.tensor([[m]]))
        kn = rope.rotate(k, torch.tensor([[n]]))
        return (qm * kn).sum()

    torch.testing.assert_close(score(5, 2), score(40, 37), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(score(3, 3), score(0, 0), rtol=1e-4, atol=1e-5)
    assert not torch.isclose(score(5, 2), score(5, 4))
    # rotation preserves the norm of each vector
    torch.testing.assert_close(rope.rotate(q, torch.tensor([[17]])).norm(), q.norm())


def test_rope_half_layout_hand_computed():
    cfg = BASE.with_overrides({"d_model": 8, "attention.n_heads": 2, "position.rope_theta": 100.0})
    rope = RotaryEmbedding(cfg, cfg.layer_spec(0))
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])[None, None, None]
    out = rope.rotate(x, torch.tensor([[1]]))[0, 0, 0]
    # pairs (0, 2) at angle 1 and (1, 3) at angle 1/10 (theta^(-2/4) = 0.1)
    expected = torch.tensor([
        1 * math.cos(1) - 3 * math.sin(1), 2 * math.cos(0.1) - 4 * math.sin(0.1),
        3 * math.cos(1) + 1 * math.sin(1), 4 * math.cos(0.1) + 2 * math.sin(0.1),
    ])
    torch.testing.assert_close(out, expected)


def test_sliding_window_mask_is_exact():
    pos = torch.arange(6)[None]
    mask = MaskSpec().with_window(3).allows(pos, pos)[0, 0]
    expected = torch.tensor([[1 if 0 <= q - k < 3 else 0 for k in range(6)] for q in range(6)]).bool()
    assert torch.equal(mask, expected)


def test_sliding_window_receptive_field_in_one_layer():
    """With one layer and window w, token 0 influences exactly positions 0..w-1."""
    cfg = BASE.with_overrides({"n_layers": 1, "attention.window": 4})
    model = build(cfg)
    ids = torch.randint(1, BASE.vocab_size, (1, 12))
    changed = ids.clone()
    changed[0, 0] = 0
    with torch.no_grad():
        diff = (model(ids) - model(changed)).abs().amax(-1)[0]
    assert (diff[:4] > 0).all() and (diff[4:] == 0).all()


def test_prefix_lm_is_bidirectional_inside_the_prefix_only():
    cfg = BASE.with_overrides({"attention.prefix_lm": True})
    model = build(cfg)
    ids = torch.randint(0, BASE.vocab_size, (1, 10))
    changed = ids.clone()
    changed[0, 3] = (ids[0, 3] + 1) % BASE.vocab_size
    prefix = torch.tensor([5])
    with torch.no_grad():
        a = model(ids, prefix_lengths=prefix)
        b = model(changed, prefix_lengths=prefix)
    assert (a[0, :3] - b[0, :3]).abs().amax() > 0      # earlier prefix tokens see token 3
    changed_late = ids.clone()
    changed_late[0, 7] = (ids[0, 7] + 1) % BASE.vocab_size
    with torch.no_grad():
        c = model(changed_late, prefix_lengths=prefix)
    torch.testing.assert_close(a[0, :7], c[0, :7])     # but nothing sees past the prefix


def test_alibi_slopes_follow_press_et_al():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # 12 heads: the 8-head slopes, then every other slope of the 16-head series
    expected = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + j) for j in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected))


def test_t5_buckets_exact_then_logarithmic():
    table = T5RelativeBias(BASE.with_overrides({"position.kind": "t5"}))
    buckets = table.bucket(torch.tensor([0, 1, 15, 16, 127, 128, 10_000]))
    assert buckets[:3].tolist() == [0, 1, 15]
    assert 16 <= buckets[3] < buckets[4] <= 31 and buckets[5] == buckets[6] == 31


def test_z_loss_hand_computed():
    cfg = BASE.with_overrides({"z_loss": 1e-2})
    model = build(cfg)
    ids = torch.randint(0, BASE.vocab_size, (2, 6))
    with torch.no_grad():
        logits = model(ids)
        out = model.loss_from_logits(logits, ids)
    expected = 1e-2 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(out.z_loss, expected)
    torch.testing.assert_close(out.total, out.ce + expected)


def test_moe_aux_loss_is_switch_balance_and_reaches_total():
    model = build(variant("moe")).train()
    ids = torch.randint(0, BASE.vocab_size, (2, 8))
    out = model.loss(ids, ids)
    # Switch balance is >= 1 * coef (perfect balance); the router z-loss is positive
    assert out.aux_loss > 2 * 0.01 * 1.0 - 1e-6
    torch.testing.assert_close(out.total, out.ce + out.aux_loss)


def test_init_is_seeded_by_config_alone():
    torch.manual_seed(123)
    a = TransformerLM(BASE)
    torch.manual_seed(456)
    b = TransformerLM(BASE)
    c = TransformerLM(BASE.with_overrides({"seed": 1}))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed.weight, c.embed.weight)


def test_scaled_residual_init_shrinks_output_projections():
    cfg = BASE.with_overrides({"n_layers": 8, "init.scaled_residual": True, "d_model": 128})
    model = TransformerLM(cfg)
    std = model.blocks[0].attn.o_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(16)) < 0.001
    assert abs(model.blocks[0].attn.q_proj.weight.std().item() - 0.02) < 0.002


def test_learned_positions_past_the_table_raise_a_clear_error():
    model = build(variant("pos-learned"))
    with pytest.raises(ValueError, match="max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_padding_positions_do_not_leak():
    """A left-padded row gives the same logits on its real tokens as the unpadded row."""
    model = build(variant("gqa"))
    ids = torch.randint(1, BASE.vocab_size, (1, 6))
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), ids), 1)
    positions = torch.tensor([[-1, -1, -1, 0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(model(padded, positions=positions)[:, 3:], model(ids),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_t5_buckets_equal_transformers(bidirectional):
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    from archlab.nn.position import T5RelativeBias
    cfg = BASE.with_overrides({"position.kind": "t5"})
    table = T5RelativeBias(cfg, bidirectional=bidirectional)
    q = torch.arange(300)[:, None]
    k = torch.arange(300)[None, :]
    ours = table.bucket(q - k)
    theirs = t5.T5Attention._relative_position_bucket(k - q, bidirectional=bidirectional,
                                                       num_buckets=table.num_buckets, max_distance=table.max_distance)
    assert torch.equal(ours, theirs)
    if bidirectional:
        assert set(ours[0, 1:].tolist()) & set(ours[1:, 0].tolist()) == set()   # before / after: own halves


def test_alibi_is_symmetric_and_equals_the_causal_form_on_the_past():
    from archlab.nn.position import ALiBi
    cfg = BASE.with_overrides({"position.kind": "alibi"})
    alibi = ALiBi(cfg, cfg.layer_spec(0))
    pos = torch.arange(5)[None]
    bias = alibi.bias(pos, pos)[0]                                     # (h, 5, 5)
    m = alibi.slopes[:, None, None]
    distance = (torch.arange(5)[:, None] - torch.arange(5)[None, :]).float()
    torch.testing.assert_close(bias, -m * distance.abs())             # -m |i - j| (MosaicBERT)
    past = distance >= 0
    torch.testing.assert_close(bias[:, past], (-m * distance)[:, past])   # = Press et al.'s causal form


def test_mask_spec_compiles_to_no_mask_where_nothing_binds_and_to_the_predicate_elsewhere():
    pos = torch.arange(6)[None]
    assert MaskSpec().dense(pos, pos, plain=True) == (None, True)               # SDPA's is_causal
    assert MaskSpec(causal=False).dense(pos, pos, plain=True) == (None, False)  # full bidirectional
    mask, is_causal = MaskSpec(causal=False).with_window(3).dense(pos, pos, plain=True)
    expected = torch.tensor([[abs(q - k) <= 1 for k in range(6)] for q in range(6)])
    assert not is_causal and torch.equal(mask[0, 0], expected)              # symmetric window (1, 1)
    padding = torch.tensor([[True, True, True, True, False, False]])
    mask, _ = MaskSpec(key_padding=padding).dense(pos, pos, plain=True)
    assert not mask[0, 0, 5, 4] and mask[0, 0, 5, 3]
    segments = torch.tensor([[0, 0, 0, 1, 1, 1]])
    mask, _ = MaskSpec(segment_ids=segments).dense(pos, pos, plain=True)
    assert not mask[0, 0, 4, 2] and mask[0, 0, 4, 3] and not mask[0, 0, 3, 4]
    prefix = torch.tensor([3])
    mask, _ = MaskSpec(prefix_lengths=prefix).dense(pos, pos, plain=True)
    assert mask[0, 0, 0, 2] and not mask[0, 0, 0, 3] and not mask[0, 0, 3, 4]


def test_a_continued_decode_step_needs_no_mask_unless_a_window_binds(monkeypatch):
    """positions=None with a cache: each row continues its own unpadded keys, so one causal query sees them
    all (no mask, no host sync); a window or padding still goes through the predicate."""
    q, k = torch.tensor([[9], [9]]), torch.arange(10)[None].expand(2, 10)
    window_mask, _ = MaskSpec().with_window(4).dense(q, k, plain=False, continued=True)
    assert window_mask[0, 0, 0].tolist() == [False] * 6 + [True] * 4
    padding = torch.ones(2, 10, dtype=torch.bool)
    assert MaskSpec(key_padding=padding).dense(q, k, plain=False, continued=True)[0] is None   # all real
    monkeypatch.setattr(MaskSpec, "allows", lambda *a: (_ for _ in ()).throw(AssertionError("predicate ran")))
    assert MaskSpec().dense(q, k, plain=False, continued=True) == (None, False)


def test_decoding_unpadded_rows_with_implied_positions_equals_explicit_positions():
    model = TransformerLM(BASE).eval()
    ids = torch.randint(0, BASE.vocab_size, (2, 7))
    logits = {}
    for implied in (True, False):
        cache = StaticKVCache(BASE, 2, 7)
        with torch.no_grad():
            model(ids[:, :6], positions=None if implied else torch.arange(6)[None].expand(2, 6), cache=cache)
            logits[implied] = model(ids[:, 6:], positions=None if implied else torch.full((2, 1), 6), cache=cache)
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=0)


@pytest.mark.parametrize("extra", [{}, {"attention.window": 4, "attention.layer_pattern": "LG"}])
def test_training_and_eval_forwards_trace_as_one_graph(extra, monkeypatch):
    """torch.compile sees the whole step, float32 and bf16 autocast: the mask spec, the attention seam and
    the packed-weight switch add no graph break (a ContextVar or a data-dependent branch would), with the
    blocked window kernel too."""
    from archlab.nn.local_attention import BlockLocal
    monkeypatch.setattr(BlockLocal, "block", 4)       # 16 tokens, window 4: blocks chosen for the local layer
    cfg = ModelConfig().with_overrides({"vocab_size": 97, "d_model": 32, "n_layers": 2, "attention.n_heads": 4,
                                        "attention.n_kv_heads": 2, "mlp.activation": "swiglu", "max_seq_len": 32,
                                        **extra})
    model = TransformerLM(cfg)
    x, y = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    torch._dynamo.reset()
    train = torch._dynamo.explain(lambda a, b: model(a, targets=b).total)(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):     # the CPU bf16 kernel's probe stays outside the graph
        bf16 = torch._dynamo.explain(lambda a, b: model(a, targets=b).total)(x, y)
    model.eval()
    with torch.no_grad():
        infer = torch._dynamo.explain(lambda a: model(a))(x)
    breaks = (train.graph_break_count, bf16.graph_break_count, infer.graph_break_count)
    assert breaks == (0, 0, 0), (train.break_reasons, bf16.break_reasons, infer.break_reasons)


def _stack_outputs(role, cfg, x, positions):
    from archlab.nn.masks import AttnInputs
    from archlab.nn.stack import TransformerStack

    torch.manual_seed(0)
    stack = TransformerStack(cfg, role).eval()                  # its own T5 table (bidirectional as an encoder)
    return stack, stack(x, AttnInputs(positions, stack.mask_spec(), plain=True))


@pytest.mark.parametrize("pos", ["rope", "alibi", "t5", "none"])
def test_one_stack_serves_decoder_and_encoder_roles(pos):
    """The same stack class: as a decoder a token never sees the ones after it; as an encoder every
    token does; the encoder's SDPA and eager backends agree (a bidirectional call: no mask at all)."""
    from archlab.nn.attention_backends import forced

    cfg = ModelConfig().with_overrides({"d_model": 32, "n_layers": 2, "attention.n_heads": 4, "position.kind": pos,
                                        "mlp.d_ff": 64, "max_seq_len": 16})
    x = torch.randn(2, 6, 32)
    y = x.clone()
    y[:, -1] += 1.0                                                      # change only the last token
    positions = torch.arange(6)[None]
    with torch.no_grad():
        dec, a = _stack_outputs("decoder", cfg, x, positions)
        _, b = _stack_outputs("decoder", cfg, y, positions)
        enc, c = _stack_outputs("encoder", cfg, x, positions)
        _, d = _stack_outputs("encoder", cfg, y, positions)
        with forced("eager"):
            _, c_eager = _stack_outputs("encoder", cfg, x, positions)
    assert dec.causal and not enc.causal and [blk.attn.layer for blk in enc] == [0, 1]
    torch.testing.assert_close(a[:, :-1], b[:, :-1])                   # causal: earlier tokens unchanged
    assert (c[:, :-1] - d[:, :-1]).abs().max() > 1e-4                   # bidirectional: they change
    torch.testing.assert_close(c, c_eager, rtol=1e-5, atol=1e-5)


def test_the_lm_is_embedder_stack_head_with_its_old_state_dict_keys():
    from archlab.nn.stack import TransformerStack

    model = TransformerLM(ModelConfig().with_overrides({"d_model": 32, "n_layers": 2, "attention.n_heads": 4,
                                                        "vocab_size": 50, "max_seq_len": 16}))
    assert isinstance(model.blocks, TransformerStack) and model.blocks.role == "decoder"
    keys = set(model.state_dict())
    assert {"embed.weight", "blocks.0.attn.q_proj.weight", "blocks.1.mlp.down_proj.weight"} <= keys
    assert not any(k.startswith(("stack.", "embedder.")) for k in keys)
    x = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        inputs = model.blocks.inputs(x)
        assert inputs.plain and inputs.positions.tolist() == [[0, 1, 2, 3, 4]]
        hidden = model.blocks(model.embed_tokens(x, inputs.positions), inputs)     # normed by the stack
        torch.testing.assert_close(model.lm_head(hidden), model(x))
