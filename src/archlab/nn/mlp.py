"""Feed-forward layers: plain MLPs, the GLU family and mixture of experts.

Plain:  y = W2 act(W1 x)                                  ReLU (Vaswani 2017), GeLU (Hendrycks &
        Gimpel 2016; GPT), squared ReLU (So et al. 2021, Primer; Nemotron-4), SiLU, ELU (Clevert et
        al. 2015: x > 0 ? x : e^x - 1), SELU (Klambauer et al. 2017: lambda ELU_alpha, self-normalizing).
Gated:  y = W2 (act(W_gate x) * W_up x)                   ReGLU, GeGLU, SwiGLU (Shazeer 2020,
        arXiv 2002.05202); GLU with the original sigmoid gate (Dauphin et al. 2017) and the bilinear
        layer with no gate function (Mnih & Hinton 2007), both in Shazeer 2020's table.
        Gemma's GeGLU uses the tanh approximation of GeLU.
MoE:    y = sum_{i in topk(router(x))} p_i E_i(x)         (Shazeer 2017; Switch, Fedus 2021;
        Mixtral). Load-balancing aux loss (Switch) and router z-loss (ST-MoE, Zoph 2022), over real tokens;
        expert capacity with token dropping (Switch); or auxiliary-loss-free balancing (DeepSeek-V3; Wang et
        al. 2024): topk(p + b) chooses, p weighs, and b_i += gamma sign(mean load - load_i) after each step.
Shapes: b batch, t time, d model, f ffn width, n experts.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from archlab.config import GATED_ACTIVATIONS, MLPConfig
from archlab.nn.fused import (
    DecodePlan,
    DecodeSession,
    decode_weights,
    linear,
    packed_groups,
    packed_matmul,
    packed_split,
    project,
)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu2": lambda x: F.relu(x).square(),
    "silu": F.silu,
    "elu": F.elu,                       # alpha 1
    "selu": F.selu,                     # lambda 1.0507..., alpha 1.6733... (Klambauer et al. 2017)
    # the gated kinds name the function applied to the gate branch
    "reglu": F.relu,
    "geglu": F.gelu,
    "geglu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "swiglu": F.silu,
    "glu": torch.sigmoid,               # Dauphin et al. 2017: sigmoid(x W) * x V
    "bilinear": lambda x: x,            # (x W) * (x V): no function on the gate
}


def mark_residual_out(linear: nn.Linear) -> nn.Linear:
    """Flag a Linear that writes into the residual stream: init.scaled_residual (GPT-2) scales its init."""
    linear.is_residual_out = True  # type: ignore[assignment]  # a plain attribute the init reads
    return linear


class DenseMLP(nn.Module):
    """up -> act -> down, or for GLU kinds: act(gate) * up -> down."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool):
        super().__init__()
        self.activation = activation
        self.act: Callable[[torch.Tensor], torch.Tensor] = ACTIVATIONS[activation]
        self.gated = activation in GATED_ACTIVATIONS
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias) if self.gated else None
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        mark_residual_out(self.down_proj)  # scaled init (GPT-2) applies here

    def forward(self, x: torch.Tensor, session: DecodeSession | None = None) -> torch.Tensor:  # (b, t, d) -> same
        """session: a decode loop's (nn/fused), whose packed weights a decode step multiplies by."""
        packs = decode_weights(session, x, self, self._decode_weights)   # decoding: (up, down) packed, one lookup
        gate_proj = self.gate_proj
        if gate_proj is not None:
            gate, up = (project(x, (gate_proj, self.up_proj), session) if packs is None
                        else packed_split(x, packs[0]))                 # (b, t, f) each
            h = self.act(gate) * up
        else:
            h = self.act(linear(x, self.up_proj, session) if packs is None else packed_matmul(x, packs[0]))
        return linear(h, self.down_proj, session) if packs is None else packed_matmul(h, packs[1])

    def _decode_weights(self, x: torch.Tensor, plan: DecodePlan):
        """(gate/up packed, down packed) for decoding (nn/fused.py), or None: hooks or autocast to honour."""
        ups = (self.up_proj,) if self.gate_proj is None else (self.gate_proj, self.up_proj)
        return packed_groups(plan, x, ups, (self.down_proj,))


class MoEMLP(nn.Module):
    """Top-k routed experts, each a DenseMLP; an optional always-on shared expert.

    After each forward `aux_loss` holds this layer's weighted load-balancing + router z-loss, which
    TransformerLM.loss adds to the objective, and `load` its (n,) fraction of routed slots per expert, both over
    the real tokens only (`real`: padding and the padded tail of packed documents never count; every statistic
    is per token, so packed documents need nothing else). With `capacity_factor` an expert takes at most
    `capacity` slots, first choices before second ones and earlier tokens first (Switch); the rest get no
    expert output (the block's residual carries them).
    With `balance="bias"` (DeepSeek-V3) the persistent buffer `expert_bias` (n,) is added to the routing
    probabilities to choose the top k only (the gate weights stay the plain probabilities), there is no balance
    loss, and training forwards count routed slots per expert until `take_routed()`; `update_bias` then moves
    the bias (models.decoder.moe_balance_step does both after each optimizer step). The bias is part of the
    state dict, so checkpoints hold it and a resumed run continues it exactly.
    Example: y = MoEMLP(64, 128, cfg.mlp, bias=False)(x, real=inputs.real_tokens())
    """

    def __init__(self, d_model: int, d_ff: int, cfg: MLPConfig, bias: bool):
        super().__init__()
        moe = cfg.moe
        assert moe is not None, "MoEMLP needs mlp.moe"
        self.top_k, self.normalize = moe.top_k, moe.normalize_top_k
        self.aux_coef = moe.aux_loss_coef if moe.balance == "loss" else 0.0   # the bias replaces the loss
        self.z_coef = moe.router_z_loss_coef
        self.bias_update_rate = moe.bias_update_rate if moe.balance == "bias" else None
        self.capacity_factor = moe.capacity_factor
        self.router = nn.Linear(d_model, moe.n_experts, bias=False)
        self.experts = nn.ModuleList(
            DenseMLP(d_model, d_ff, cfg.activation, bias) for _ in range(moe.n_experts)
        )
        self.shared_expert = (
            DenseMLP(d_model, moe.shared_expert_d_ff, cfg.activation, bias)
            if moe.shared_expert_d_ff else None
        )
        # Qwen2-MoE: one sigmoid gate per token on the shared expert's output
        self.shared_expert_gate = nn.Linear(d_model, 1, bias=False) if moe.shared_expert_gate else None
        self.aux_loss = torch.zeros(())
        self.load = torch.zeros(moe.n_experts)
        self.expert_bias: torch.Tensor | None      # (n,), a persistent buffer with balance=bias (else None: none)
        self.register_buffer("expert_bias", torch.zeros(moe.n_experts) if self.bias_update_rate is not None else None)
        # routed slots per expert over real tokens since take_routed(): a plain tensor, not a buffer, so that
        # DDP's buffer broadcast leaves each rank's own count alone
        self.routed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, session: DecodeSession | None = None,
                real: torch.Tensor | None = None) -> torch.Tensor:          # (b, t, d) -> same
        """real: (b, t) or (1, t) bool, True on real tokens (AttnInputs.real_tokens()); None: all are real."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        mask = None if real is None else real.expand(b, t).reshape(b * t)   # (bt,) bool
        logits = self.router(flat).float()                     # (bt, n)
        probs = logits.softmax(-1)
        weights, chosen = self.route(probs)                   # (bt, k) each
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        kept = self._kept(chosen, mask)                        # (bt, k) bool: the slots an expert computes
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.where((chosen == e) & kept)
            if token_idx.numel() == 0:
                continue
            y = expert(flat[token_idx], session) * weights[token_idx, slot, None].to(flat.dtype)
            out.index_add_(0, token_idx, y)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat, session)                         # (bt, d)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared  # (bt, 1) gate per token
            out = out + shared
        self.aux_loss = self._aux_loss(logits, probs, chosen, mask)
        return out.reshape(b, t, d)

    def route(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate weights, chosen experts), (bt, k) each: the top k of probs, or with an expert bias the top k of
        probs + bias, weighted by their plain probabilities (DeepSeek-V3: the bias only chooses)."""
        if self.expert_bias is None:
            return probs.topk(self.top_k, dim=-1)
        chosen = (probs + self.expert_bias.float()).topk(self.top_k, dim=-1).indices      # (bt, k)
        return probs.gather(-1, chosen), chosen

    def take_routed(self) -> torch.Tensor | None:
        """(n,) routed slots per expert over real tokens counted by training forwards since the last call (then
        reset), or None: no bias to update, or no training forward since. Recompute (activation checkpointing)
        counts a forward twice, which scales every expert alike and leaves the update's signs as they are."""
        routed, self.routed = self.routed, None
        return routed

    @torch.no_grad()
    def update_bias(self, routed: torch.Tensor) -> None:
        """DeepSeek-V3's update, b_i += gamma * sign(mean_j c_j - c_i) for the (n,) routed counts c: an overloaded
        expert's bias falls by gamma, an underloaded one's rises, one exactly at the mean stays.
        Example: counts [6, 2, 0, 0] (mean 2), gamma 0.001 -> bias += [-0.001, 0, +0.001, +0.001]"""
        assert self.expert_bias is not None and self.bias_update_rate is not None, "update_bias needs balance=bias"
        routed = routed.to(self.expert_bias.device, torch.float32)
        step = torch.sign(routed.mean() - routed) * self.bias_update_rate
        self.expert_bias.add_(step.to(self.expert_bias.dtype))

    def capacity(self, n_real: int) -> int | None:
        """Slots per expert for a batch of n_real real tokens: ceil(n_real x top_k / n_experts x capacity_factor),
        Switch's tokens_per_batch / n_experts x capacity_factor at top_k = 1; None without a capacity factor.
        Example: capacity(10) with 4 experts, top_k 1, capacity_factor 1.0 -> 3"""
        if self.capacity_factor is None:
            return None
        return math.ceil(n_real * self.top_k / len(self.experts) * self.capacity_factor)

    def _kept(self, chosen: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """(bt, k) bool: the routed slots that fit their expert's capacity (all slots without a capacity factor);
        with one, padding takes no capacity and gets no expert output. Priority: slot 0 of every token, then
        slot 1, ...; within a slot, token order."""
        if self.capacity_factor is None:
            return torch.ones_like(chosen, dtype=torch.bool)
        real = torch.ones_like(chosen[:, 0], dtype=torch.bool) if mask is None else mask    # (bt,)
        kept = real[:, None].expand_as(chosen)                                             # (bt, k)
        cap = self.capacity(int(real.sum()))                                               # a host sync
        assert cap is not None
        onehot = F.one_hot(chosen, len(self.experts)) * kept[..., None]                    # (bt, k, n)
        order = onehot.transpose(0, 1).reshape(-1, onehot.shape[-1])                       # (k*bt, n) by priority
        rank = (order.cumsum(0) - 1).reshape(onehot.shape[1], onehot.shape[0], -1)         # (k, bt, n)
        rank = rank.transpose(0, 1).gather(-1, chosen[..., None]).squeeze(-1)              # (bt, k)
        return kept & (rank < cap)

    def _aux_loss(self, logits: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """Switch's balance n * sum_i f_i * P_i with f_i = routed slots to expert i per real token (top_k at
        perfect balance, transformers' Mixtral load_balancing_loss_func with an attention mask, one layer's
        logits) and P_i its mean router probability; plus the router z-loss, both over real tokens only.
        Also sets `load`, f / top_k."""
        n = probs.shape[-1]
        w = torch.ones_like(probs[:, 0]) if mask is None else mask.to(probs.dtype)         # (bt,)
        count = w.sum().clamp_min(1)
        routed = F.one_hot(chosen, n).to(probs.dtype).sum(1)                               # (bt, n)
        fraction = (routed * w[:, None]).sum(0) / count                                    # (n,)
        balance = n * (fraction * (probs * w[:, None]).sum(0) / count).sum()
        z = (torch.logsumexp(logits, -1).square() * w).sum() / count
        self.load = (fraction / self.top_k).detach()
        if self.expert_bias is not None and self.training:
            counts = (routed * w[:, None]).sum(0).detach()                                # (n,)
            self.routed = counts if self.routed is None else self.routed + counts
        return self.aux_coef * balance + self.z_coef * z


def build_mlp(d_model: int, cfg: MLPConfig, bias: bool) -> nn.Module:
    d_ff = cfg.width(d_model)
    if cfg.moe is not None:
        return MoEMLP(d_model, d_ff, cfg, bias)
    return DenseMLP(d_model, d_ff, cfg.activation, bias)
