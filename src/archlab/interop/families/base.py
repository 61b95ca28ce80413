"""The contract every Hugging Face family implements, plus small helpers shared by families.

How to add a family (one file in this package, ~100 lines):

1. Subclass `Family`, set `model_type` (the `model_type` field of HF's config.json) and
   `architecture` (the class name HF writes into `architectures`, e.g. "LlamaForCausalLM"), and
   decorate with `@register_family`:

       @register_family
       class LlamaFamily(Family):
           model_type = "llama"
           architecture = "LlamaForCausalLM"

2. `to_config(hf) -> ModelConfig`: read the config.json dict. Use `HFConfig(hf, self.model_type)`:
   `c.get("rms_norm_eps", 1e-6)`, `c.require("hidden_size")`, and `c.unsupported(field, bad_if)` /
   `c.only(field, allowed)` so that an HF switch we cannot express raises ConfigError naming the
   field and its value instead of silently loading a different model. RoPE settings (legacy
   `rope_theta`/`rope_scaling` and transformers-5 `rope_parameters`) go through `read_rope` (families/rope.py).

3. `from_config(cfg) -> dict`: our config -> config.json dict for `save_hf`. Raise ConfigError naming
   the switch HF cannot express (`require_switch(cfg, "norm.kind", "rmsnorm", family)`). The
   round trip `to_config(from_config(cfg))` must give back `cfg` on every architectural field
   (see `ARCH_IGNORED`): that is how `save_hf` infers the family of a model.
   Families that cannot be saved leave `from_config` unimplemented (NotImplementedError).
   save_hf calls `Family.to_hf(cfg)`: `from_config` plus the fields all families write alike.

4. `weight_table(cfg) -> list[Rule]`: the family's weights as a table, in the manner of torchtitan's
   state-dict adapters: HF name -> our name, `{i}` standing for the layer index (`{j}` a decoder layer of an
   encoder-decoder, `{e}` an expert), every tensor the family's checkpoints may hold listed once:

       renames({"model.embed_tokens.weight": "embed.weight",
                "model.layers.{i}.self_attn.q_proj.weight": "blocks.{i}.attn.q_proj.weight", ...})

   `renames(table, "weight", "bias")` reads a table of modules (the helpers are in families/tables.py).
   `weight_rules(cfg)` expands the table over the layers and keeps the rules whose parameters the model of
   `cfg` has (a bias, a q/k norm, an untied head exist only where the config asks for them), so a table holds
   no conditions but the names that change with the
   config (which norm HF calls `post_attention_layernorm`). Tensors that are not renamed keep their Rule kinds:
   `transposed` for GPT-2's Conv1D, `fused(ours_list, hf, sizes)` for one HF tensor split into several of ours
   (fused qkv, gate_up) -- the inverse (concatenation) is used when saving. Tensors that old checkpoints
   store but that transformers does not load either (rotary `inv_freq`, causal `masked_bias`)
   go in `ignored_hf(cfg)` as regular expressions. Tensors transformers ties to one that is read
   (its `_tied_weights_keys`: a tied head, T5's and BART's per-stack embeddings, BERT's decoder)
   or computes from the config (Marian's sinusoids) go in `stored_copies(cfg)` (a tied head's
   copy is declared by default): the loader drops a stored copy only when it equals what is read,
   and otherwise does what transformers does (a head of its own) or refuses naming it. Tensors
   stored under a legacy name (BERT's `LayerNorm.gamma`) are renamed by `hf_name(stored)` before
   matching.

   Encoder families (BERT) set `arch = "encoder"`: load_hf builds the model `cfg.arch` names
   (archlab.models.build_model) and save_hf only considers families of the model's arch.

5. Add a parity test in tests/interop/test_parity_<family>.py using the helpers in
   tests/interop/conftest.py (tiny random HF model -> save_pretrained -> load_hf -> logits equal;
   save_hf -> transformers -> logits equal).

Checkpoints saved from the bare base model (LlamaModel instead of LlamaForCausalLM) lack the
`base_prefix` ("model.", "transformer."); the loader adds it back when no tensor carries it.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Sequence

import torch

from archlab.config import ROPE_SCALING_FIELDS, ConfigError, ModelConfig, PositionConfig, RopeScaling
from archlab.interop.families.tables import Rule, WeightsError, hf_names_of, parameter_names, table_rules
from archlab.nn.registry import Registry


@dataclass(frozen=True)
class StoredCopy:
    """A checkpoint tensor `name` that this config does not read because it holds what another tensor holds:
    the HF tensor `source` (a tie) or, with `source` None, the value `compute()` gives (a table the config
    implies). The loader compares them; equal, the copy is dropped. Different, transformers uses the stored
    tensor, and so does archlab by `on_difference`: "untie_head" (the config with `tie_embeddings` false reads
    it as a head of its own), "read_copy" (the rule that reads `source` reads `name` in its place: the HF
    forward applies the copy, the source is only what it is tied to), or "refuse" (one model tensor holds both:
    a WeightsError names it)."""

    name: str
    source: str | None = None
    compute: Callable[[], torch.Tensor] | None = None
    on_difference: Literal["untie_head", "read_copy", "refuse"] = "refuse"
    why: str = ""            # for "refuse": what archlab's model cannot hold apart


# Fields that count something (sizes, heads, layers, positions) by their HF names: they must be integers.
_COUNT_FIELD = re.compile(r"(num_|n_).*|.*(_size|_dim|_layers|_heads|position_embeddings|_positions|_buckets|_distance)"
                          r"|d_model|d_ff|d_kv|rotary_dim|sliding_window")


class HFConfig:
    """Read access to an HF config.json dict that names the family and field in every error, and checks
    the type of what it hands out: a count is an integer, a field with a numeric default a number."""

    def __init__(self, data: dict, model_type: str):
        self.data, self.model_type = data, model_type

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else self._typed(key, value, default)

    def require(self, key: str) -> Any:
        if self.data.get(key) is None:
            raise ConfigError(f"{self.model_type} config.json lacks the required field {key!r}")
        return self._typed(key, self.data[key])

    def _typed(self, key: str, value: Any, default: Any = None) -> Any:
        def number(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        if _COUNT_FIELD.fullmatch(key) and not (isinstance(value, int) and not isinstance(value, bool)):
            raise self.error(f"field {key}={value!r} must be a whole number")
        if number(default) and not number(value):
            raise self.error(f"field {key}={value!r} must be a number")
        return value

    def only(self, key: str, allowed: Iterable[Any], default: Any = None) -> Any:
        """The value of `key` (default if absent), which must be one of `allowed`."""
        value = self.get(key, default)
        allowed = list(allowed)
        if value not in allowed:
            raise ConfigError(
                f"{self.model_type} config.json field {key}={value!r} is not supported by archlab "
                f"(supported: {', '.join(map(repr, allowed))})"
            )
        return value

    def unsupported(self, key: str, bad: Callable[[Any], bool] = lambda v: bool(v),
                    why: str = "") -> None:
        """Raise if `key` is present with a value for which `bad(value)` holds."""
        value = self.data.get(key)
        if value is not None and bad(value):
            raise ConfigError(
                f"{self.model_type} config.json field {key}={value!r} is not supported by archlab"
                + (f": {why}" if why else "")
            )

    def heads(self) -> dict[str, int]:
        """n_heads, n_kv_heads and head_dim from the fields most HF configs name alike: num_attention_heads,
        num_key_value_heads (MHA when absent), head_dim (hidden_size // num_attention_heads when absent)."""
        n = self.require("num_attention_heads")
        return {"n_heads": n, "n_kv_heads": self.get("num_key_value_heads", n),
                "head_dim": self.get("head_dim", self.require("hidden_size") // n)}

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.model_type} config.json: {message}")


def require_switch(cfg: ModelConfig, key: str, allowed: Any | Sequence[Any], family: str) -> None:
    """Raise ConfigError if the dotted config `key` is not `allowed` (a value or list of values)."""
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part) if value is not None else None
    options = allowed if isinstance(allowed, (list, tuple)) else [allowed]
    if value not in options:
        raise ConfigError(
            f"HF family {family!r} cannot express {key}={value!r} "
            f"(it needs {' or '.join(map(repr, options))})"
        )


# Fields that do not change the function a model computes (training-only or bookkeeping); the
# family inference in save_hf ignores them when comparing a config with its HF round trip.
ARCH_IGNORED = (
    "name", "seed", "init", "z_loss", "embedding_dropout", "block.residual_dropout",
    "attention.dropout", "mlp.moe.aux_loss_coef", "mlp.moe.router_z_loss_coef", "max_seq_len",
)


def _used_rope_fields(s: RopeScaling) -> RopeScaling:
    """`s` with the fields its kind does not read at their defaults."""
    return RopeScaling(kind=s.kind, **{f: getattr(s, f) for f in ROPE_SCALING_FIELDS[s.kind]})


def config_diff(a: ModelConfig, b: ModelConfig) -> list[str]:
    """Dotted keys whose values differ between two configs, ignoring ARCH_IGNORED; mlp width is
    compared as the resolved d_ff (d_ff vs d_ff_ratio spell the same model)."""
    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                out.update(flat(v, key + "."))
            else:
                out[key] = v
        return out

    def normalized(cfg: ModelConfig) -> dict:
        """Spell equivalent configs the same: resolved sizes, per-layer pattern, and the
        defaults of fields that the chosen kinds never read (t5 buckets without t5, ...)."""
        n = cfg.n_layers
        local = "".join("L" if cfg.is_local(i) else "G" for i in range(n))
        att, pos, default_pos = cfg.attention, cfg.position, PositionConfig()
        kinds = {cfg.position_kind(i) for i in range(n)} | {pos.kind}
        rope = "rope" in kinds
        pos = dataclasses.replace(
            pos,
            global_kind=None if pos.global_kind in (None, pos.kind) else pos.global_kind,
            t5_num_buckets=pos.t5_num_buckets if "t5" in kinds else default_pos.t5_num_buckets,
            t5_max_distance=pos.t5_max_distance if "t5" in kinds else default_pos.t5_max_distance,
            learned_offset=pos.learned_offset if pos.kind == "learned" else 0,
            sinusoid_layout=pos.sinusoid_layout if pos.kind == "sinusoidal" else default_pos.sinusoid_layout,
            per_stack=pos.per_stack and (pos.kind in ("learned", "sinusoidal") or cfg.norm.embedding_norm),
            rope_theta=pos.rope_theta if rope else default_pos.rope_theta,
            rope_layout=pos.rope_layout if rope else default_pos.rope_layout,
            rotary_fraction=pos.rotary_fraction if rope else 1.0,
            rope_scaling=(None if not rope or pos.rope_scaling is None else
                          _used_rope_fields(pos.rope_scaling)),
            local_rope_theta=pos.local_rope_theta if rope and "L" in local else None,
        )
        att = dataclasses.replace(
            att, head_dim=cfg.head_dim, n_kv_heads=cfg.n_kv_heads,
            query_pre_attn_scalar=att.query_pre_attn_scalar or cfg.head_dim,
            layer_pattern=local, window=att.window if "L" in local else None)
        bias = cfg.bias
        if cfg.norm.kind not in ("layernorm", "layernorm_1p"):  # no beta to have
            bias = dataclasses.replace(bias, norm=False)
        cfg = dataclasses.replace(
            cfg, attention=att, position=pos, bias=bias,
            mlp=dataclasses.replace(cfg.mlp, d_ff=cfg.d_ff, d_ff_ratio=4.0, multiple_of=1))
        return flat(cfg.to_dict())

    fa, fb = normalized(a), normalized(b)
    ignored = lambda k: any(k == p or k.startswith(p + ".") for p in ARCH_IGNORED)  # noqa: E731
    return sorted(k for k in set(fa) | set(fb) if not ignored(k) and fa.get(k) != fb.get(k))


class Family:
    """One HF `model_type`: config translation both ways and the weight-name mapping."""

    model_type: str = ""
    architecture: str = ""          # HF class written to config.json "architectures"
    arch: str = "decoder"           # the ModelConfig.arch its configs have (BERT: "encoder")
    base_prefix: str = "model."     # prefix of the base model's tensors inside *ForCausalLM
    save_priority: int = 50         # lower wins when several families express a config exactly
    ties_by_default = False         # the HF config class's tie_word_embeddings default
    positions_default = 2048        # and its max_position_embeddings default
    config_unties = True            # tie_word_embeddings=false unties every copy in transformers, so save_hf
                                    # writes each one (False: the HF config class ties them whatever it says)

    def to_config(self, hf: dict) -> ModelConfig:
        raise NotImplementedError

    def from_config(self, cfg: ModelConfig) -> dict:
        raise NotImplementedError(f"saving to HF family {self.model_type!r} is not implemented")

    def to_hf(self, cfg: ModelConfig) -> dict:
        """`from_config` plus what every family writes alike (save_hf calls this): transformers'
        dynamic NTK scaling starts past max_position_embeddings, so that field carries
        rope_scaling.original_max_seq_len."""
        hf = self.from_config(cfg)
        scaling = cfg.position.rope_scaling
        rope = any(cfg.position_kind(i) == "rope" for i in range(cfg.n_layers))
        if rope and scaling is not None and scaling.kind == "dynamic" and "max_position_embeddings" in hf:
            hf["max_position_embeddings"] = scaling.original_max_seq_len
        return hf

    def weight_table(self, cfg: ModelConfig) -> list[Rule]:
        """Every tensor of the family's checkpoints, HF name -> ours, `{i}` the layer (see the module docstring)."""
        raise NotImplementedError

    def weight_rules(self, cfg: ModelConfig) -> list[Rule]:
        """The table's rules for `cfg`: over its layers, for the parameters its model has (each one named)."""
        rules = table_rules(self.weight_table(cfg), cfg)
        left = parameter_names(cfg).difference(name for rule in rules for name in rule.ours)
        if left:
            raise WeightsError(f"{self.model_type}: no HF name for parameter(s) {', '.join(sorted(left))}")
        return rules

    def hf_name(self, stored: str) -> str:
        """The name `weight_rules` uses for a tensor stored under `stored` (legacy spellings:
        BERT's TF-era LayerNorm `gamma` / `beta`); the identity by default."""
        return stored

    def ignored_hf(self, cfg: ModelConfig) -> list[str]:
        """Regular expressions (full match) of HF tensor names that transformers does not load either
        (buffers it recomputes, modules its class lacks)."""
        return [r".*rotary_emb\.inv_freq", r".*\.attn\.bias", r".*\.attn\.masked_bias"]

    def stored_copies(self, cfg: ModelConfig) -> list[StoredCopy]:
        """Checkpoint tensors `cfg` reads through another (see StoredCopy). By default a tied head's stored copy
        of the embedding (`lm_head.weight` in most families), untied when it differs, as transformers does."""
        if not cfg.tie_embeddings:
            return []
        head = hf_names_of(self.weight_rules(dataclasses.replace(cfg, tie_embeddings=False)), "lm_head.weight")
        embed = hf_names_of(self.weight_rules(cfg), "embed.weight")
        if len(head) != 1 or len(embed) != 1:
            return []
        return [StoredCopy(head[0], embed[0], on_difference="untie_head")]

    # ---- helpers for to_config and from_config ------------------------------------------------
    def model_config(self, c: HFConfig, **fields: Any) -> ModelConfig:
        """ModelConfig(**fields) with the fields families read alike: name, vocab_size, tie_word_embeddings (its
        default `ties_by_default`), initializer_range, and unless given, d_model, n_layers and max_seq_len from
        hidden_size, num_hidden_layers and max_position_embeddings (default `positions_default`)."""
        alike = dict(name=f"hf-{self.model_type}", vocab_size=c.require("vocab_size"),
                     tie_embeddings=bool(c.get("tie_word_embeddings", self.ties_by_default)),
                     init={"std": c.get("initializer_range", 0.02)})
        for field, key in (("d_model", "hidden_size"), ("n_layers", "num_hidden_layers")):
            if field not in fields:
                alike[field] = c.require(key)
        if "max_seq_len" not in fields:
            alike["max_seq_len"] = c.get("max_position_embeddings", self.positions_default)
        return ModelConfig(**(alike | fields))

    def base_hf(self, cfg: ModelConfig) -> dict:
        """Fields every config.json written by save_hf carries."""
        return {
            "model_type": self.model_type,
            "architectures": [self.architecture],
            "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": cfg.tie_embeddings,
            "torch_dtype": "float32",
            "initializer_range": float(cfg.init.std),
        }

    def sizes_hf(self, cfg: ModelConfig) -> dict:
        """The size fields most config.json files name alike (what HFConfig.heads and the families read back)."""
        return {"hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
                "num_attention_heads": cfg.attention.n_heads, "num_key_value_heads": cfg.n_kv_heads,
                "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len}

    def require(self, cfg: ModelConfig, key: str, allowed: Any) -> None:
        require_switch(cfg, key, allowed, self.model_type)


FAMILIES: Registry[Family] = Registry("HF model_type")


def register_family(cls: type[Family]) -> type[Family]:
    """Class decorator: registers one instance under `cls.model_type`."""
    if not cls.model_type:
        raise ValueError(f"{cls.__name__} sets no model_type")
    FAMILIES.register(cls.model_type)(cls())
    return cls
