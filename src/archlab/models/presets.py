"""Named configs of real model families, at their published sizes, plus test-sized `tiny()` twins.

Presets are plain functions built on a few `*_like` builders (one per family of design choices);
each names its source (paper table or HF config.json) beside it. Where a detail is unpublished the
comment says so and the closest documented choice is used; `PresetInfo.approximation` records it.
Behaviour never depends on a preset's *name*: everything is in the returned ModelConfig.

    archlab.presets.names()            -> ["transformer-2017", "transformer-2017-big", "gpt", ...]
    archlab.presets.get("llama2-7b")   -> ModelConfig at the published size
    archlab.presets.tiny("gemma3-27b") -> same switches, test-sized (builds and runs on CPU in ms)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from archlab.config import (
    AttentionConfig,
    BiasConfig,
    BlockConfig,
    ConfigError,
    InitConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    NormConfig,
    PositionConfig,
    RopeScaling,
    did_you_mean,
)


@dataclass(frozen=True)
class PresetInfo:
    name: str
    build: Callable[[], ModelConfig]
    year: int
    source: str                       # where the numbers come from
    published_params: float | None    # as published (model card / paper); None if not comparable
    exact: bool = False               # published_params is an exact count our model reproduces
    approximation: str | None = None  # what differs from the released model, and why


_PRESETS: dict[str, PresetInfo] = {}


def _preset(name: str, *, year: int, source: str, params: float | None = None, exact: bool = False,
            approximation: str | None = None):
    def add(fn: Callable[[], ModelConfig]) -> Callable[[], ModelConfig]:
        if name in _PRESETS:
            raise KeyError(f"preset {name!r} defined twice")
        _PRESETS[name] = PresetInfo(name, fn, year, source, params, exact, approximation)
        return fn
    return add


# ---- builders ------------------------------------------------------------------------------------
def _model(name: str, *, vocab_size: int, d_model: int, n_layers: int, max_seq_len: int,
           attention: dict, mlp: dict, norm: dict, position: dict, block: dict | None = None,
           bias: dict | None = None, init: dict | None = None, **top: Any) -> ModelConfig:
    moe = mlp.pop("moe", None)
    return ModelConfig(
        name=name, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, max_seq_len=max_seq_len,
        attention=AttentionConfig(**attention),
        mlp=MLPConfig(**mlp, moe=MoEConfig(**moe) if moe else None),
        norm=NormConfig(**norm), position=PositionConfig(**position),
        block=BlockConfig(**(block or {})), bias=BiasConfig(**(bias or {})),
        init=InitConfig(**(init or {})), **top,
    )


def gpt2_like(name: str, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int,
              max_seq_len: int, d_ff: int | None = None, norm_position: str = "pre",
              activation: str = "gelu_tanh", dropout: float = 0.1, final_norm: bool = True,
              **top: Any) -> ModelConfig:
    """GPT-1/2/3 and OPT: LayerNorm with bias, learned absolute positions, biases everywhere,
    plain (ungated) MLP at 4x width, tied embeddings."""
    top.setdefault("tie_embeddings", True)
    learned_offset = top.pop("learned_offset", 0)
    return _model(
        name, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, max_seq_len=max_seq_len,
        attention=dict(n_heads=n_heads, dropout=top.pop("attention_dropout", dropout),
                       **top.pop("attention_extra", {})),
        mlp=dict(activation=activation, d_ff=d_ff or 4 * d_model),
        norm=dict(kind="layernorm", eps=1e-5, position=norm_position, final_norm=final_norm),
        position=dict(kind="learned", learned_offset=learned_offset),
        block=dict(residual_dropout=dropout),
        bias=dict(qkv=True, attn_out=True, mlp=True, norm=True),
        init=dict(scaled_residual=top.pop("scaled_residual", norm_position == "pre")),
        embedding_dropout=dropout, **top,
    )


def llama_like(name: str, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int,
               d_ff: int, max_seq_len: int, n_kv_heads: int | None = None,
               head_dim: int | None = None, rope_theta: float = 10_000.0, eps: float = 1e-5,
               activation: str = "swiglu", norm_kind: str = "rmsnorm", norm_position: str = "pre",
               qkv_bias: bool = False, window: int | None = None, qk_norm: str = "none",
               moe: dict | None = None, rope_scaling: RopeScaling | None = None,
               tie_embeddings: bool = False, **top: Any) -> ModelConfig:
    """LLaMA and its many descendants: pre-RMSNorm, RoPE (HF rotate-half layout), SwiGLU, no biases."""
    return _model(
        name, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, max_seq_len=max_seq_len,
        attention=dict(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, window=window,
                       qk_norm=qk_norm),
        mlp=dict(activation=activation, d_ff=d_ff, moe=moe),
        norm=dict(kind=norm_kind, eps=eps, position=norm_position),
        position=dict(kind="rope", rope_theta=rope_theta, rope_scaling=rope_scaling),
        bias=dict(qkv=qkv_bias), tie_embeddings=tie_embeddings, **top,
    )


def parallel_like(name: str, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int,
                  d_ff: int, max_seq_len: int, n_kv_heads: int | None = None,
                  head_dim: int | None = None, activation: str = "gelu", norm_kind: str = "layernorm",
                  norm_bias: bool = True, parallel_norms: int = 1, rope_theta: float = 10_000.0,
                  rope_layout: str = "half", rotary_fraction: float = 1.0, bias: dict | None = None,
                  tie_embeddings: bool = False, eps: float = 1e-5, attention: dict | None = None,
                  position: dict | None = None, **top: Any) -> ModelConfig:
    """Parallel attention + MLP off one residual read (GPT-J, GPT-NeoX, PaLM, Falcon, Cohere)."""
    return _model(
        name, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, max_seq_len=max_seq_len,
        attention=dict(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, **(attention or {})),
        mlp=dict(activation=activation, d_ff=d_ff),
        norm=dict(kind=norm_kind, eps=eps, position="pre"),
        position=dict(kind="rope", rope_theta=rope_theta, rope_layout=rope_layout,
                      rotary_fraction=rotary_fraction, **(position or {})),
        block=dict(parallel=True, parallel_norms=parallel_norms),
        bias=dict(norm=norm_bias, **(bias or {})), tie_embeddings=tie_embeddings, **top,
    )


def neox_like(name: str, **kw: Any) -> ModelConfig:
    """GPT-NeoX: parallel with two norms, partial rotary (25%), biases everywhere."""
    kw.setdefault("bias", dict(qkv=True, attn_out=True, mlp=True))
    return parallel_like(name, parallel_norms=2, rotary_fraction=kw.pop("rotary_fraction", 0.25), **kw)


def cohere_like(name: str, *, logit_scale: float, rope_theta: float, **kw: Any) -> ModelConfig:
    """Cohere Command: parallel with one bias-free LayerNorm, SwiGLU, interleaved RoPE, tied
    embeddings with the logits scaled down."""
    return parallel_like(name, activation="swiglu", norm_bias=False, rope_layout="interleaved",
                         rope_theta=rope_theta, tie_embeddings=True, logit_scale=logit_scale, **kw)


def gemma_like(name: str, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int,
               n_kv_heads: int, head_dim: int, d_ff: int, max_seq_len: int, window: int,
               layer_pattern: str, query_pre_attn_scalar: float, attn_softcap: float | None = None,
               final_softcap: float | None = None, qk_norm: str = "none",
               rope_theta: float = 10_000.0, local_rope_theta: float | None = None,
               rope_scaling: RopeScaling | None = None) -> ModelConfig:
    """Gemma 2/3: (1+w) RMSNorm before *and* after each sublayer, GeGLU (tanh), sqrt(d)-scaled tied
    embeddings, local/global attention, explicit head_dim and query scale."""
    return _model(
        name, vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, max_seq_len=max_seq_len,
        attention=dict(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, window=window,
                       layer_pattern=layer_pattern, qk_norm=qk_norm, logit_softcap=attn_softcap,
                       query_pre_attn_scalar=query_pre_attn_scalar),
        mlp=dict(activation="geglu_tanh", d_ff=d_ff),
        norm=dict(kind="rmsnorm_1p", eps=1e-6, position="sandwich"),
        position=dict(kind="rope", rope_theta=rope_theta, local_rope_theta=local_rope_theta,
                      rope_scaling=rope_scaling),
        tie_embeddings=True, scale_embeddings=True, final_logit_softcap=final_softcap,
    )


def t5_like(name: str, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int, head_dim: int,
            d_ff: int, max_seq_len: int, activation: str = "relu", tie_embeddings: bool = True,
            dropout: float = 0.0, arch: str = "encoder_decoder", decoder_layers: int | None = None) -> ModelConfig:
    """T5 (Raffel et al. 2020): an encoder-decoder (or, arch="decoder", T5-style blocks as a decoder-only LM)
    with pre-RMSNorm without bias (T5's LayerNorm: no mean, no beta) and a final norm on each stack, one
    learned relative-bias table per stack (32 log buckets up to 128; bidirectional in the encoder, none on
    the cross-attention), no 1/sqrt(e) in the scores (folded into the init, init.kind="t5"), no biases, decoder
    start token 0 (the pad id). Tied T5 v1.0 scales the hidden state by d^-0.5 before the shared head (logit_scale)."""
    return _model(
        name, arch=arch, decoder_layers=decoder_layers,
        vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, max_seq_len=max_seq_len,
        attention=dict(n_heads=n_heads, head_dim=head_dim, query_pre_attn_scalar=1.0, dropout=dropout),
        mlp=dict(activation=activation, d_ff=d_ff),
        norm=dict(kind="rmsnorm", eps=1e-6, position="pre"),
        position=dict(kind="t5", t5_num_buckets=32, t5_max_distance=128),
        block=dict(residual_dropout=dropout), embedding_dropout=dropout,
        tie_embeddings=tie_embeddings, logit_scale=d_model ** -0.5 if tie_embeddings else None,
        init=dict(kind="t5"),
    )


def vaswani_like(name: str, *, d_model: int, n_heads: int, d_ff: int, dropout: float) -> ModelConfig:
    """The 2017 Transformer (Vaswani et al. 2017): an encoder-decoder, 6 + 6 layers, post-norm LayerNorm after
    every sublayer and none at the end of either stack, sinusoids added at the input (PE[2i] sin, PE[2i+1] cos:
    interleaved; nothing to learn, so both stacks share one), ReLU FFN, biases in attention, FFN and norms
    (tensor2tensor's dense layers), one embedding shared by source, target and the pre-softmax projection, scaled
    by sqrt(d) at the input (sec. 3.4), dropout P_drop on each sublayer output and on the embedding sums (sec. 5.4;
    none inside attention), the shared En-De BPE vocabulary ("about 37000 tokens", sec. 5.1). LayerNorm eps is
    unpublished: tensor2tensor's 1e-6. Label smoothing 0.1 (sec. 5.4) belongs to training, not to the model
    (archlab's trainer has no such setting)."""
    return _model(
        name, arch="encoder_decoder", vocab_size=37_000, d_model=d_model, n_layers=6, max_seq_len=512,
        attention=dict(n_heads=n_heads),
        mlp=dict(activation="relu", d_ff=d_ff),
        norm=dict(kind="layernorm", eps=1e-6, position="post", final_norm=False),
        position=dict(kind="sinusoidal", sinusoid_layout="interleaved"),
        block=dict(residual_dropout=dropout),
        bias=dict(qkv=True, attn_out=True, mlp=True, norm=True),
        embedding_dropout=dropout, tie_embeddings=True, scale_embeddings=True,
    )


# ---- presets -------------------------------------------------------------------------------------
# The 2017 Transformer, Table 3 (base: N=6, d=512, f=2048, h=8, P_drop 0.1, "65M"; big: d=1024, f=4096, h=16,
# P_drop 0.3, "213M"), counted by hand with V = 37,000 shared rows:
#   embedding (once: source, target, softmax)   V*d                          base 18,944,000   big  37,888,000
#   attention (q, k, v, o with biases)          4d^2 + 4d                         1,050,624          4,198,400
#   FFN                                         2df + f + d                       2,099,712          8,393,728
#   encoder layer: attention + FFN + 2 LayerNorms (4d)                           3,152,384         12,596,224
#   decoder layer: + cross-attention + a third LayerNorm (2d)                    4,204,032         16,796,672
#   total: V*d + 6 * (encoder + decoder layer)                                  63,082,496        214,245,376
# (accounting.param_count and EncoderDecoderLM(cfg).num_params() give the same; tests/models/test_transformer_2017.py.)
# 214.2M rounds to the paper's 213M within 0.6%; 63.1M is 3.0% under its 65M, beyond rounding. Not the biases and
# norms (98K in all) nor the tying (an untied softmax would add 18.9M): the exact vocabulary is unpublished, and no
# single V fits both (65M needs ~40.7K rows, 213M ~35.8K). Table 3's other rows (N 2/4/8, d 256/1024, f 1024/4096)
# all lie 1.2-4.1M above this formula at V = 37,000, i.e. about 4K more embedding rows at each width.
_VASWANI_APPROX = ("exact shared vocabulary unpublished ('about 37000' BPE tokens): 37,000 gives {ours} against the "
                   "paper's {paper} (see presets.py); max_seq_len unpublished (512: the sinusoids need no table); "
                   "LayerNorm eps unpublished (tensor2tensor's 1e-6)")


@_preset("transformer-2017", year=2017, source="Vaswani et al. 2017, Table 3 'base' (WMT14 En-De)", params=65e6,
         approximation=_VASWANI_APPROX.format(ours="63.08M", paper="65M"))
def transformer_2017() -> ModelConfig:
    return vaswani_like("transformer-2017", d_model=512, n_heads=8, d_ff=2048, dropout=0.1)


@_preset("transformer-2017-big", year=2017, source="Vaswani et al. 2017, Table 3 'big' (WMT14 En-De)",
         params=213e6, approximation=_VASWANI_APPROX.format(ours="214.25M", paper="213M"))
def transformer_2017_big() -> ModelConfig:
    return vaswani_like("transformer-2017-big", d_model=1024, n_heads=16, d_ff=4096, dropout=0.3)


def bert_like(name: str, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int, max_seq_len: int = 512,
              type_vocab_size: int = 2, eps: float = 1e-12, learned_offset: int = 0, **top: Any) -> ModelConfig:
    """BERT and RoBERTa: an encoder with an MLM head; post-norm LayerNorm (bias), learned positions, token
    types, an embedding LayerNorm, biases everywhere, exact GeLU at 4x width, the decoder tied to the
    embedding with its own vocabulary bias, dropout 0.1."""
    return _model(
        name, arch="encoder", vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, max_seq_len=max_seq_len,
        attention=dict(n_heads=n_heads, dropout=0.1),
        mlp=dict(activation="gelu", d_ff=4 * d_model),
        norm=dict(kind="layernorm", eps=eps, position="post", final_norm=False, embedding_norm=True),
        position=dict(kind="learned", learned_offset=learned_offset),
        block=dict(residual_dropout=0.1),
        bias=dict(qkv=True, attn_out=True, mlp=True, norm=True, head=True),
        init=dict(std=0.02), embedding_dropout=0.1, tie_embeddings=True, type_vocab_size=type_vocab_size, **top,
    )


# BERT: HF bert-base-uncased / bert-large-uncased config.json; counted as BertForMaskedLM (no pooler, no NSP head)
@_preset("bert-base", year=2018, source="HF bert-base-uncased config.json (Devlin et al. 2019)",
         params=109_514_298, exact=True)
def bert_base() -> ModelConfig:
    return bert_like("bert-base", vocab_size=30_522, d_model=768, n_layers=12, n_heads=12)


@_preset("bert-large", year=2018, source="HF bert-large-uncased config.json (Devlin et al. 2019)",
         params=335_174_458, exact=True)
def bert_large() -> ModelConfig:
    return bert_like("bert-large", vocab_size=30_522, d_model=1024, n_layers=24, n_heads=16)


# RoBERTa: HF roberta-base config.json (514 position rows = 512 + padding_idx 1 + 1: positions start at 2;
# one token type; LayerNorm eps 1e-5); counted as RobertaForMaskedLM
@_preset("roberta-base", year=2019, source="HF roberta-base config.json (Liu et al. 2019)",
         params=124_697_433, exact=True)
def roberta_base() -> ModelConfig:
    return bert_like("roberta-base", vocab_size=50_265, d_model=768, n_layers=12, n_heads=12,
                     type_vocab_size=1, eps=1e-5, learned_offset=2)


@_preset("gpt", year=2018, source="HF openai-gpt config.json (Radford et al. 2018)",
         params=116_534_784, exact=True)
def gpt() -> ModelConfig:  # post-norm, learned positions, exact GeLU, no final norm
    return gpt2_like("gpt", vocab_size=40_478, d_model=768, n_layers=12, n_heads=12, max_seq_len=512,
                     norm_position="post", activation="gelu", final_norm=False)


# GPT-2: HF gpt2* config.json (n_positions 1024, gelu_new = tanh GeLU, pre-norm + final LN)
@_preset("gpt2", year=2019, source="HF gpt2 config.json", params=124_439_808, exact=True)
def gpt2() -> ModelConfig:
    return gpt2_like("gpt2", vocab_size=50_257, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024)


@_preset("gpt2-medium", year=2019, source="HF gpt2-medium config.json", params=354_823_168, exact=True)
def gpt2_medium() -> ModelConfig:
    return gpt2_like("gpt2-medium", vocab_size=50_257, d_model=1024, n_layers=24, n_heads=16,
                     max_seq_len=1024)


@_preset("gpt2-large", year=2019, source="HF gpt2-large config.json", params=774_030_080, exact=True)
def gpt2_large() -> ModelConfig:
    return gpt2_like("gpt2-large", vocab_size=50_257, d_model=1280, n_layers=36, n_heads=20,
                     max_seq_len=1024)


@_preset("gpt2-xl", year=2019, source="HF gpt2-xl config.json", params=1_557_611_200, exact=True)
def gpt2_xl() -> ModelConfig:
    return gpt2_like("gpt2-xl", vocab_size=50_257, d_model=1600, n_layers=48, n_heads=25,
                     max_seq_len=1024)


GPT3_BAND = 256   # an assumption: GPT-3's "locally banded" layers have an unpublished band width


@_preset("gpt3-175b", year=2020, source="Brown et al. 2020, Table 2.1 (96 x 12288, 96 heads, ctx 2048)",
         params=175.0e9, approximation=f"GPT-3 alternates dense and locally banded sparse layers (Sparse "
         f"Transformer style); the band width is unpublished: {GPT3_BAND} tokens is an assumption here")
def gpt3_175b() -> ModelConfig:
    return gpt2_like("gpt3-175b", vocab_size=50_257, d_model=12_288, n_layers=96, n_heads=96,
                     max_seq_len=2048, dropout=0.0,
                     attention_extra=dict(window=GPT3_BAND, layer_pattern="GL"))   # dense, banded, dense, ...


# T5: counted as transformers' T5ForConditionalGeneration (the shared embedding once; v1.1's separate lm_head,
# which its checkpoints hold, once more). n_positions 512 is the training length: relative positions have no limit.
@_preset("t5-11b", year=2019, source="HF t5-11b config.json (Raffel et al. 2020)", params=11_307_321_344,
         exact=True)
def t5_11b() -> ModelConfig:  # d_kv 128 x 128 heads = 16384 != d_model 1024; ReLU, tied head, dropout 0.1
    return t5_like("t5-11b", vocab_size=32_128, d_model=1024, n_layers=24, n_heads=128, head_dim=128,
                   d_ff=65_536, max_seq_len=512, dropout=0.1)


@_preset("t5-v1.1-xxl", year=2020, source="HF google/t5-v1_1-xxl config.json", params=11_135_332_352,
         exact=True)
def t5_v1_1_xxl() -> ModelConfig:  # gated-gelu (gelu_new), untied head, no dropout in pre-training
    return t5_like("t5-v1.1-xxl", vocab_size=32_128, d_model=4096, n_layers=24, n_heads=64,
                   head_dim=64, d_ff=10_240, max_seq_len=512, activation="geglu_tanh",
                   tie_embeddings=False)


def bart_like(name: str, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ff: int, max_seq_len: int,
              activation: str, sinusoidal: bool, scale_embeddings: bool, decoder_start_token_id: int,
              dropout: float = 0.1, attention_dropout: float = 0.0) -> ModelConfig:
    """BART (Lewis et al. 2020) and Marian (opus-mt) as transformers builds them: post-LayerNorm encoder-decoders
    (no final norm on either stack), biases everywhere, one embedding shared by both stacks and the tied head,
    `final_logits_bias` as a buffer (bias.head_buffer: not counted, as transformers counts), and absolute
    positions per stack: BART learned with rows shifted by 2 and an embedding LayerNorm per stack; Marian
    static sinusoids, all sines then all cosines, held as a frozen table per stack (counted, as transformers
    counts MarianSinusoidalPositionalEmbedding), embeddings scaled by sqrt(d), no embedding norm."""
    position = (dict(kind="sinusoidal", sinusoid_layout="split", sinusoid_table=True, per_stack=True) if sinusoidal
                else dict(kind="learned", learned_offset=2, per_stack=True))
    return _model(
        name, arch="encoder_decoder", vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
        max_seq_len=max_seq_len, attention=dict(n_heads=n_heads, dropout=attention_dropout),
        mlp=dict(activation=activation, d_ff=d_ff),
        norm=dict(kind="layernorm", eps=1e-5, position="post", final_norm=False, embedding_norm=not sinusoidal),
        position=position, block=dict(residual_dropout=dropout), embedding_dropout=dropout,
        bias=dict(qkv=True, attn_out=True, mlp=True, norm=True, head=True, head_buffer=True),
        tie_embeddings=True, scale_embeddings=scale_embeddings, decoder_start_token_id=decoder_start_token_id,
    )


# counted as transformers' BartForConditionalGeneration / MarianMTModel num_parameters() built from the released
# config.json on the meta device (tests/interop/test_parity_bart_marian.py vendors them)
@_preset("bart-large", year=2019, source="HF facebook/bart-large config.json (Lewis et al. 2020)",
         params=406_291_456, exact=True)
def bart_large() -> ModelConfig:  # GeLU, learned positions (offset 2), embedding LayerNorm, unscaled embeddings
    return bart_like("bart-large", vocab_size=50_265, d_model=1024, n_layers=12, n_heads=16, d_ff=4096,
                     max_seq_len=1024, activation="gelu", sinusoidal=False, scale_embeddings=False,
                     decoder_start_token_id=2, attention_dropout=0.1)


@_preset("marian", year=2018, source="HF Helsinki-NLP/opus-mt-en-de config.json (Junczys-Dowmunt et al. 2018)",
         params=74_410_496, exact=True)
def marian() -> ModelConfig:  # swish, static split sinusoids (512 rows per stack), sqrt(d)-scaled embeddings
    return bart_like("marian", vocab_size=58_101, d_model=512, n_layers=6, n_heads=8, d_ff=2048, max_seq_len=512,
                     activation="silu", sinusoidal=True, scale_embeddings=True, decoder_start_token_id=58_100)


@_preset("gpt-j-6b", year=2021, source="HF EleutherAI/gpt-j-6b config.json", params=6.053e9)
def gpt_j_6b() -> ModelConfig:  # rotary_dim 64 of head_dim 256, interleaved; lm_head has a bias
    return parallel_like("gpt-j-6b", vocab_size=50_400, d_model=4096, n_layers=28, n_heads=16,
                         d_ff=16_384, max_seq_len=2048, activation="gelu_tanh",
                         rope_layout="interleaved", rotary_fraction=0.25,
                         bias=dict(mlp=True, head=True))


@_preset("lamda-137b", year=2022, source="Thoppilan et al. 2022, Sec. 3 / Table 27 (64 layers, "
         "d 8192, d_ff 65536, 128 heads of 128)", params=137e9,
         approximation="norm kind/position, vocab details and context length unpublished: T5-style "
         "pre-RMSNorm with T5 relative bias, untied head, 32k vocab, ctx 2048")
def lamda_137b() -> ModelConfig:
    return t5_like("lamda-137b", vocab_size=32_000, d_model=8192, n_layers=64, n_heads=128,
                   head_dim=128, d_ff=65_536, max_seq_len=2048, activation="geglu",
                   tie_embeddings=False, arch="decoder")


def _deepmind_like(name: str, *, d_model: int, n_layers: int, n_heads: int) -> ModelConfig:
    """Gopher/Chinchilla (Rae et al. 2021): pre-RMSNorm, relative positions, 32k SentencePiece."""
    return _model(
        name, vocab_size=32_000, d_model=d_model, n_layers=n_layers, max_seq_len=2048,
        attention=dict(n_heads=n_heads, head_dim=128),
        mlp=dict(activation="relu", d_ff=4 * d_model),
        norm=dict(kind="rmsnorm", eps=1e-6, position="pre"),
        position=dict(kind="t5"),
    )


_DEEPMIND_APPROX = ("Transformer-XL relative positions are not a switch here: T5 relative bias is "
                    "the closest; activation unpublished (lecture table: ReLU); head tying unpublished")


# The published sizes count Transformer-XL's relative attention (Dai et al. 2019), whose keys for positions go
# through a per-layer projection W_k,R (d_model x heads*kv = d^2): 13*L*d^2 + one 32k x d embedding gives every
# size of Gopher's Table 1 to its rounding (43.7M, 116.6M, 417M, 1.37B, 7.11B, 279.7B) and Chinchilla's 70.0B.
# The T5 bias table that stands in for it here has no such matrix.
_DEEPMIND_COUNT = ("; the published {paper} counts Transformer-XL's per-layer position projection W_k,R "
                   "(L x d x heads*kv = {extra}), which the T5 bias table has not: ours {ours} + {extra} = {total}")


@_preset("gopher-280b", year=2021, source="Rae et al. 2021, Table 1 (80 layers, 128 heads, kv 128, "
         "d 16384)", params=280e9,
         approximation=_DEEPMIND_APPROX + _DEEPMIND_COUNT.format(paper="280B", extra="21.5B", ours="258.7B",
                                                                 total="280.2B"))
def gopher_280b() -> ModelConfig:
    return _deepmind_like("gopher-280b", d_model=16_384, n_layers=80, n_heads=128)


@_preset("chinchilla-70b", year=2022, source="Hoffmann et al. 2022, Table 4 (80 layers, 64 heads, "
         "kv 128, d 8192)", params=70e9,
         approximation=_DEEPMIND_APPROX + _DEEPMIND_COUNT.format(paper="70B", extra="5.4B", ours="65.0B",
                                                                 total="70.4B"))
def chinchilla_70b() -> ModelConfig:
    return _deepmind_like("chinchilla-70b", d_model=8192, n_layers=80, n_heads=64)


@_preset("gpt-neox-20b", year=2022, source="HF EleutherAI/gpt-neox-20b config.json",
         params=20_554_567_680, exact=True)
def gpt_neox_20b() -> ModelConfig:  # hidden_act gelu_fast (tanh form), rotary_pct 0.25
    return neox_like("gpt-neox-20b", vocab_size=50_432, d_model=6144, n_layers=44, n_heads=64,
                     d_ff=24_576, max_seq_len=2048, activation="gelu_tanh")


@_preset("bloom-176b", year=2022, source="HF bigscience/bloom config.json; model card count",
         params=176_247_271_424, exact=True)
def bloom_176b() -> ModelConfig:
    # ALiBi, LayerNorm right after the embedding, serial pre-norm (the lecture table's "parallel" is
    # a slip: BloomBlock is serial), tanh GeLU, biases everywhere, tied head
    return _model(
        "bloom-176b", vocab_size=250_880, d_model=14_336, n_layers=70, max_seq_len=2048,
        attention=dict(n_heads=112),
        mlp=dict(activation="gelu_tanh", d_ff=4 * 14_336),
        norm=dict(kind="layernorm", eps=1e-5, position="pre", embedding_norm=True),
        position=dict(kind="alibi"),
        bias=dict(qkv=True, attn_out=True, mlp=True, norm=True), tie_embeddings=True,
    )


@_preset("opt-175b", year=2022, source="Zhang et al. 2022, Table 1 + HF facebook/opt-* configs "
         "(do_layer_norm_before, positions offset by 2)", params=175e9)
def opt_175b() -> ModelConfig:
    # pre-norm (only OPT-350m is post-norm; the lecture table's "no pre-norm" is a slip), ReLU
    return gpt2_like("opt-175b", vocab_size=50_272, d_model=12_288, n_layers=96, n_heads=96,
                     max_seq_len=2048, activation="relu", learned_offset=2, attention_dropout=0.0,
                     scaled_residual=False)


@_preset("palm-540b", year=2022, source="Chowdhery et al. 2022, Table 1 and Sec. 2", params=540.35e9,
         approximation="layer norm kind unpublished ('no biases in dense kernels or layer norms'): "
         "bias-free LayerNorm")
def palm_540b() -> ModelConfig:
    # parallel block, MQA, SwiGLU at 4d, RoPE, shared embeddings, no biases, z-loss 1e-4
    return parallel_like("palm-540b", vocab_size=256_000, d_model=18_432, n_layers=118, n_heads=48,
                         n_kv_heads=1, head_dim=256, d_ff=4 * 18_432, max_seq_len=2048,
                         activation="swiglu", norm_bias=False, tie_embeddings=True, z_loss=1e-4)


@_preset("llama-65b", year=2023, source="HF huggyllama/llama-65b config.json", params=65.2e9)
def llama_65b() -> ModelConfig:
    return llama_like("llama-65b", vocab_size=32_000, d_model=8192, n_layers=80, n_heads=64,
                      d_ff=22_016, max_seq_len=2048, eps=1e-6)


@_preset("llama2-7b", year=2023, source="HF meta-llama/Llama-2-7b-hf config.json",
         params=6_738_415_616, exact=True)
def llama2_7b() -> ModelConfig:
    return llama_like("llama2-7b", vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32,
                      d_ff=11_008, max_seq_len=4096)


@_preset("llama2-70b", year=2023, source="HF meta-llama/Llama-2-70b-hf config.json",
         params=68_976_648_192, exact=True)
def llama2_70b() -> ModelConfig:
    return llama_like("llama2-70b", vocab_size=32_000, d_model=8192, n_layers=80, n_heads=64,
                      n_kv_heads=8, d_ff=28_672, max_seq_len=4096)


@_preset("llama3-8b", year=2024, source="HF meta-llama/Meta-Llama-3-8B config.json",
         params=8_030_261_248, exact=True)
def llama3_8b() -> ModelConfig:
    return llama_like("llama3-8b", vocab_size=128_256, d_model=4096, n_layers=32, n_heads=32,
                      n_kv_heads=8, d_ff=14_336, max_seq_len=8192, rope_theta=500_000.0)


@_preset("llama3-70b", year=2024, source="HF meta-llama/Meta-Llama-3-70B config.json",
         params=70_553_706_496, exact=True)
def llama3_70b() -> ModelConfig:
    return llama_like("llama3-70b", vocab_size=128_256, d_model=8192, n_layers=80, n_heads=64,
                      n_kv_heads=8, d_ff=28_672, max_seq_len=8192, rope_theta=500_000.0)


@_preset("mistral-7b", year=2023, source="HF mistralai/Mistral-7B-v0.1 config.json",
         params=7_241_732_096, exact=True)
def mistral_7b() -> ModelConfig:  # sliding window 4096 on every layer
    return llama_like("mistral-7b", vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32,
                      n_kv_heads=8, d_ff=14_336, max_seq_len=32_768, window=4096)


@_preset("mixtral-8x7b", year=2024, source="HF mistralai/Mixtral-8x7B-v0.1 config.json",
         params=46_702_792_704, exact=True)
def mixtral_8x7b() -> ModelConfig:  # 8 SwiGLU experts, top-2, renormalized; no window in v0.1
    return llama_like("mixtral-8x7b", vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32,
                      n_kv_heads=8, d_ff=14_336, max_seq_len=32_768, rope_theta=1e6,
                      moe=dict(n_experts=8, top_k=2, aux_loss_coef=0.02))


@_preset("qwen-14b", year=2023, source="HF Qwen/Qwen-14B config.json (intermediate_size 27392 = "
         "2 x 13696)", params=14.2e9)
def qwen_14b() -> ModelConfig:  # c_attn has a bias, nothing else does
    return llama_like("qwen-14b", vocab_size=152_064, d_model=5120, n_layers=40, n_heads=40,
                      d_ff=13_696, max_seq_len=2048, eps=1e-6, qkv_bias=True)


@_preset("qwen2-72b", year=2024, source="HF Qwen/Qwen2-72B config.json", params=72.71e9)
def qwen2_72b() -> ModelConfig:
    return llama_like("qwen2-72b", vocab_size=152_064, d_model=8192, n_layers=80, n_heads=64,
                      n_kv_heads=8, d_ff=29_568, max_seq_len=32_768, eps=1e-6, rope_theta=1e6,
                      qkv_bias=True)


@_preset("qwen2.5-0.5b", year=2024, source="HF Qwen/Qwen2.5-0.5B config.json",
         params=494_032_768, exact=True)
def qwen2_5_0_5b() -> ModelConfig:
    return llama_like("qwen2.5-0.5b", vocab_size=151_936, d_model=896, n_layers=24, n_heads=14,
                      n_kv_heads=2, d_ff=4864, max_seq_len=32_768, eps=1e-6, rope_theta=1e6,
                      qkv_bias=True, tie_embeddings=True)


@_preset("qwen3-8b", year=2025, source="HF Qwen/Qwen3-8B config.json", params=8.19e9)
def qwen3_8b() -> ModelConfig:  # per-head QK RMSNorm, no qkv bias
    return llama_like("qwen3-8b", vocab_size=151_936, d_model=4096, n_layers=36, n_heads=32,
                      n_kv_heads=8, head_dim=128, d_ff=12_288, max_seq_len=40_960, eps=1e-6,
                      rope_theta=1e6, qk_norm="per_head")


@_preset("olmo-7b", year=2024, source="HF allenai/OLMo-7B config.json (mlp_hidden_size 22016 = "
         "2 x 11008)", params=6.89e9)
def olmo_7b() -> ModelConfig:  # non-parametric LayerNorm, no biases, untied
    return llama_like("olmo-7b", vocab_size=50_304, d_model=4096, n_layers=32, n_heads=32,
                      d_ff=11_008, max_seq_len=2048, norm_kind="nonparametric")


@_preset("olmo2-7b", year=2024, source="HF allenai/OLMo-2-1124-7B config.json; z-loss from the "
         "OLMo 2 paper", params=7.30e9)
def olmo2_7b() -> ModelConfig:
    # RMSNorm on each sublayer's *output* (x + N(f(x))), QK-norm over the full q/k width, z-loss
    return llama_like("olmo2-7b", vocab_size=100_352, d_model=4096, n_layers=32, n_heads=32,
                      d_ff=11_008, max_seq_len=4096, eps=1e-6, rope_theta=500_000.0,
                      norm_position="post_sublayer", qk_norm="full", z_loss=1e-5)


@_preset("gemma2-2b", year=2024, source="HF google/gemma-2-2b config.json",
         params=2_614_341_888, exact=True)
def gemma2_2b() -> ModelConfig:
    return gemma_like("gemma2-2b", vocab_size=256_000, d_model=2304, n_layers=26, n_heads=8,
                      n_kv_heads=4, head_dim=256, d_ff=9216, max_seq_len=8192, window=4096,
                      layer_pattern="LG", query_pre_attn_scalar=256, attn_softcap=50.0,
                      final_softcap=30.0)


@_preset("gemma2-9b", year=2024, source="HF google/gemma-2-9b config.json",
         params=9_241_705_984, exact=True)
def gemma2_9b() -> ModelConfig:
    return gemma_like("gemma2-9b", vocab_size=256_000, d_model=3584, n_layers=42, n_heads=16,
                      n_kv_heads=8, head_dim=256, d_ff=14_336, max_seq_len=8192, window=4096,
                      layer_pattern="LG", query_pre_attn_scalar=256, attn_softcap=50.0,
                      final_softcap=30.0)


@_preset("gemma2-27b", year=2024, source="HF google/gemma-2-27b config.json",
         params=27_227_128_320, exact=True)
def gemma2_27b() -> ModelConfig:  # query scale from d_model / n_heads = 144, not head_dim 128
    return gemma_like("gemma2-27b", vocab_size=256_000, d_model=4608, n_layers=46, n_heads=32,
                      n_kv_heads=16, head_dim=128, d_ff=36_864, max_seq_len=8192, window=4096,
                      layer_pattern="LG", query_pre_attn_scalar=144, attn_softcap=50.0,
                      final_softcap=30.0)


@_preset("gemma3-27b", year=2025, source="HF google/gemma-3-27b-pt config.json (text_config)",
         params=27.0e9, approximation="text model only (the 27B release adds a ~0.4B vision tower)")
def gemma3_27b() -> ModelConfig:
    # 5 local (1024, theta 1e4) : 1 global (theta 1e6, linear x8); QK-norm replaces soft-capping
    return gemma_like("gemma3-27b", vocab_size=262_208, d_model=5376, n_layers=62, n_heads=32,
                      n_kv_heads=16, head_dim=128, d_ff=21_504, max_seq_len=131_072, window=1024,
                      layer_pattern="LLLLLG", query_pre_attn_scalar=168, qk_norm="per_head",
                      rope_theta=1e6, local_rope_theta=10_000.0,
                      rope_scaling=RopeScaling(kind="linear", factor=8.0))


@_preset("nemotron4-340b", year=2024, source="Nemotron-4 340B report (arXiv 2406.11704), Table 1; "
         "HF Nemotron config (LayerNorm1P, rotary 50%)", params=341e9)
def nemotron4_340b() -> ModelConfig:  # squared ReLU, no linear biases, untied, GQA 96/8
    return _model(
        "nemotron4-340b", vocab_size=256_000, d_model=18_432, n_layers=96, max_seq_len=4096,
        attention=dict(n_heads=96, n_kv_heads=8),
        mlp=dict(activation="relu2", d_ff=73_728),
        norm=dict(kind="layernorm_1p", eps=1e-5, position="pre"),
        position=dict(kind="rope", rotary_fraction=0.5),
        bias=dict(norm=True),
    )


@_preset("falcon-7b", year=2023, source="HF tiiuae/falcon-7b config.json", params=6_921_720_704,
         exact=True)
def falcon_7b() -> ModelConfig:  # 71 heads, multi-query, one shared norm, exact GeLU, tied
    return parallel_like("falcon-7b", vocab_size=65_024, d_model=4544, n_layers=32, n_heads=71,
                         n_kv_heads=1, d_ff=4 * 4544, max_seq_len=2048, tie_embeddings=True)


@_preset("falcon2-11b", year=2024, source="HF tiiuae/falcon-11B config.json", params=11.1e9,
         approximation="z-loss coefficient unpublished: PaLM's 1e-4; untied head inferred from the "
         "published 11.1B (tied would give 10.84B)")
def falcon2_11b() -> ModelConfig:
    return parallel_like("falcon2-11b", vocab_size=65_024, d_model=4096, n_layers=60, n_heads=32,
                         n_kv_heads=8, d_ff=16_384, max_seq_len=8192, rope_theta=500_042.0,
                         tie_embeddings=False, z_loss=1e-4)


@_preset("phi3-mini", year=2024, source="HF microsoft/Phi-3-mini-4k-instruct config.json",
         params=3_821_079_552, exact=True)
def phi3_mini() -> ModelConfig:  # config.json sets sliding_window 2047
    return llama_like("phi3-mini", vocab_size=32_064, d_model=3072, n_layers=32, n_heads=32,
                      d_ff=8192, max_seq_len=4096, window=2047)


@_preset("command-r-plus", year=2024, source="HF CohereForAI/c4ai-command-r-plus config.json",
         params=104e9)
def command_r_plus() -> ModelConfig:
    return cohere_like("command-r-plus", vocab_size=256_000, d_model=12_288, n_layers=64, n_heads=96,
                       n_kv_heads=8, d_ff=33_792, max_seq_len=131_072, rope_theta=75e6,
                       logit_scale=0.8333333333333334, attention=dict(qk_norm="per_head_untied"))


@_preset("command-a", year=2025, source="HF CohereForAI/c4ai-command-a-03-2025 config.json "
         "(Cohere2)", params=111e9)
def command_a() -> ModelConfig:  # 3 local (RoPE, window 4096) : 1 global (NoPE)
    return cohere_like("command-a", vocab_size=256_000, d_model=12_288, n_layers=64, n_heads=96,
                       n_kv_heads=8, d_ff=36_864, max_seq_len=131_072, rope_theta=50_000.0,
                       logit_scale=0.25, attention=dict(window=4096, layer_pattern="LLLG"),
                       position=dict(global_kind="none"))


@_preset("deepseek-67b", year=2024, source="HF deepseek-ai/deepseek-llm-67b-base config.json",
         params=67e9)
def deepseek_67b() -> ModelConfig:  # deep and narrow: 95 layers
    return llama_like("deepseek-67b", vocab_size=102_400, d_model=8192, n_layers=95, n_heads=64,
                      n_kv_heads=8, d_ff=22_016, max_seq_len=4096, eps=1e-6)


@_preset("yi-34b", year=2024, source="HF 01-ai/Yi-34B config.json", params=34.4e9)
def yi_34b() -> ModelConfig:
    return llama_like("yi-34b", vocab_size=64_000, d_model=7168, n_layers=60, n_heads=56,
                      n_kv_heads=8, d_ff=20_480, max_seq_len=4096, rope_theta=5e6)


@_preset("smollm2-1.7b", year=2025, source="HF HuggingFaceTB/SmolLM2-1.7B config.json",
         params=1_711_376_384, exact=True)
def smollm2_1_7b() -> ModelConfig:
    return llama_like("smollm2-1.7b", vocab_size=49_152, d_model=2048, n_layers=24, n_heads=32,
                      d_ff=8192, max_seq_len=8192, rope_theta=130_000.0, tie_embeddings=True)


# ---- the notes' remaining table rows ------------------------------------------------------------
@_preset("mt5-xxl", year=2021, source="HF google/mt5-xxl config.json (Xue et al. 2021, Table 1: 13B)",
         params=13e9)
def mt5_xxl() -> ModelConfig:  # T5 v1.1 XXL's shape with a 250,112-token multilingual vocabulary
    return t5_like("mt5-xxl", vocab_size=250_112, d_model=4096, n_layers=24, n_heads=64, head_dim=64,
                   d_ff=10_240, max_seq_len=1024, activation="geglu_tanh", tie_embeddings=False)


@_preset("grok-1", year=2024, source="xai-org/grok-1 (its run and model scripts: ffn_size(6144, 8) = 32768; "
         "xAI: 314B parameters)", params=314e9)
def grok_1() -> ModelConfig:  # 8 GeGLU experts top-2, RMSNorm before and after each sublayer, attention 30 tanh
    return _model(
        "grok-1", vocab_size=131_072, d_model=6144, n_layers=64, max_seq_len=8192,
        attention=dict(n_heads=48, n_kv_heads=8, head_dim=128, logit_softcap=30.0),
        mlp=dict(activation="geglu_tanh", d_ff=32_768, moe=dict(n_experts=8, top_k=2)),
        norm=dict(kind="rmsnorm", eps=1e-5, position="sandwich"),
        position=dict(kind="rope", rope_theta=10_000.0),
        tie_embeddings=True, scale_embeddings=True,          # embedding_multiplier_scale 78.38 = sqrt(6144)
        logit_scale=0.5773502691896257,                      # output_multiplier_scale 1/sqrt(3)
    )


@_preset("phi3-small", year=2024, source="HF microsoft/Phi-3-small-8k-instruct config.json and "
         "its modeling_phi3_small module (7.39B on the model page)", params=7.39e9,
         approximation="GeGeLU (a quick-GeLU gate clamped at 20 times (linear + 1)) is GeGLU here; the block-sparse "
                       "attention of every other layer (16 local blocks of 64, vertical stride 8) is dense; the muP "
                       "embedding multiplier 10 is left out (logits / 8 and 1/head_dim scores are kept)")
def phi3_small() -> ModelConfig:  # LayerNorm, biases everywhere, tied, GQA 32/8, tiktoken vocabulary
    return _model(
        "phi3-small", vocab_size=100_352, d_model=4096, n_layers=32, max_seq_len=8192,
        attention=dict(n_heads=32, n_kv_heads=8, query_pre_attn_scalar=128.0 ** 2),   # muP: q.k / head_dim
        mlp=dict(activation="geglu", d_ff=14_336),
        norm=dict(kind="layernorm", eps=1e-5, position="pre"),
        position=dict(kind="rope", rope_theta=1e6),
        bias=dict(qkv=True, attn_out=True, mlp=True, norm=True),
        tie_embeddings=True, logit_scale=1 / 8,              # mup_width_multiplier 8
    )


@_preset("reka-flash-3", year=2025, source="HF RekaAI/reka-flash-3 config.json (Reka: 21B)", params=21e9)
def reka_flash_3() -> ModelConfig:  # a LLaMA shape: GQA 64/8, head_dim 96, rope_theta 8e6, untied
    return llama_like("reka-flash-3", vocab_size=100_352, d_model=6144, n_layers=44, n_heads=64, n_kv_heads=8,
                      d_ff=19_648, max_seq_len=32_768, rope_theta=8e6)


# ---- public API ----------------------------------------------------------------------------------
def names() -> list[str]:
    return list(_PRESETS)


def info(name: str) -> PresetInfo:
    try:
        return _PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, _PRESETS)}; known: {', '.join(_PRESETS)}"
                          ) from None


def get(name: str) -> ModelConfig:
    """The preset's ModelConfig at the published size."""
    return info(name).build()


# Fields that tiny() changes; every other field of the config is kept as published.
SIZE_FIELDS = (
    "name", "vocab_size", "d_model", "n_layers", "max_seq_len",
    "attention.n_heads", "attention.n_kv_heads", "attention.head_dim", "attention.window",
    "attention.query_pre_attn_scalar", "mlp.d_ff", "mlp.moe.n_experts", "mlp.moe.top_k",
    "mlp.moe.shared_expert_d_ff", "position.t5_num_buckets", "position.t5_max_distance",
    "position.rope_scaling.original_max_seq_len", "decoder_layers", "decoder_start_token_id", "logit_scale",
)


def tiny(name: str, *, d_model: int = 64, vocab_size: int = 256, max_seq_len: int = 64,
         window: int = 8) -> ModelConfig:
    """Same architecture as `get(name)` (every switch identical), test-sized.

    4 heads (MHA stays MHA, MQA stays MQA, GQA becomes 4:2); an explicit head_dim stays explicit
    (8 where the published q width differs from d_model, so that path is exercised, else
    d_model/4); n_layers = one full local/global pattern (>= 2); d_ff 128; windows of `window`
    tokens; 4 experts; a T5 table of 8 buckets up to distance 16; an encoder-decoder's decoder one layer
    deeper than its encoder where the published one differs in depth; a logit scale of d_model**-0.5 (T5 v1.0's
    rescale before its tied head) follows the new d_model.
    """
    cfg = get(name)
    att, n_heads = cfg.attention, 4
    if att.n_kv_heads is None:
        kv = None
    elif att.n_kv_heads == 1:
        kv = 1
    elif att.n_kv_heads == att.n_heads:
        kv = n_heads
    else:
        kv = 2
    head_dim = None
    if att.head_dim is not None:
        head_dim = 8 if att.n_heads * att.head_dim != cfg.d_model else d_model // n_heads
    new_head_dim = head_dim or d_model // n_heads
    scalar = att.query_pre_attn_scalar
    if scalar is not None and scalar != 1.0:  # keep its ratio to the head dim (Gemma 2 27B: 144/128)
        # rounded: HF types query_pre_attn_scalar as an int, so tiny twins stay saveable
        scalar = float(max(1, round(scalar * new_head_dim / cfg.head_dim)))
    attention = dataclasses.replace(
        att, n_heads=n_heads, n_kv_heads=kv, head_dim=head_dim, query_pre_attn_scalar=scalar,
        window=None if att.window is None else min(att.window, window),
    )
    mlp = cfg.mlp
    moe = mlp.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe, n_experts=4, top_k=min(moe.top_k, 2),
            shared_expert_d_ff=None if moe.shared_expert_d_ff is None else 64)
    mlp = dataclasses.replace(mlp, d_ff=None if mlp.d_ff is None else 2 * d_model, moe=moe)
    pos = cfg.position
    scaling = pos.rope_scaling
    if scaling is not None:
        scaling = dataclasses.replace(scaling, original_max_seq_len=min(scaling.original_max_seq_len,
                                                                          max_seq_len // 2))
    pos = dataclasses.replace(pos, t5_num_buckets=8, t5_max_distance=16, rope_scaling=scaling)
    pattern = att.layer_pattern
    n_layers = max(2, len(pattern) if pattern else 2)
    return dataclasses.replace(
        cfg, name=f"{cfg.name}-tiny", vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
        max_seq_len=max_seq_len, attention=attention, mlp=mlp, position=pos,
        decoder_layers=None if cfg.decoder_layers in (None, cfg.n_layers) else n_layers + 1,
        decoder_start_token_id=min(cfg.decoder_start_token_id, vocab_size - 1),
        logit_scale=d_model ** -0.5 if cfg.logit_scale == cfg.d_model ** -0.5 else cfg.logit_scale,
    )
