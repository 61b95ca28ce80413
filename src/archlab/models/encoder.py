"""EncoderLM: embedder -> TransformerStack("encoder") -> (final norm) -> masked-LM head. BERT (Devlin et al.
2019) and RoBERTa (Liu et al. 2019) are configurations of it (`arch="encoder"`): the same blocks, norms,
MLPs and attention kernels as the decoder-only LM, with bidirectional attention over the real tokens.
With `nsp_head`, BERT's next-sentence prediction (§3.1, task #2) sits beside the MLM head: a pooler
(dense + tanh) on the first slot's hidden state ([CLS]) and a 2-way classifier (0 IsNext, 1 NotNext).

Padding: `attention_mask` (b, t), 1 for a real token. Padded keys are never attended; positions count the
real tokens of each row from 0 (padded slots get -1), so left- and right-padded rows embed alike. That is
RoBERTa's convention (positions from the non-pad tokens, offset 2); BERT's checkpoints number every slot, which
agrees on the real tokens of right-padded rows (BERT tokenizers pad on the right). Packed documents:
`document_ids` (b, t); positions count from 0 in each document, and no token sees another's.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from archlab.config import ConfigError, ModelConfig
from archlab.models.decoder import LossOutput
from archlab.nn.embedding import Embedder, MLMHead, init_weights
from archlab.nn.fused_loss import linear_cross_entropy
from archlab.nn.norms import build_norm
from archlab.nn.stack import TransformerStack, padded_positions, stack_t5_table

__all__ = ["EncoderLM", "padded_positions"]


class EncoderLM(Embedder, nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        cfg = self.config = config
        if cfg.arch != "encoder":
            raise ConfigError(f"arch={cfg.arch!r}: EncoderLM needs arch='encoder'")
        if cfg.logit_scale is not None or cfg.final_logit_softcap is not None or cfg.mlp.moe is not None:
            raise ConfigError("logit_scale, final_logit_softcap and mlp.moe are decoder switches: "
                              "the MLM head does not apply them")
        self.build_embedder(cfg)
        self.t5_bias = stack_t5_table(cfg, "encoder")    # bidirectional buckets (None without T5 positions)
        self.blocks = TransformerStack(cfg, "encoder", self.t5_bias)
        self.final_norm = (build_norm(cfg.norm.kind, cfg.d_model, cfg.norm.eps, cfg.bias.norm)
                           if cfg.norm.final_norm else None)
        self.mlm_head = MLMHead(cfg)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab_size)) if cfg.bias.head else None
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model) if cfg.nsp_head else None
        self.nsp_classifier = nn.Linear(cfg.d_model, 2) if cfg.nsp_head else None
        init_weights(self, cfg)

    @property
    def head_weight(self) -> torch.Tensor:  # (v, d): the MLM decoder, or the embedding when tied
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,                         # (b, t) int
        attention_mask: torch.Tensor | None = None,      # (b, t) 1 = real token, 0 = padding
        token_type_ids: torch.Tensor | None = None,      # (b, t) BERT's segments A/B
        positions: torch.Tensor | None = None,           # (b, t); None: from attention_mask (padded_positions)
        return_hidden: bool = False,
        targets: torch.Tensor | None = None,             # (b, t) MLM labels: return the LossOutput instead
        next_sentence_labels: torch.Tensor | None = None,   # (b,) 0 IsNext / 1 NotNext: NSP loss added (nsp_head)
        document_ids: torch.Tensor | None = None,        # (b, t) packed documents (-1 padding): positions restart
                                                         # at each, no token sees another document
    ) -> torch.Tensor | LossOutput:                      # (b, t, v) logits, or (b, t, d) hidden
        if next_sentence_labels is not None and targets is None:
            raise ValueError("next_sentence_labels are scored beside the MLM loss: pass targets too")
        inputs = self.blocks.inputs(input_ids, positions=positions, attention_mask=attention_mask,
                                    document_ids=document_ids)
        x = self.embed_tokens(input_ids, inputs.positions, token_type_ids)         # (b, t, d)
        x = self.blocks(x, inputs)                                    # (b, t, d)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if return_hidden:
            return x
        if targets is not None:   # through forward, so DDP/FSDP/compile wrappers see the whole step
            out = self.loss_from_hidden(x, targets)
            return out if next_sentence_labels is None else self.add_next_sentence_loss(out, x, next_sentence_labels)
        owner = self if self.lm_head is None else self.lm_head
        return self.mlm_head(x, owner, self.head_weight, self.head_bias)   # (b, t, v)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
             token_type_ids: torch.Tensor | None = None, ignore_index: int = -100) -> LossOutput:
        """Masked-LM cross-entropy: `labels` (b, t) hold the original token at masked slots and ignore_index
        elsewhere (archlab.data.objectives.mask_tokens makes both)."""
        hidden = self(input_ids, attention_mask, token_type_ids, return_hidden=True)   # (b, t, d)
        return self.loss_from_hidden(hidden, labels, ignore_index)

    def next_sentence_logits(self, hidden: torch.Tensor) -> torch.Tensor:   # (b, t, d) -> (b, 2)
        """BERT's NSP logits from the final hidden states: the classifier on tanh(pooler(first slot)), the first
        slot being [CLS] in BERT's right-padded inputs.
        Example: model.next_sentence_logits(model(ids, return_hidden=True))"""
        if self.pooler is None or self.nsp_classifier is None:
            raise ValueError("this encoder has no next-sentence head: build it with nsp_head=True")
        return self.nsp_classifier(torch.tanh(self.pooler(hidden[:, 0])))

    def add_next_sentence_loss(self, out: LossOutput, hidden: torch.Tensor, labels: torch.Tensor) -> LossOutput:
        """`out` (the MLM loss) with the NSP cross-entropy of `labels` (b,) added to its total (BERT's
        pretraining loss is their sum) and reported as nsp_loss."""
        logits, labels = self.next_sentence_logits(hidden).float(), labels.to(hidden.device)     # (b, 2), (b,)
        nsp = F.cross_entropy(logits, labels)
        accuracy = None if torch.is_grad_enabled() else (logits.argmax(-1) == labels).float().mean()
        return dataclasses.replace(out, total=out.total + nsp, nsp_loss=nsp.detach(), nsp_accuracy=accuracy)

    def labelled_logits(self, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits (n, v), labels (n,)) of the n labelled slots only: 15% of the rows in BERT's recipe, so the
        head's (b, t, v) logits are never made."""
        rows = labels.flatten() != ignore_index
        picked = hidden.flatten(0, 1)[rows]                                            # (n, d)
        owner = self if self.lm_head is None else self.lm_head
        return self.mlm_head(picked, owner, self.head_weight, self.head_bias), labels.flatten()[rows]

    def loss_from_hidden(self, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> LossOutput:
        """The MLM loss from the final hidden states, scored on the labelled rows only (their transform and head
        fused with the cross-entropy in row chunks, nn/fused_loss.py)."""
        rows = labels.flatten() != ignore_index
        zero = hidden.sum() * 0.0
        if not bool(rows.any()):                 # nothing masked in this batch: no loss, gradients of zero
            return LossOutput(total=zero, ce=zero.detach(), z_loss=zero.detach(), aux_loss=zero.detach())
        if not torch.is_grad_enabled():          # evaluation: the labelled rows' logits are small; report accuracy
            logits, target = self.labelled_logits(hidden, labels, ignore_index)      # (n, v), (n,)
            ce = F.cross_entropy(logits.float(), target)
            accuracy = (logits.argmax(-1) == target).float().mean()
            return LossOutput(total=ce, ce=ce, z_loss=zero, aux_loss=zero, accuracy=accuracy)
        picked = self.mlm_head.transform(hidden.flatten(0, 1)[rows])                   # (n, d)
        total, ce, z_loss = linear_cross_entropy(picked, self.head_weight, labels.flatten()[rows],
                                                 ignore_index, self.config.z_loss or 0.0, bias=self.head_bias)
        return LossOutput(total=total, ce=ce, z_loss=z_loss, aux_loss=zero.detach())

    def num_params(self) -> int:
        """Unique parameters (a tied decoder counts once)."""
        return sum(p.numel() for p in self.parameters())
