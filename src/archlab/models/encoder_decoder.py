"""EncoderDecoderLM: one token embedding -> TransformerStack("encoder") (with its final norm), the output handed as
a Context to TransformerStack("cross_decoder") (with the final norm) -> next-token head (nn/heads.LMHead).
The 2017 Transformer (Vaswani et al.) and T5 (Raffel et al. 2020) are configurations of it
(`arch="encoder_decoder"`): the same blocks, norms, MLPs and attention kernels as the other two kinds, each
decoder layer with a cross-attention sublayer (the same Attention, keys and values from the encoder's output,
projected once per Context).

    enc = embed(input_ids) -> encoder blocks (bidirectional, key padding from attention_mask) -> encoder norm
    dec = embed(decoder_input_ids) -> decoder blocks (causal self-attn; cross-attn to enc) -> final norm
    logits = head(dec)      tied to the embedding or not; T5 v1.0 rescales by d**-0.5 first (logit_scale)

One embedding serves the encoder, the decoder and a tied head (T5's `shared`); with position.per_stack (BART,
Marian) the decoder has its own absolute positions (`decoder_abs_position`) and embedding norm
(`decoder_embed_norm`), the encoder keeps the model's `abs_position` / `embed_norm`. bias.head_buffer holds the
head bias as a buffer (transformers' final_logits_bias: not trained, not counted). With T5 positions each stack
owns one relative-bias table (the encoder's buckets bidirectional, the decoder's causal); cross-attention has
no position signal. Training: `loss(input_ids, labels)` feeds the decoder `labels` shifted right behind the
decoder start token (T5: 0, its pad id), as transformers' `_shift_right`.
"""
from __future__ import annotations

import torch
from torch import nn

from archlab.config import ConfigError, ModelConfig
from archlab.models.decoder import LossOutput, next_token_loss
from archlab.nn.block import Block
from archlab.nn.embedding import Embedder, init_weights
from archlab.nn.fused import DecodeSession, PlannedDecode, call
from archlab.nn.heads import LMHead
from archlab.nn.masks import Context
from archlab.nn.stack import TransformerStack

__all__ = ["EncoderDecoderLM", "shift_right"]


def shift_right(labels: torch.Tensor, start_token_id: int, ignore_index: int = -100,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(b, t) labels -> (b, t) decoder inputs: the start token, then labels[:, :-1]; ignored slots (-100) read as
    the start token (transformers puts the pad id there, which T5's start token is). Packed targets
    (`document_ids` (b, t)): each document starts with the start token, as it would alone."""
    shifted = labels.new_full(labels.shape, start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    if document_ids is not None:
        shifted[:, 1:].masked_fill_(document_ids[:, 1:] != document_ids[:, :-1], start_token_id)
    return shifted.masked_fill(shifted == ignore_index, start_token_id)


class EncoderDecoderLM(Embedder, PlannedDecode, nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        cfg = self.config = config
        if cfg.arch != "encoder_decoder":
            raise ConfigError(f"arch={cfg.arch!r}: EncoderDecoderLM needs arch='encoder_decoder'")
        self.build_embedder(cfg, two_stacks=True)     # `embed`: encoder, decoder and a tied head share it
        self.encoder = TransformerStack(cfg, "encoder")          # bidirectional T5 buckets, its final norm
        self.decoder = TransformerStack(cfg, "cross_decoder")    # causal T5 buckets, the final norm
        self.lm_head = LMHead(cfg, self.embed)
        init_weights(self, cfg)

    @property
    def blocks(self) -> tuple[Block, ...]:
        """Every block, the encoder's then the decoder's: what activation checkpointing and FSDP wrap one by one."""
        return (*self.encoder, *self.decoder)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               document_ids: torch.Tensor | None = None) -> Context:
        """(b, s) source ids (attention_mask (b, s): 1 = real token; document_ids (b, s): packed sources) -> the
        Context the decoder attends to: the encoder's normed output, its positions, padding and documents. Run
        once per source; each cross-attention layer projects its keys and values from it once (a generation's
        decode steps reuse them)."""
        inputs = self.encoder.inputs(input_ids, attention_mask=attention_mask, document_ids=document_ids)
        x = self.embed_tokens(input_ids, inputs.positions)                   # (b, s, d)
        x = self.encoder(x, inputs)                                          # (b, s, d), normed
        return Context(x, inputs.positions, inputs.spec)   # the encoder's spec: bidirectional, its padding

    def decode(self, decoder_input_ids: torch.Tensor, context: Context,
               decoder_attention_mask: torch.Tensor | None = None, return_hidden: bool = False, *,
               cache=None, session: DecodeSession | None = None, document_ids: torch.Tensor | None = None
               ) -> torch.Tensor:
        """(b, t) decoder ids attending to `context` -> (b, t, v) logits, or (b, t, d) final hidden states.
        cache: the decoder's self-attention KV cache (archlab.nn.kv_cache, one layer per decoder layer): the ids
        continue the tokens it holds (unpadded rows of one length); session: a decode loop's DecodeSession;
        document_ids (b, t): packed targets, each attending to its own document and to the source document of
        the same id (the context's documents)."""
        context = context.for_targets(document_ids)
        inputs = self.decoder.inputs(decoder_input_ids, attention_mask=decoder_attention_mask,
                                     document_ids=document_ids, cache=cache, session=session)
        x = self.embed_tokens(decoder_input_ids, inputs.positions, decoder=True, session=session)   # (b, t, d)
        x = call(self.decoder, session)(x, inputs, context)                  # (b, t, d), normed
        return x if return_hidden else call(self.lm_head, session)(x, session)

    def forward(
        self,
        input_ids: torch.Tensor,                              # (b, s) source ids
        decoder_input_ids: torch.Tensor | None = None,        # (b, t); None: `targets` shifted right
        attention_mask: torch.Tensor | None = None,           # (b, s) 1 = real source token, 0 = padding
        decoder_attention_mask: torch.Tensor | None = None,   # (b, t) the same for the decoder's inputs
        return_hidden: bool = False,
        targets: torch.Tensor | None = None,                  # (b, t) labels: return the LossOutput instead
        document_ids: torch.Tensor | None = None,             # (b, s) packed sources (-1 padding)
        decoder_document_ids: torch.Tensor | None = None,     # (b, t) their targets: document i reads source i
    ) -> torch.Tensor | LossOutput:                           # (b, t, v) logits, or (b, t, d) hidden
        if decoder_input_ids is None:
            if targets is None:
                raise ValueError("EncoderDecoderLM needs decoder_input_ids (or targets to shift right)")
            decoder_input_ids = shift_right(targets, self.config.decoder_start_token_id,
                                            document_ids=decoder_document_ids)
        context = self.encode(input_ids, attention_mask, document_ids)
        hidden = self.decode(decoder_input_ids, context, decoder_attention_mask, return_hidden=True,
                             document_ids=decoder_document_ids)
        if return_hidden:
            return hidden
        if targets is not None:   # through forward, so DDP/FSDP/compile wrappers see the whole step
            return self.loss_from_hidden(hidden, targets)
        return self.lm_head(hidden)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, decoder_input_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
             ignore_index: int = -100, document_ids: torch.Tensor | None = None,
             decoder_document_ids: torch.Tensor | None = None) -> LossOutput:
        """Cross-entropy of the decoder's predictions against `labels` (b, t) (ignore_index where unscored), the
        decoder fed `decoder_input_ids`, by default the labels shifted right behind the start token (teacher
        forcing). Example: model.loss(source_ids, target_ids)"""
        if decoder_input_ids is None:
            decoder_input_ids = shift_right(labels, self.config.decoder_start_token_id, ignore_index,
                                            decoder_document_ids)
        hidden = self(input_ids, decoder_input_ids, attention_mask, decoder_attention_mask, return_hidden=True,
                      document_ids=document_ids, decoder_document_ids=decoder_document_ids)
        return self.loss_from_hidden(hidden, labels, ignore_index)

    def loss_from_hidden(self, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> LossOutput:
        return next_token_loss(self, self.lm_head, hidden, targets, ignore_index)

    def num_params(self) -> int:
        """Unique parameters (the shared embedding, and a head tied to it, count once)."""
        return sum(p.numel() for p in self.parameters())
