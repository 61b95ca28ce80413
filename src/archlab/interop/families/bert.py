"""BERT (Devlin et al. 2019) and RoBERTa (Liu et al. 2019) masked LMs: `BertForMaskedLM` and
`RobertaForMaskedLM` <-> archlab.EncoderLM (`arch="encoder"`). Post-norm LayerNorm with biases after
attention and after the MLP, an embedding LayerNorm, learned absolute positions, token-type
(segment) embeddings (`type_vocab_size`), biases everywhere, a plain MLP (`hidden_act`), and the MLM
head: dense + activation + LayerNorm, then a decoder tied to the token embedding with its own
vocabulary bias. No final norm.

Positions. BERT numbers every slot 0..t-1: equal to EncoderLM's default (the real tokens counted from
0) on the real tokens of right-padded rows, which is how BERT tokenizers pad (for left padding pass
`positions=arange(t)`). RoBERTa counts the tokens that are not `pad_token_id` starting at
`pad_token_id + 1` (2 in every published RoBERTa): `position.learned_offset = pad_token_id + 1`, and
the table's `max_position_embeddings` rows (514) hold `max_seq_len` (512) positions after the offset.
Both agree with EncoderLM on left and right padding provided the padded slots, and only they, hold
`pad_token_id` (transformers looks at the ids, archlab at `attention_mask`).

Next-sentence prediction: a config.json whose `architectures` names `BertForPreTraining` loads with
`nsp_head=True`, its pooler (`bert.pooler.dense.*`) and next-sentence classifier (`cls.seq_relationship.*`)
mapped, and an encoder with `nsp_head` saves as BertForPreTraining (RoBERTa has no NSP head: refused).

Checkpoint tensors read but not used: the `position_ids` / `token_type_ids` buffers older transformers saved,
and otherwise the pooler (`bert.pooler.*`, `roberta.pooler.*`: BertModel checkpoints carry it) and the next-
sentence head, so a bert-base-uncased checkpoint (its config.json says BertForMaskedLM; it stores both, and
LayerNorm weights under their TF names `gamma` / `beta`) loads as its masked LM. With tied embeddings the
decoder is the embedding and its bias `cls.predictions.bias` / `lm_head.bias`; the decoder's stored copies
(`cls.predictions.decoder.*`, `lm_head.decoder.*`) are dropped when equal, and otherwise used as transformers 5
uses them: a decoder weight of its own unties the head, a decoder bias of its own is the bias applied. Untied
(tie_word_embeddings=false), transformers 5 gives the decoder its own bias, which is the one applied: ours comes
from (and goes to) the decoder's bias; the head's `bias`, unused by transformers 5's forward, is read past and
written equal to it (its vocab_size entries are all that transformers counts beyond ours). A checkpoint without
the MLM head (BertModel, a classifier) is refused: the error names the missing `cls.predictions.*` tensors.

Not supported (ConfigError naming the field): `position_embedding_type` other than "absolute"
(relative_key / relative_key_query), `is_decoder` / `add_cross_attention` (BERT as a decoder),
an activation we do not have, `type_vocab_size` 0, and for RoBERTa a `hidden_act` other than "gelu"
(its head applies exact GeLU whatever `hidden_act` says; archlab's head applies the MLP's).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from archlab.config import AttentionConfig, BiasConfig, ConfigError, MLPConfig, ModelConfig, NormConfig, PositionConfig
from archlab.interop.families.base import Family, HFConfig, StoredCopy, register_family
from archlab.interop.families.gpt_neox import (
    PLAIN_ACT_BACK,
    plain_activation,
    require_plain_transformer,
)
from archlab.interop.families.tables import Rule, attention, layers, rename, renames


class _BertLike(Family):
    """What BERT and RoBERTa share; subclasses name their prefix, head and position convention."""

    arch = "encoder"
    ties_by_default = True
    head = ""                  # the MLM head's module ("cls.predictions." / "lm_head.")
    head_dense = ""            # its transform's dense and norm, under `head`
    head_norm = ""

    # ---- config ----------------------------------------------------------------------------
    def activation(self, c: HFConfig) -> str:
        return plain_activation(c, "hidden_act", "gelu")

    def offset(self, c: HFConfig) -> int:
        """position.learned_offset for this config.json."""
        return 0

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        c.only("position_embedding_type", ["absolute"], "absolute")
        c.unsupported("is_decoder", why="a causal BERT decoder (archlab reads the bidirectional encoder)")
        c.unsupported("add_cross_attention", why="encoder-decoder cross-attention")
        c.unsupported("type_vocab_size", lambda v: v < 1, "transformers needs at least one token type")
        types = int(c.get("type_vocab_size", 2))
        offset = self.offset(c)
        rows = c.get("max_position_embeddings", 512)
        if rows - offset < 1:
            raise c.error(f"max_position_embeddings={rows} leaves no position after the offset {offset} "
                          f"(pad_token_id + 1)")
        eps = float(c.get("layer_norm_eps", 1e-12))
        dropout = float(c.get("hidden_dropout_prob", 0.0))
        return self.model_config(
            c,
            arch="encoder",
            d_model=c.require("hidden_size"),
            n_layers=c.require("num_hidden_layers"),
            max_seq_len=rows - offset,
            attention=AttentionConfig(n_heads=c.require("num_attention_heads"),
                                      dropout=float(c.get("attention_probs_dropout_prob", 0.0))),
            mlp=MLPConfig(activation=self.activation(c), d_ff=c.require("intermediate_size")),
            norm=NormConfig(kind="layernorm", eps=eps, position="post", final_norm=False,
                            embedding_norm=True),
            block={"residual_dropout": dropout},
            position=PositionConfig(kind="learned", learned_offset=offset),
            bias=BiasConfig(qkv=True, attn_out=True, mlp=True, norm=True, head=True),
            type_vocab_size=types,
            embedding_dropout=dropout,
        )

    def from_config(self, cfg: ModelConfig) -> dict:
        req = self.require
        req(cfg, "arch", "encoder")
        require_plain_transformer(self, cfg)
        req(cfg, "norm.kind", "layernorm")
        req(cfg, "norm.position", "post")
        req(cfg, "norm.final_norm", False)
        req(cfg, "norm.embedding_norm", True)
        req(cfg, "block.parallel", False)
        req(cfg, "position.kind", "learned")
        req(cfg, "position.global_kind", None)
        req(cfg, "mlp.activation", self.activations())
        for key in ("bias.qkv", "bias.attn_out", "bias.mlp", "bias.norm", "bias.head"):
            req(cfg, key, True)
        for key in ("attention.window", "attention.clip_qkv", "logit_scale"):
            req(cfg, key, None)
        req(cfg, "attention.sparse", "none")
        req(cfg, "attention.qk_norm", "none")
        req(cfg, "attention.scale_by_inverse_layer", False)
        req(cfg, "attention.n_kv_heads", [None, cfg.attention.n_heads])
        req(cfg, "attention.head_dim", [None, cfg.d_model // cfg.attention.n_heads])
        if cfg.type_vocab_size < 1:
            raise self.cannot(cfg, "type_vocab_size", "at least 1 (transformers always has token types)")
        hf = self.base_hf(cfg)
        hf.update(
            hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.attention.n_heads, intermediate_size=cfg.d_ff,
            hidden_act=PLAIN_ACT_BACK[cfg.mlp.activation], layer_norm_eps=float(cfg.norm.eps),
            max_position_embeddings=cfg.max_seq_len + cfg.position.learned_offset,
            type_vocab_size=cfg.type_vocab_size, position_embedding_type="absolute",
            hidden_dropout_prob=float(cfg.block.residual_dropout),
            attention_probs_dropout_prob=float(cfg.attention.dropout),
            is_decoder=False, add_cross_attention=False,
        )
        return hf

    def activations(self) -> list[str]:
        return list(PLAIN_ACT_BACK)

    def cannot(self, cfg: ModelConfig, key: str, needs: str) -> ConfigError:
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        return ConfigError(f"HF family {self.model_type!r} cannot express {key}={value!r} (it needs {needs})")

    # ---- weights ---------------------------------------------------------------------------
    def hf_name(self, stored: str) -> str:
        """TF-era checkpoints (bert-base-uncased) name LayerNorm's weight and bias gamma and beta."""
        if stored.endswith("LayerNorm.gamma"):
            return stored.removesuffix("gamma") + "weight"
        if stored.endswith("LayerNorm.beta"):
            return stored.removesuffix("beta") + "bias"
        return stored

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        p, e, h = self.base_prefix, f"{self.base_prefix}embeddings.", self.head
        layer = {**attention("attention.", "self.query self.key self.value output.dense"),
                 "attention.output.LayerNorm": "attn_norm", "intermediate.dense": "mlp.up_proj",
                 "output.dense": "mlp.down_proj", "output.LayerNorm": "mlp_norm"}
        rules = renames({f"{e}word_embeddings": "embed", f"{e}position_embeddings": "abs_position.embedding",
                         f"{e}token_type_embeddings": "token_types", f"{e}LayerNorm": "embed_norm",
                         h + self.head_dense: "mlm_head.dense", h + self.head_norm: "mlm_head.norm",
                         f"{p}pooler.dense": "pooler", "cls.seq_relationship": "nsp_classifier",
                         **layers(layer, p + "encoder.layer.{i}.")}, "weight", "bias")
        if cfg.tie_embeddings:
            return rules + [rename("head_bias", f"{h}bias")]
        # transformers 5: an untied decoder has its own bias, the one its forward adds; the head's `bias` is
        # unused there (tied to the decoder's in transformers 4): written alike
        return rules + [rename("lm_head.weight", f"{h}decoder.weight"),
                        Rule(("head_bias",), (f"{h}decoder.bias", f"{h}bias"), lambda ts: [ts[0]],
                             lambda ts: [ts[0], ts[0].clone()])]

    def ignored_hf(self, cfg: ModelConfig) -> list[str]:
        p = self.base_prefix.replace(".", r"\.")
        ignored = [rf"{p}embeddings\.(position_ids|token_type_ids)"]
        if not cfg.nsp_head:
            ignored += [rf"{p}pooler\.dense\.(weight|bias)", r"cls\.seq_relationship\.(weight|bias)"]
        return ignored

    def stored_copies(self, cfg: ModelConfig) -> list[StoredCopy]:
        """Tied, transformers 5 ties the decoder to the embedding and its bias to the head's `bias`; a stored
        decoder weight that differs is a head of its own, a stored decoder bias that differs is the bias its
        forward adds (read in place of `bias`); an untied head without a stored decoder bias reads `bias`."""
        p, h = self.base_prefix, self.head
        bias = StoredCopy(f"{h}decoder.bias", f"{h}bias", on_difference="read_copy")
        if not cfg.tie_embeddings:
            return [bias]
        return [StoredCopy(f"{h}decoder.weight", f"{p}embeddings.word_embeddings.weight", on_difference="untie_head"),
                bias]


@register_family
class BertFamily(_BertLike):
    model_type = "bert"
    architecture = "BertForMaskedLM"
    base_prefix = "bert."
    head = "cls.predictions."
    head_dense = "transform.dense"
    head_norm = "transform.LayerNorm"
    pretraining = "BertForPreTraining"   # MLM + next-sentence heads (nsp_head)

    def to_config(self, hf: dict) -> ModelConfig:
        cfg = super().to_config(hf)
        return dataclasses.replace(cfg, nsp_head=self.pretraining in (hf.get("architectures") or []))

    def from_config(self, cfg: ModelConfig) -> dict:
        self.require(cfg, "position.learned_offset", 0)
        hf = super().from_config(cfg)
        hf["pad_token_id"] = 0   # BertConfig's default: only the embedding's padding_idx (no effect on logits)
        if cfg.nsp_head:
            hf["architectures"] = [self.pretraining]
        return hf


@register_family
class RobertaFamily(_BertLike):
    model_type = "roberta"
    architecture = "RobertaForMaskedLM"
    base_prefix = "roberta."
    head = "lm_head."
    head_dense = "dense"
    head_norm = "layer_norm"

    def activation(self, c: HFConfig) -> str:
        c.only("hidden_act", ["gelu"], "gelu")   # RobertaLMHead applies exact GeLU whatever hidden_act says
        return "gelu"

    def activations(self) -> list[str]:
        return ["gelu"]

    def offset(self, c: HFConfig) -> int:
        pad = c.get("pad_token_id", 1)
        if not isinstance(pad, int) or pad < 0:
            raise c.error(f"pad_token_id={pad!r}: RoBERTa's positions start at pad_token_id + 1, "
                          "which needs a token id >= 0")
        return pad + 1

    def from_config(self, cfg: ModelConfig) -> dict:
        self.require(cfg, "nsp_head", False)
        if cfg.position.learned_offset < 1:
            raise self.cannot(cfg, "position.learned_offset", "pad_token_id + 1 >= 1: positions start "
                              "past the padding row (2 in every published RoBERTa)")
        hf = super().from_config(cfg)
        hf["pad_token_id"] = cfg.position.learned_offset - 1
        return hf
