"""MoE done properly (nn/mlp.MoEMLP): the balance loss counts real tokens only and equals transformers' Mixtral
`load_balancing_loss_func` with an attention mask; packed documents give the statistics their separate rows
would; expert capacity (Switch) drops the overflow, and DeepSeek-V3's expert bias chooses without weighing and
moves by +-gamma, all checked on hand-computed routings."""
from __future__ import annotations

import pytest
import torch

from archlab.config import AttentionConfig, ConfigError, MLPConfig, ModelConfig, MoEConfig
from archlab.models.decoder import TransformerLM
from archlab.nn.mlp import MoEMLP

N_EXPERTS, TOP_K = 4, 2


def moe_model(n_layers: int = 1, **moe) -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=53, d_model=16, n_layers=n_layers, max_seq_len=32,
                      attention=AttentionConfig(n_heads=2),
                      mlp=MLPConfig(d_ff=24, moe=MoEConfig(**({
                          "n_experts": N_EXPERTS, "top_k": TOP_K, "aux_loss_coef": 1.0, "router_z_loss_coef": 0.0,
                      } | moe))))
    return TransformerLM(cfg).eval()


def router_logits(model: TransformerLM, ids: torch.Tensor, **forward_kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(aux loss, each MoE layer's (b*t, n) router logits) of one forward."""
    seen: list[torch.Tensor] = []
    hooks = [m.router.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
             for m in model.modules() if isinstance(m, MoEMLP)]
    with torch.no_grad():
        out = model.loss(ids, ids, **forward_kw)
    for h in hooks:
        h.remove()
    return out.aux_loss, seen


@pytest.mark.parametrize("n_layers", [1, 2])
def test_balance_loss_equals_transformers_mixtral_with_attention_mask(n_layers):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    model = moe_model(n_layers)
    ids = torch.randint(0, 53, (3, 10))
    documents = torch.tensor([[0] * 10, [0] * 6 + [-1] * 4, [0] * 3 + [1] * 4 + [-1] * 3])   # padding: -1
    aux, logits = router_logits(model, ids, document_ids=documents)
    real = (documents >= 0).long()
    # transformers pools its layers into one loss; archlab adds each layer's (Switch, Megatron): per layer equal
    expected = sum(load_balancing_loss_func((g,), N_EXPERTS, TOP_K, attention_mask=real) for g in logits)
    torch.testing.assert_close(aux, expected)
    unmasked = sum(load_balancing_loss_func((g,), N_EXPERTS, TOP_K) for g in logits)
    assert not torch.allclose(aux, unmasked)       # the padding would have counted: the mask matters here
    aux_plain, plain_logits = router_logits(model, ids)
    torch.testing.assert_close(aux_plain, sum(load_balancing_loss_func((g,), N_EXPERTS, TOP_K) for g in plain_logits))


def test_padding_content_and_packing_do_not_change_the_statistics():
    """Two documents packed in one row give the aux loss and expert load of the same documents one per padded
    row: each token's router input stays in its document, and padding counts nowhere."""
    model = moe_model(2, router_z_loss_coef=0.1)
    a, b = torch.randint(0, 53, (3,)), torch.randint(0, 53, (5,))
    packed = torch.cat([a, b, torch.tensor([7, 7])])[None]                                   # (1, 10)
    packed_docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, -1, -1]])
    rows = torch.stack([torch.cat([a, torch.full((7,), 11)]), torch.cat([b, torch.full((5,), 13)])])   # (2, 10)
    row_docs = torch.tensor([[0] * 3 + [-1] * 7, [0] * 5 + [-1] * 5])
    aux_packed, _ = router_logits(model, packed, document_ids=packed_docs)
    loads_packed = [m.load for m in model.modules() if isinstance(m, MoEMLP)]
    aux_rows, _ = router_logits(model, rows, document_ids=row_docs)
    loads_rows = [m.load for m in model.modules() if isinstance(m, MoEMLP)]
    torch.testing.assert_close(aux_packed, aux_rows)
    for p, r in zip(loads_packed, loads_rows):
        torch.testing.assert_close(p, r)
        torch.testing.assert_close(p.sum(), torch.tensor(1.0))


def routed_layer(top_k: int, capacity_factor: float | None, **moe) -> MoEMLP:
    """2 experts, d_model 2, router = identity: a token [s, 0] prefers expert 0, [0, s] expert 1."""
    torch.manual_seed(0)
    layer = MoEMLP(2, 3, MLPConfig(activation="silu", moe=MoEConfig(
        n_experts=2, top_k=top_k, capacity_factor=capacity_factor, normalize_top_k=False, **moe)), bias=False)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(2))
    return layer


# tokens 0-3 prefer expert 0, token 4 expert 1
X = torch.tensor([[[2.0, 0.0], [3.0, 0.0], [1.0, 0.0], [4.0, 0.0], [0.0, 2.0]]])           # (1, 5, 2)


def expected(layer: MoEMLP, kept: dict[int, list[int]]) -> torch.Tensor:
    """Sum over each token's kept experts of p_e * E_e(x) (p: the router softmax; no renormalization)."""
    flat = X[0]
    probs = layer.router(flat).softmax(-1)
    out = torch.zeros_like(flat)
    for token, experts in kept.items():
        for e in experts:
            out[token] += probs[token, e] * layer.experts[e](flat[token][None])[0]
    return out[None]


def test_capacity_top1_drops_the_overflow_in_token_order():
    # capacity = ceil(5 tokens x 1 / 2 experts x 1.0) = 3: expert 0 keeps tokens 0, 1, 2; token 3 passes through
    layer = routed_layer(1, 1.0)
    assert layer.capacity(5) == 3
    with torch.no_grad():
        out = layer(X)
        torch.testing.assert_close(out, expected(layer, {0: [0], 1: [0], 2: [0], 4: [1]}))
        assert out[0, 3].abs().sum() == 0
        torch.testing.assert_close(routed_layer(1, None)(X), expected(layer, {t: [0] for t in range(4)} | {4: [1]}))


def test_capacity_top2_serves_first_choices_before_second_ones():
    # capacity = ceil(5 x 2 / 2 x 0.5) = 3 slots per expert. Expert 0: first choices of tokens 0-3 -> keeps 0, 1, 2
    # (token 3's and token 4's second choice dropped). Expert 1: token 4's first choice, then the second choices
    # of tokens 0 and 1 (those of tokens 2 and 3 dropped).
    layer = routed_layer(2, 0.5)
    assert layer.capacity(5) == 3
    with torch.no_grad():
        out = layer(X)
        torch.testing.assert_close(out, expected(layer, {0: [0, 1], 1: [0, 1], 2: [0], 4: [1]}))


def test_padding_takes_no_capacity():
    # token 1 is padding: 4 real tokens, capacity = ceil(4 x 1 / 2 x 1.0) = 2; expert 0 keeps tokens 0 and 2
    layer = routed_layer(1, 1.0)
    real = torch.tensor([[True, False, True, True, True]])
    with torch.no_grad():
        out = layer(X, real=real)
        torch.testing.assert_close(out, expected(layer, {0: [0], 2: [0], 4: [1]}))
        torch.testing.assert_close(layer.load, torch.tensor([0.75, 0.25]))   # routing counted before dropping


def test_a_large_capacity_changes_nothing_in_the_model():
    ids = torch.randint(0, 53, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(moe_model(2, capacity_factor=100.0)(ids), moe_model(2)(ids))


@pytest.mark.parametrize("value", [0, -1.5])
def test_capacity_factor_must_be_positive(value):
    cfg = moe_model().config
    with pytest.raises(ConfigError, match="mlp.moe.capacity_factor"):
        cfg.with_overrides({"mlp.moe.capacity_factor": value})


def test_load_fields_count_each_layers_top_k_choices_over_real_tokens():
    from archlab.models.decoder import moe_load_fields
    model = moe_model(2)
    ids = torch.randint(0, 53, (2, 7))
    documents = torch.tensor([[0] * 7, [0] * 4 + [-1] * 3])
    _, logits = router_logits(model, ids, document_ids=documents)
    real = (documents >= 0).flatten()
    fields = moe_load_fields(model)
    for row, g in zip(fields["moe/expert_fraction"], logits):
        chosen = g[real].topk(TOP_K, -1).indices                                    # (real tokens, k)
        counts = torch.bincount(chosen.flatten(), minlength=N_EXPERTS).float()
        torch.testing.assert_close(torch.tensor(row), counts / counts.sum(), atol=1e-4, rtol=0)
    assert fields["moe/max_expert_fraction"] == max(max(row) for row in fields["moe/expert_fraction"])
    assert moe_load_fields(torch.nn.Linear(2, 2)) == {}


def test_the_expert_bias_chooses_but_the_plain_probabilities_weigh():
    # top 1, bias [-0.8, 0]. probs p0 of the tokens [2,0], [3,0], [1,0], [4,0], [0,2]: 0.881, 0.953, 0.731, 0.982,
    # 0.119; p0 - 0.8 beats p1 = 1 - p0 only for tokens 1 (0.153 > 0.047) and 3 (0.182 > 0.018)
    layer = routed_layer(1, None, balance="bias")
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([-0.8, 0.0]))
        out = layer.eval()(X)
        torch.testing.assert_close(out, expected(layer, {0: [1], 1: [0], 2: [1], 3: [0], 4: [1]}))
    torch.testing.assert_close(layer.load, torch.tensor([0.4, 0.6]))
    assert layer.take_routed() is None                      # an eval forward counts nothing for the update


def test_without_a_bias_the_same_layer_routes_by_probability():
    layer = routed_layer(1, None, balance="bias")           # bias starts at zero: plain top-k
    with torch.no_grad():
        torch.testing.assert_close(layer.eval()(X), routed_layer(1, None)(X))


def test_the_bias_update_moves_each_expert_by_gamma_toward_the_mean_load():
    layer = routed_layer(1, None, balance="bias", bias_update_rate=0.01)
    layer.train()
    real = torch.tensor([[True, True, True, False, True]])   # token 3 is padding: it counts nowhere
    with torch.no_grad():
        layer(X, real=real)                                  # routed to expert 0: tokens 0, 1, 2; expert 1: token 4
        layer(X[:, 4:])                                      # a second micro-batch: token 4 again, to expert 1
    routed = layer.take_routed()
    torch.testing.assert_close(routed, torch.tensor([3.0, 2.0]))
    assert layer.take_routed() is None                       # taken: the count starts again
    layer.update_bias(routed)                                # mean 2.5: expert 0 overloaded, expert 1 under
    torch.testing.assert_close(layer.expert_bias, torch.tensor([-0.01, 0.01]))
    layer.update_bias(torch.tensor([2.0, 2.0]))              # at the mean: sign 0, no move
    torch.testing.assert_close(layer.expert_bias, torch.tensor([-0.01, 0.01]))


def test_the_balance_step_sums_the_ranks_counts_and_a_skipped_step_drops_them():
    from archlab.models.decoder import moe_balance_step
    model = moe_model(2, balance="bias", bias_update_rate=0.5).train()
    layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
    other_rank = torch.tensor([[0.0, 100.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ids = torch.randint(0, 53, (2, 6))
    model.loss(ids, ids)
    mine = torch.stack([m.routed.clone() for m in layers])  # (2 layers, 4): 24 routed slots each
    assert mine.sum(1).tolist() == [24.0, 24.0]
    moe_balance_step(model, reduce=lambda table: table + other_rank)
    for m, counts in zip(layers, mine + other_rank):
        torch.testing.assert_close(m.expert_bias, 0.5 * torch.sign(counts.mean() - counts))
    assert layers[0].expert_bias[1] == -0.5                 # the other rank's 100 slots overloaded expert 1
    before = [m.expert_bias.clone() for m in layers]
    model.loss(ids, ids)
    moe_balance_step(model, update=False)                    # a non-finite step: the counts go, the bias stays
    assert all(m.routed is None and torch.equal(m.expert_bias, b) for m, b in zip(layers, before))


def test_balance_bias_has_no_balance_loss_and_its_bias_is_in_the_state_dict():
    model = moe_model(1, balance="bias")
    ids = torch.randint(0, 53, (2, 6))
    aux, _ = router_logits(model, ids)
    assert float(aux) == 0.0                                 # aux_loss_coef 1.0 is the loss mode's; z-loss is 0
    assert any(k.endswith("mlp.expert_bias") for k in model.state_dict())
    assert not any("expert_bias" in k for k in moe_model(1).state_dict())


@pytest.mark.parametrize("key, value", [("mlp.moe.balance", "none"), ("mlp.moe.bias_update_rate", 0)])
def test_balance_settings_are_checked(key, value):
    with pytest.raises(ConfigError, match=key):
        moe_model().config.with_overrides({key: value})


def test_a_gated_shared_expert_is_counted_and_needs_a_shared_expert():
    from archlab.models.accounting import active_param_count, param_count
    model = moe_model(2, shared_expert_d_ff=8, shared_expert_gate=True)
    assert param_count(model.config) == sum(p.numel() for p in model.parameters())
    plain = moe_model(2, shared_expert_d_ff=8).config
    assert active_param_count(model.config) - active_param_count(plain) == 2 * 16   # one (1, d) gate per layer
    with pytest.raises(ConfigError, match="shared_expert_gate"):
        moe_model().config.with_overrides({"mlp.moe.shared_expert_gate": True})
