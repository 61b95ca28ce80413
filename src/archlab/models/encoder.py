"""EncoderLM: embedder -> TransformerStack("encoder") (its final norm included) -> masked-LM head (nn/heads).
BERT (Devlin et al. 2019) and RoBERTa (Liu et al. 2019) are configurations of it (`arch="encoder"`): the same
blocks, norms, MLPs and attention kernels as the decoder-only LM, with bidirectional attention over the real tokens.
With `nsp_head`, BERT's next-sentence prediction (§3.1, task #2) sits beside the MLM head: a pooler
(dense + tanh) on the first slot's hidden state ([CLS]) and a 2-way classifier (0 IsNext, 1 NotNext).

Padding: `attention_mask` (b, t), 1 for a real token. Padded keys are never attended; positions count the
real tokens of each row from 0 (padded slots get -1), so left- and right-padded rows embed alike. That is
RoBERTa's convention (positions from the non-pad tokens, offset 2); BERT's checkpoints number every slot, which
agrees on the real tokens of right-padded rows (BERT tokenizers pad on the right). Packed documents:
`document_ids` (b, t); positions count from 0 in each document, and no token sees another's.
"""
from __future__ import annotations

import torch
from torch import nn

from archlab.config import ConfigError, ModelConfig
from archlab.nn.embedding import Embedder, init_weights
from archlab.nn.heads import LossOutput, MLMHead, NSPHead
from archlab.nn.stack import TransformerStack, padded_positions

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
        self.blocks = TransformerStack(cfg, "encoder")     # bidirectional; its T5 table and final norm
        self.mlm_head = MLMHead(cfg, self.embed)
        self.nsp_head = NSPHead(cfg) if cfg.nsp_head else None
        init_weights(self, cfg)

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
        x = self.blocks(x, inputs)                                    # (b, t, d), normed
        if return_hidden:
            return x
        if targets is not None:   # through forward, so DDP/FSDP/compile wrappers see the whole step
            out = self.mlm_head.loss(x, targets)
            return out if next_sentence_labels is None else self._nsp().add_loss(out, x, next_sentence_labels)
        return self.mlm_head(x)                                       # (b, t, v)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
             token_type_ids: torch.Tensor | None = None, ignore_index: int = -100) -> LossOutput:
        """Masked-LM cross-entropy: `labels` (b, t) hold the original token at masked slots and ignore_index
        elsewhere (archlab.data.objectives.mask_tokens makes both)."""
        hidden = self(input_ids, attention_mask, token_type_ids, return_hidden=True)   # (b, t, d)
        return self.mlm_head.loss(hidden, labels, ignore_index)

    def _nsp(self) -> NSPHead:
        if self.nsp_head is None:
            raise ValueError("this encoder has no next-sentence head: build it with nsp_head=True")
        return self.nsp_head

    def next_sentence_logits(self, hidden: torch.Tensor) -> torch.Tensor:   # (b, t, d) -> (b, 2)
        """BERT's NSP logits from the final hidden states. Example: model.next_sentence_logits(model(ids,
        return_hidden=True))"""
        return self._nsp()(hidden)

    def num_params(self) -> int:
        """Unique parameters (a tied decoder counts once)."""
        return sum(p.numel() for p in self.parameters())
