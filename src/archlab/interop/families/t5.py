"""T5 (Raffel et al. 2020) as transformers' T5ForConditionalGeneration: an encoder-decoder (EncoderDecoderLM)
with T5's LayerNorm (RMSNorm: no mean, no bias) before every sublayer and at the end of both stacks, unscaled
attention logits (query_pre_attn_scalar=1), one relative-bias table per stack (stored in layer 0 of each; the
encoder's buckets bidirectional), none on the cross-attention, no biases, one embedding `shared` by both stacks.

v1.0 (t5-small ... t5-11b): ReLU MLP `wi` / `wo`, the head tied to `shared` with the decoder output scaled by
d_model**-0.5 first (our logit_scale). v1.1 (google/t5-v1_1-*, flan-t5): gated-GeLU (`wi_0` the gate, `wi_1`
the up projection; "gated-gelu" means gelu_new, the tanh form), no rescale, a separate lm_head.

Tying: transformers 5 builds every T5 tied and moved the rescale to `scale_decoder_outputs` (it writes
`tie_word_embeddings: true` for all), untying the head at load time when the checkpoint holds an lm_head.weight
different from shared.weight; the loader does the same (Family.stored_copies). Configs written by transformers 4
say `tie_word_embeddings: false` for v1.1, which then also means no rescale. `save_hf` writes both fields.
Old checkpoints also store the copies `encoder.embed_tokens` / `decoder.embed_tokens`: dropped when equal to
`shared`, refused when not (transformers would embed each stack's tokens with its own; archlab has one embedding),
and a cross-attention bias table that transformers' class lacks (ignored).
"""
from __future__ import annotations

from archlab.config import Activation, AttentionConfig, BlockConfig, MLPConfig, ModelConfig, NormConfig, PositionConfig
from archlab.interop.families.base import Family, HFConfig, StoredCopy, register_family
from archlab.interop.families.tables import Rule, attention, layers, renames

# transformers' dense_act_fn (ACT2FN names) -> our activation, plain and gated
ACT: dict[str, Activation] = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                              "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}
GATED: dict[str, Activation] = {"relu": "reglu", "gelu": "geglu", "gelu_new": "geglu_tanh",
                                "gelu_pytorch_tanh": "geglu_tanh", "silu": "swiglu", "swish": "swiglu"}
ONE_EMBEDDING = "archlab's encoder-decoder has one embedding for both stacks and a tied head"
ACT_BACK = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu",
            "reglu": "relu", "geglu": "gelu", "geglu_tanh": "gelu_new", "swiglu": "silu"}


@register_family
class T5Family(Family):
    model_type = "t5"
    architecture = "T5ForConditionalGeneration"
    arch = "encoder_decoder"
    base_prefix = ""          # shared., encoder., decoder., lm_head. at the top level
    save_priority = 10
    config_unties = False     # T5Config sets tie_word_embeddings=True for every T5

    def to_config(self, hf: dict) -> ModelConfig:
        c = HFConfig(hf, self.model_type)
        c.unsupported("is_encoder_decoder", lambda v: v is False, why="a T5 encoder alone (T5EncoderModel)")
        proj = str(c.get("feed_forward_proj", "relu"))
        parts = proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise c.error(f"feed_forward_proj={proj!r} is neither 'ACT' nor 'gated-ACT'")
        act_fn = c.get("dense_act_fn", "gelu_new" if proj == "gated-gelu" else parts[-1])   # as T5Config
        gated = bool(c.get("is_gated_act", parts[0] == "gated"))
        table = GATED if gated else ACT
        if act_fn not in table:
            raise c.error(f"activation {act_fn!r} (feed_forward_proj={proj!r}) is not supported by archlab "
                          f"(supported: {', '.join(map(repr, table))})")
        d, layers = c.require("d_model"), c.require("num_layers")
        decoder_layers = c.get("num_decoder_layers", layers)
        tied = bool(c.get("tie_word_embeddings", True))
        scaled = bool(c.get("scale_decoder_outputs", tied))   # transformers 5 names the rescale apart
        dropout = float(c.get("dropout_rate", 0.1))
        return ModelConfig(
            name="hf-t5", arch="encoder_decoder",
            vocab_size=c.require("vocab_size"), d_model=d, n_layers=layers,
            decoder_layers=None if decoder_layers == layers else decoder_layers,
            max_seq_len=c.get("n_positions", 512),   # the training length; relative positions have no limit
            attention=AttentionConfig(n_heads=c.require("num_heads"), head_dim=c.require("d_kv"),
                                      query_pre_attn_scalar=1.0, dropout=dropout),
            mlp=MLPConfig(activation=table[act_fn], d_ff=c.require("d_ff")),
            norm=NormConfig(kind="rmsnorm", eps=float(c.get("layer_norm_epsilon", 1e-6)), position="pre"),
            position=PositionConfig(kind="t5", t5_num_buckets=c.get("relative_attention_num_buckets", 32),
                                    t5_max_distance=c.get("relative_attention_max_distance", 128)),
            block=BlockConfig(residual_dropout=dropout), embedding_dropout=dropout,
            tie_embeddings=tied, logit_scale=d ** -0.5 if scaled else None,
            decoder_start_token_id=c.get("decoder_start_token_id", c.get("pad_token_id", 0)),
        )

    def from_config(self, cfg: ModelConfig) -> dict:
        req = self.require
        req(cfg, "arch", "encoder_decoder")
        req(cfg, "norm.kind", "rmsnorm")
        req(cfg, "norm.position", "pre")
        req(cfg, "norm.final_norm", True)
        req(cfg, "position.kind", "t5")
        req(cfg, "attention.query_pre_attn_scalar", 1.0)
        req(cfg, "attention.qk_norm", "none")
        req(cfg, "attention.n_kv_heads", [None, cfg.attention.n_heads])
        req(cfg, "attention.sparse", "none")
        req(cfg, "mlp.activation", list(ACT_BACK))
        req(cfg, "logit_scale", [None, cfg.d_model ** -0.5])
        for key in ("norm.embedding_norm", "block.parallel", "scale_embeddings", "attention.gated",
                    "attention.learned_sinks", "attention.scale_by_inverse_layer", "bias.qkv", "bias.attn_out",
                    "bias.mlp", "bias.head"):
            req(cfg, key, False)
        for key in ("attention.window", "attention.logit_softcap", "attention.clip_qkv", "final_logit_softcap",
                    "position.global_kind", "mlp.moe"):
            req(cfg, key, None)
        act_fn, gated = ACT_BACK[cfg.mlp.activation], cfg.mlp.gated
        # "gated-gelu" reads as gelu_new (T5 v1.1); an exact-GeLU gate is told apart by dense_act_fn
        proj = f"gated-{'gelu' if act_fn == 'gelu_new' else act_fn}" if gated else act_fn
        hf = self.base_hf(cfg)
        hf.update(
            d_model=cfg.d_model, d_kv=cfg.head_dim, d_ff=cfg.d_ff, num_heads=cfg.attention.n_heads,
            num_layers=cfg.n_layers, num_decoder_layers=cfg.stack_depth("cross_decoder"),
            relative_attention_num_buckets=cfg.position.t5_num_buckets,
            relative_attention_max_distance=cfg.position.t5_max_distance,
            feed_forward_proj=proj, dense_act_fn=act_fn, is_gated_act=gated, layer_norm_epsilon=float(cfg.norm.eps),
            dropout_rate=float(cfg.block.residual_dropout), is_encoder_decoder=True, n_positions=cfg.max_seq_len,
            decoder_start_token_id=cfg.decoder_start_token_id, scale_decoder_outputs=cfg.logit_scale is not None,
            initializer_factor=1.0,
        )
        return hf

    def ignored_hf(self, cfg: ModelConfig) -> list[str]:
        return [r"decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight"]  # not in HF's class

    def stored_copies(self, cfg: ModelConfig) -> list[StoredCopy]:
        """The head's copy (as every family) and each stack's `embed_tokens`, tied to `shared` in transformers 5."""
        stacks = [StoredCopy(f"{side}.embed_tokens.weight", "shared.weight", why=ONE_EMBEDDING)
                  for side in ("encoder", "decoder")]
        return super().stored_copies(cfg) + stacks

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        ff = {"wi_0": "gate_proj", "wi_1": "up_proj"} if cfg.mlp.gated else {"wi": "up_proj"}
        table = {"shared": "embed", "encoder.final_layer_norm": "encoder_norm",
                 "decoder.final_layer_norm": "final_norm", "lm_head": "lm_head"}
        for side, i, sublayers in (("encoder", "{i}", [("SelfAttention", "attn.", "attn_norm")]),
                                   ("decoder", "{j}", [("SelfAttention", "attn.", "attn_norm"),
                                                       ("EncDecAttention", "cross_attn.", "cross_norm")])):
            table[f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias"] = f"{side}_t5_bias.embedding"
            layer = {}
            for n, (theirs, ours, norm) in enumerate(sublayers):   # layer.n: one sublayer, then the MLP
                layer |= attention(f"{n}.{theirs}.", "q k v o", ours) | {f"{n}.layer_norm": norm}
            n = len(sublayers)
            layer |= {f"{n}.DenseReluDense.{x}": f"mlp.{y}" for x, y in (ff | {"wo": "down_proj"}).items()}
            table |= layers(layer | {f"{n}.layer_norm": "mlp_norm"}, f"{side}.block.{i}.layer.", f"{side}.{i}.")
        return renames(table, "weight")
