"""BART (Lewis et al. 2020) and Marian (Junczys-Dowmunt et al. 2018; the opus-mt models) as transformers'
BartForConditionalGeneration and MarianMTModel: post-norm encoder-decoders (EncoderDecoderLM) with LayerNorm
after every sublayer and none at the end of either stack, biases everywhere, scaled dot-product attention, one
embedding `shared` by both stacks and the head, and `final_logits_bias` added to the logits (a buffer in
transformers: bias.head_buffer, loaded and saved, not counted). Each stack has its own absolute positions
(position.per_stack):

  BART    learned, rows shifted by 2 (BartLearnedPositionalEmbedding: learned_offset 2), an embedding
          LayerNorm per stack (`layernorm_embedding`), embeddings unscaled (scale_embedding false in bart-*)
  Marian  static sinusoids, not interleaved (all sines, then all cosines: sinusoid_layout "split"), held as a
          frozen (max_position_embeddings, d) table that transformers counts (sinusoid_table); embeddings
          scaled by sqrt(d); no embedding norm

Positions: transformers counts them 0..t-1 whatever the padding; archlab counts them over each row's real
tokens, so right-padded rows (what both tokenizers make) agree exactly, left-padded rows do not. Marian's
sinusoid table is a function of the config: it is computed at load (checkpoints may lack it: transformers
ignores it when missing) and not written by save_hf (transformers recomputes it); a stored table is compared with
it. The copies `encoder.embed_tokens` / `decoder.embed_tokens` of `shared` are dropped when equal to it; a copy that
differs (transformers would use it) is refused, naming it.
"""
from __future__ import annotations

from typing import Any

import torch

from archlab.config import (
    Activation,
    AttentionConfig,
    BiasConfig,
    BlockConfig,
    MLPConfig,
    ModelConfig,
    NormConfig,
    PositionConfig,
)
from archlab.interop.families.base import Family, HFConfig, StoredCopy, register_family
from archlab.interop.families.tables import Rule, attention, layers, renames
from archlab.nn.position import sinusoid_table

# transformers' activation_function (ACT2FN names) -> ours, and back
ACT: dict[str, Activation] = {"gelu": "gelu", "relu": "relu", "swish": "silu", "silu": "silu",
                              "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
ACT_BACK = {"gelu": "gelu", "relu": "relu", "silu": "swish", "gelu_tanh": "gelu_new"}
BART_OFFSET = 2   # BartLearnedPositionalEmbedding


class _BartLike(Family):
    arch = "encoder_decoder"
    base_prefix = "model."        # model.shared, model.encoder, model.decoder; lm_head, final_logits_bias on top
    sinusoidal = False            # Marian: static split sinusoids; BART: learned, offset 2

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        c.unsupported("is_encoder_decoder", lambda v: v is False, why="a decoder alone (ForCausalLM)")
        layers, heads, ffn = c.require("encoder_layers"), c.require("encoder_attention_heads"), c.require(
            "encoder_ffn_dim")
        c.only("decoder_attention_heads", [heads], heads)
        c.only("decoder_ffn_dim", [ffn], ffn)
        act = c.only("activation_function", list(ACT), "gelu")
        dropout = float(c.get("dropout", 0.1))
        decoder_layers = c.get("decoder_layers", layers)
        d = c.require("d_model")
        vocab = c.require("vocab_size")
        if self.sinusoidal:
            c.only("share_encoder_decoder_embeddings", [True], True)
            c.only("decoder_vocab_size", [vocab], vocab)
            position = PositionConfig(kind="sinusoidal", sinusoid_layout="split", sinusoid_table=True,
                                      per_stack=True)
        else:
            position = PositionConfig(kind="learned", learned_offset=BART_OFFSET, per_stack=True)
        return ModelConfig(
            name=f"hf-{self.model_type}", arch="encoder_decoder", vocab_size=vocab, d_model=d, n_layers=layers,
            decoder_layers=None if decoder_layers == layers else decoder_layers,
            max_seq_len=c.require("max_position_embeddings"),
            attention=AttentionConfig(n_heads=heads, dropout=float(c.get("attention_dropout", 0.0))),
            mlp=MLPConfig(activation=ACT[act], d_ff=ffn),
            norm=NormConfig(kind="layernorm", eps=1e-5, position="post", final_norm=False,
                            embedding_norm=not self.sinusoidal),
            position=position,
            bias=BiasConfig(qkv=True, attn_out=True, mlp=True, norm=True, head=True, head_buffer=True),
            block=BlockConfig(residual_dropout=dropout), embedding_dropout=dropout,
            tie_embeddings=bool(c.get("tie_word_embeddings", True)),
            scale_embeddings=bool(c.get("scale_embedding", False)),
            decoder_start_token_id=c.get("decoder_start_token_id", c.get("pad_token_id", 0)),
        )

    def from_config(self, cfg: ModelConfig) -> dict:
        req = self.require
        req(cfg, "arch", "encoder_decoder")
        req(cfg, "norm.kind", "layernorm")
        req(cfg, "norm.eps", 1e-5)
        req(cfg, "norm.position", "post")
        req(cfg, "norm.final_norm", False)
        req(cfg, "norm.embedding_norm", not self.sinusoidal)
        req(cfg, "position.per_stack", True)
        if self.sinusoidal:
            req(cfg, "position.kind", "sinusoidal")
            req(cfg, "position.sinusoid_layout", "split")
            req(cfg, "position.sinusoid_table", True)
        else:
            req(cfg, "position.kind", "learned")
            req(cfg, "position.learned_offset", BART_OFFSET)
        req(cfg, "mlp.activation", list(ACT_BACK))
        req(cfg, "attention.n_kv_heads", [None, cfg.attention.n_heads])
        req(cfg, "attention.head_dim", [None, cfg.d_model // cfg.attention.n_heads])
        req(cfg, "attention.qk_norm", "none")
        req(cfg, "attention.sparse", "none")
        for key in ("bias.qkv", "bias.attn_out", "bias.mlp", "bias.norm", "bias.head", "bias.head_buffer"):
            req(cfg, key, True)
        for key in ("block.parallel", "attention.gated", "attention.learned_sinks", "attention.scale_by_inverse_layer",
                    "bias.qk_norm"):
            req(cfg, key, False)
        for key in ("attention.window", "attention.logit_softcap", "attention.clip_qkv", "final_logit_softcap",
                    "position.global_kind", "mlp.moe", "logit_scale", "attention.query_pre_attn_scalar"):
            req(cfg, key, None)
        hf = self.base_hf(cfg)
        dec = cfg.stack_depth("cross_decoder")
        hf.update(
            d_model=cfg.d_model, encoder_layers=cfg.n_layers, decoder_layers=dec,
            encoder_attention_heads=cfg.attention.n_heads, decoder_attention_heads=cfg.attention.n_heads,
            encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, activation_function=ACT_BACK[cfg.mlp.activation],
            max_position_embeddings=cfg.max_seq_len, scale_embedding=cfg.scale_embeddings,
            dropout=float(cfg.block.residual_dropout), attention_dropout=float(cfg.attention.dropout),
            activation_dropout=0.0, is_encoder_decoder=True, decoder_start_token_id=cfg.decoder_start_token_id,
            init_std=float(cfg.init.std), num_hidden_layers=cfg.n_layers,
        )
        if self.sinusoidal:
            # Marian starts the decoder with its pad id (MarianConfig's default 58100 would not fit a smaller vocab)
            hf.update(share_encoder_decoder_embeddings=True, decoder_vocab_size=cfg.vocab_size,
                      static_position_embeddings=True, pad_token_id=cfg.decoder_start_token_id)
        return hf

    def ignored_hf(self, cfg: ModelConfig) -> list[str]:
        return []

    def stored_copies(self, cfg: ModelConfig) -> list[StoredCopy]:
        """The head's copy (as every family), each stack's `embed_tokens` (tied to `shared` in transformers) and,
        for Marian, each stack's sinusoid table (computed here; transformers loads a stored one)."""
        copies = super().stored_copies(cfg) + [
            StoredCopy(f"model.{side}.embed_tokens.weight", "model.shared.weight",
                       why="archlab's encoder-decoder has one embedding for both stacks and a tied head")
            for side in ("encoder", "decoder")]
        if self.sinusoidal:
            table = lambda: sinusoid_table(cfg.max_seq_len, cfg.d_model, "split")  # noqa: E731
            copies += [StoredCopy(f"model.{side}.embed_positions.weight", compute=table,
                                  why="archlab computes the sinusoids from config.json")
                       for side in ("encoder", "decoder")]
        return copies

    def _table_rule(self, cfg: ModelConfig, ours: str) -> Rule:
        """Marian's frozen sinusoid table from the config alone (nothing read, nothing written)."""
        def compute(_: Any) -> list[torch.Tensor]:
            return [sinusoid_table(cfg.max_seq_len, cfg.d_model, "split")]
        return Rule((ours,), (), compute, lambda _: [])

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        """BART's learned positions and embedding norms, Marian's computed sinusoids: each model has one kind."""
        rules = [Rule(("head_bias",), ("final_logits_bias",), lambda ts: [ts[0].reshape(-1)],
                      lambda ts: [ts[0].reshape(1, -1)])]
        table = {"model.shared": "embed"}
        for side, i, pos, emb_norm in (("encoder", "{i}", "abs_position", "embed_norm"),
                                       ("decoder", "{j}", "decoder_abs_position", "decoder_embed_norm")):
            s = f"model.{side}."
            rules.append(self._table_rule(cfg, f"{pos}.table"))
            table |= {f"{s}embed_positions": f"{pos}.embedding", f"{s}layernorm_embedding": emb_norm}
            layer = attention("self_attn.", "q_proj k_proj v_proj out_proj") | {
                "self_attn_layer_norm": "attn_norm", "fc1": "mlp.up_proj", "fc2": "mlp.down_proj",
                "final_layer_norm": "mlp_norm"}
            if side == "decoder":
                layer |= attention("encoder_attn.", "q_proj k_proj v_proj out_proj", "cross_attn.")
                layer["encoder_attn_layer_norm"] = "cross_norm"
            table |= layers(layer, f"{s}layers.{i}.", f"{side}.{i}.")
        return rules + renames({"lm_head": "lm_head"}, "weight") + renames(table, "weight", "bias")


@register_family
class BartFamily(_BartLike):
    model_type = "bart"
    architecture = "BartForConditionalGeneration"
    save_priority = 10


@register_family
class MarianFamily(_BartLike):
    model_type = "marian"
    architecture = "MarianMTModel"
    save_priority = 10
    sinusoidal = True
