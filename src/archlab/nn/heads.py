"""The heads a model puts on its stack's normed hidden states, one small class each, and the losses they score:

    LMHead     (b, t, d) -> (b, t, v)   the token projection: its own matrix or the tied embedding's (Press & Wolf
                                        2017), a vocabulary bias, Cohere's logit scale, Gemma 2's soft-cap
    MLMHead    (b, t, d) -> (b, t, v)   BERT's masked-LM head: transform (dense, activation, norm), then an LMHead
    NSPHead    (b, t, d) -> (b, 2)      BERT's next-sentence head: pooler (dense + tanh) on the first slot, classifier
    ScoreHead  (b, t, d) -> (b,)        a reward model's scalar at each row's last real token; (b, t) at every
                                        token as PPO's value head (`values`)

A tied LMHead holds no matrix of its own: it reads the embedding it was given, which stays the model's child
(`embed.weight`), so a checkpoint holds the tensor once. Training losses are fused with the projection in row
chunks (nn/fused_loss.py: no (b, t, v) logits in memory).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from archlab.config import GATED_ACTIVATIONS, ModelConfig
from archlab.nn.fused import DecodeSession, head_linear
from archlab.nn.fused_loss import linear_cross_entropy
from archlab.nn.int8 import Int8Matrix, is_quantized
from archlab.nn.mlp import ACTIVATIONS
from archlab.nn.norms import build_norm

__all__ = ["LMHead", "LossOutput", "MLMHead", "NSPHead", "ScoreHead", "attach_score_head", "SCORE_HEAD", "VALUE_HEAD",
           "SCALAR_HEADS"]


@dataclass
class LossOutput:
    total: torch.Tensor     # what to backpropagate
    ce: torch.Tensor        # mean next-token cross-entropy (nats); no gradient on the fused path
    z_loss: torch.Tensor    # z_loss * mean(log Z)^2 (PaLM), already weighted
    aux_loss: torch.Tensor  # MoE load-balancing + router z-loss, already weighted
    accuracy: torch.Tensor | None = None   # share of scored slots whose argmax is the target (MLM evaluation)
    nsp_loss: torch.Tensor | None = None   # next-sentence cross-entropy (BERT pretraining), already in total
    nsp_accuracy: torch.Tensor | None = None   # share of rows whose next-sentence label is predicted (evaluation)


class LMHead(nn.Module):
    """logits = x W^T (+ b), W the head's (v, d) matrix or the tied token embedding; then * logit_scale (Cohere;
    T5 v1.0's d**-0.5 rescale) and cap * tanh(logits / cap) (Gemma 2). The bias is a buffer with
    bias.head_buffer (BART's final_logits_bias: not trained, not counted)."""

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding):
        super().__init__()
        # a tuple, not a child: a tied matrix stays `embed.weight`, held once
        self.tied: tuple[nn.Embedding, ...] = (embed,) if cfg.tie_embeddings else ()
        self.weight = None if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        self.int8: Int8Matrix | None = None   # an untied head's int8 rows (nn/int8.quantize_int8) in place of weight
        if cfg.bias.head_buffer:
            self.register_buffer("bias", torch.zeros(cfg.vocab_size))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.bias.head else None
        self.logit_scale, self.softcap, self.z_loss = cfg.logit_scale, cfg.final_logit_softcap, cfg.z_loss or 0.0

    @property
    def matrix(self) -> torch.Tensor:                                    # (v, d)
        if self.weight is not None:
            return self.weight
        if self.int8 is not None:
            return self.int8.weight                                      # dequantized
        # an embedding with trainable token rows (nn/trainable_tokens.py): the tied head reads the trained rows too
        effective = getattr(self.tied[0], "effective_weight", None)
        return self.tied[0].weight if effective is None else effective()

    def forward(self, x: torch.Tensor, session: DecodeSession | None = None) -> torch.Tensor:  # (b, t, d) -> (b, t, v)
        logits = head_linear(x, self, self._source(), self.bias, session)  # packed in a decode session
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.softcap is not None:
            logits = (self.softcap * torch.tanh(logits.float() / self.softcap)).to(logits.dtype)
        return logits

    def _source(self):
        """The matrix, or the int8 module whose rows it is (the tied embedding's or `int8`): decoding multiplies by
        the int8 rows' kernel form instead of dequantizing them."""
        if self.weight is not None:
            return self.weight
        rows = self.int8 if self.int8 is not None else self.tied[0]
        return rows if is_quantized(rows) else self.matrix

    def fused_loss(self, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(total, ce, z_loss) of hidden (n, d) against targets (n,), the projection fused with the cross-entropy
        (bias, logit scale and soft-cap as in forward)."""
        weight: torch.Tensor = self.matrix
        bias: torch.Tensor | None = self.bias
        if self.logit_scale is not None:               # scaling the logits = scaling W (and b)
            weight = weight * self.logit_scale
            bias = None if bias is None else bias * self.logit_scale
        return linear_cross_entropy(hidden, weight, targets, ignore_index, self.z_loss, bias=bias,
                                    softcap=self.softcap)

    def loss_from_logits(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ce, z_loss) of (b, t, v) logits against (b, t) targets: the unfused reference of fused_loss."""
        logits = logits.float()
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index)
        if not self.z_loss:
            return ce, logits.new_zeros(())
        log_z = torch.logsumexp(logits, dim=-1)[targets != ignore_index]
        return ce, self.z_loss * log_z.square().mean()


class MLMHead(nn.Module):
    """BERT's masked-LM head (Devlin et al. 2019): transform (dense + activation + norm), then the decoder (an
    LMHead, tied to the token embedding in BERT and RoBERTa, with its own vocabulary bias). The activation is the
    MLP's (BERT's `hidden_act`; GELU for a gated MLP). Scored on the labelled slots only (15% of the rows in
    BERT's recipe), so the (b, t, v) logits are never made in training."""

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding):
        super().__init__()
        act = cfg.mlp.activation
        self.act = ACTIVATIONS["gelu" if act in GATED_ACTIVATIONS else act]
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm = build_norm(cfg.norm.kind, cfg.d_model, cfg.norm.eps, cfg.bias.norm)
        self.decoder = LMHead(cfg, embed)

    def transform(self, x: torch.Tensor) -> torch.Tensor:           # (b, t, d) -> (b, t, d)
        return self.norm(self.act(self.dense(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:             # (b, t, d) -> (b, t, v)
        return self.decoder(self.transform(x))

    def labelled_logits(self, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (n, v), labels (n,)) of the n labelled slots of hidden (b, t, d) and labels (b, t)."""
        rows = labels.flatten() != ignore_index
        return self(hidden.flatten(0, 1)[rows]), labels.flatten()[rows]

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> LossOutput:
        """The MLM loss of hidden (b, t, d) against labels (b, t) (the original token at masked slots,
        ignore_index elsewhere); with no gradient, also the accuracy."""
        rows = labels.flatten() != ignore_index
        zero = hidden.sum() * 0.0
        if not bool(rows.any()):                 # nothing masked in this batch: no loss, gradients of zero
            return LossOutput(total=zero, ce=zero.detach(), z_loss=zero.detach(), aux_loss=zero.detach())
        if not torch.is_grad_enabled():          # evaluation: the labelled rows' logits are small; report accuracy
            logits, target = self.labelled_logits(hidden, labels, ignore_index)      # (n, v), (n,)
            ce = F.cross_entropy(logits.float(), target)
            accuracy = (logits.argmax(-1) == target).float().mean()
            return LossOutput(total=ce, ce=ce, z_loss=zero, aux_loss=zero, accuracy=accuracy)
        picked = self.transform(hidden.flatten(0, 1)[rows])                             # (n, d)
        total, ce, z_loss = self.decoder.fused_loss(picked, labels.flatten()[rows], ignore_index)
        return LossOutput(total=total, ce=ce, z_loss=z_loss, aux_loss=zero.detach())


class NSPHead(nn.Module):
    """BERT's next-sentence prediction (§3.1, task #2): a 2-way classifier (0 IsNext, 1 NotNext) on
    tanh(pooler(first slot)), the first slot being [CLS] in BERT's right-padded inputs."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model)
        self.classifier = nn.Linear(cfg.d_model, 2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:        # (b, t, d) -> (b, 2)
        return self.classifier(torch.tanh(self.pooler(hidden[:, 0])))

    def add_loss(self, out: LossOutput, hidden: torch.Tensor, labels: torch.Tensor) -> LossOutput:
        """`out` (the MLM loss) with the NSP cross-entropy of `labels` (b,) added to its total (BERT's
        pretraining loss is their sum) and reported as nsp_loss."""
        logits, labels = self(hidden).float(), labels.to(hidden.device)                  # (b, 2), (b,)
        nsp = F.cross_entropy(logits, labels)
        accuracy = None if torch.is_grad_enabled() else (logits.argmax(-1) == labels).float().mean()
        return dataclasses.replace(out, total=out.total + nsp, nsp_loss=nsp.detach(), nsp_accuracy=accuracy)


SCORE_HEAD = "score_head"      # the attribute, and the prefix of its state-dict keys
VALUE_HEAD = "value_head"      # a PPO policy's value head: a ScoreHead read at every token
SCALAR_HEADS = (SCORE_HEAD, VALUE_HEAD)    # the heads a checkpoint may add to a model (runs.model_folder)


class ScoreHead(nn.Module):
    """A scalar per sequence from a decoder's normed hidden state at its last real token: a reward model's head
    (Ouyang et al. 2022, as HF's *ForSequenceClassification with one label: `score`, no bias). Starts at zero, so
    every reward is 0 and a Bradley-Terry loss starts at ln 2."""

    def __init__(self, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, d_model))

    def forward(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:   # (b, t, d), (b,) -> (b,)
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths.to(hidden.device) - 1]   # (b, d)
        return F.linear(last.float(), self.weight.float()).squeeze(-1)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:                          # (b, t, d) -> (b, t)
        """The scalar at every position (float32): a value head reads the state before each token (PPO)."""
        return F.linear(hidden.float(), self.weight.float()).squeeze(-1)


def attach_score_head(model: nn.Module, name: str = SCORE_HEAD) -> ScoreHead:
    """Put a ScoreHead (zeros) on `model` as `name` (a reward model's `score_head`, PPO's `value_head`; its keys
    `<name>.weight`), or return the one it has.
    Example: rewards = attach_score_head(model)(model(ids, return_hidden=True), lengths)"""
    head = getattr(model, name, None)
    if head is None:
        weight = next(model.parameters())
        config: ModelConfig = model.config                                  # type: ignore[assignment]
        head = ScoreHead(config.d_model).to(weight.device)
        setattr(model, name, head)
    return head
