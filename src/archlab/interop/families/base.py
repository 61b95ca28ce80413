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
   `rope_theta`/`rope_scaling` and transformers-5 `rope_parameters`) go through `read_rope`.

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

   `renames(table, "weight", "bias")` reads a table of modules. `weight_rules(cfg)` expands the table over the
   layers and keeps the rules whose parameters the model of `cfg` has (a bias, a q/k norm, an untied head exist
   only where the config asks for them), so a table holds no conditions but the names that change with the
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
import functools
import itertools
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import torch

from archlab.config import (
    ROPE_SCALING_FIELDS,
    ConfigError,
    ModelConfig,
    PositionConfig,
    RopeScaling,
)
from archlab.errors import UserError
from archlab.models import build_model
from archlab.nn.registry import Registry


class WeightsError(UserError, ValueError):
    """A checkpoint whose tensors do not match the family's mapping (missing, extra, wrong shape)."""


Tensors = list[torch.Tensor]


def _identity(tensors: Tensors) -> Tensors:
    return list(tensors)


@dataclass(frozen=True)
class Rule:
    """HF tensors `hf` <-> our parameters `ours`. `to_ours` maps the list of HF tensors (in `hf`
    order) to the list of ours (in `ours` order); `to_hf` is its inverse, used by save_hf."""

    ours: tuple[str, ...]
    hf: tuple[str, ...]
    to_ours: Callable[[Tensors], Tensors] = _identity
    to_hf: Callable[[Tensors], Tensors] = _identity


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


def hf_names_of(rules: Sequence[Rule], ours: str) -> tuple[str, ...]:
    """The HF tensors the rule filling our parameter `ours` reads (empty if no rule fills it)."""
    return next((rule.hf for rule in rules if ours in rule.ours), ())


def rename(ours: str, hf: str) -> Rule:
    return Rule((ours,), (hf,))


def renames(table: Mapping[str, str], *params: str) -> list[Rule]:
    """One `rename` per entry of a table HF name -> our name. With `params` ("weight", "bias") the table
    names modules, and each module gives one rule per parameter."""
    suffixes = [f".{p}" for p in params] or [""]
    return [rename(ours + s, hf + s) for hf, ours in table.items() for s in suffixes]


def layers(table: Mapping[str, str], hf: str, ours: str = "blocks.{i}.") -> dict[str, str]:
    """A table of one layer's modules (HF -> ours) with each side's per-layer prefix put in front."""
    return {hf + h: ours + o for h, o in table.items()}


def attention(hf: str, names: str = "q_proj k_proj v_proj o_proj", ours: str = "attn.") -> dict[str, str]:
    """The table of an attention module's projections: HF's `names` of q, k, v and the output under the prefix
    `hf` -> ours (`q_proj` ... `o_proj`) under `ours`."""
    return {hf + theirs: f"{ours}{x}_proj" for theirs, x in zip(names.split(), "qkvo")}


QKV = ("blocks.{i}.attn.q_proj", "blocks.{i}.attn.k_proj", "blocks.{i}.attn.v_proj")   # ours, split from a fused qkv


def fused_params(split: Callable[[list[str], str], Rule], ours: Sequence[str], hf: str,
                 params: Sequence[str] = ("weight", "bias")) -> list[Rule]:
    """One rule `split(our names, HF name)` (a `fused` kind) per parameter of the modules `ours` and `hf`."""
    return [split([f"{o}.{p}" for o in ours], f"{hf}.{p}") for p in params]


_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def expand(rules: Iterable[Rule], counts: Mapping[str, int]) -> list[Rule]:
    """Rules whose names hold placeholders (`{i}`) -> one rule per index (`counts`: placeholder -> how many),
    layer by layer; rules without one as they are, first."""
    groups: dict[tuple[str, ...], list[Rule]] = {}
    for rule in rules:
        keys = tuple(sorted({k for n in rule.ours + rule.hf for k in _PLACEHOLDER.findall(n)}))
        groups.setdefault(keys, []).append(rule)
    out = list(groups.pop((), []))
    for keys, group in groups.items():
        for values in itertools.product(*(range(counts[k]) for k in keys)):
            at = dict(zip(keys, values))
            out += [dataclasses.replace(rule, ours=tuple(n.format_map(at) for n in rule.ours),
                                        hf=tuple(n.format_map(at) for n in rule.hf)) for rule in group]
    return out


@functools.lru_cache(maxsize=64)
def parameter_names(cfg: ModelConfig) -> frozenset[str]:
    """The state-dict keys of the model `cfg` builds (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        return frozenset(build_model(cfg).state_dict())


def table_rules(table: Iterable[Rule], cfg: ModelConfig) -> list[Rule]:
    """A family's table expanded over the layers of `cfg` (and its experts), kept where the model has the
    parameters a rule fills."""
    counts = {"i": cfg.n_layers}
    if cfg.arch == "encoder_decoder":
        counts["j"] = cfg.stack_depth("cross_decoder")
    if cfg.mlp.moe is not None:
        counts["e"] = cfg.mlp.moe.n_experts
    names = parameter_names(cfg)
    rules = []
    for rule in expand(table, counts):
        present = [n in names for n in rule.ours]
        if all(present):
            rules.append(rule)
        elif any(present):
            raise ValueError(f"weight rule for {rule.hf} fills {rule.ours}, of which the model has only some")
    return rules


def transposed(ours: str, hf: str) -> Rule:
    """GPT-2's Conv1D stores weights (in, out); ours are nn.Linear (out, in)."""
    flip = lambda ts: [ts[0].t().contiguous()]  # noqa: E731
    return Rule((ours,), (hf,), flip, flip)


def fused(ours: Sequence[str], hf: str, sizes: Sequence[int], dim: int = 0,
          pre: Callable[[torch.Tensor], torch.Tensor] | None = None,
          post: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Rule:
    """One HF tensor = concatenation of several of ours along `dim` (fused qkv, gate_up).
    `pre` is applied to the HF tensor before splitting (e.g. a transpose or a head reorder) and
    `post` (its inverse) after concatenating when saving."""
    def split(ts: Tensors) -> Tensors:
        t = pre(ts[0]) if pre else ts[0]
        if t.shape[dim] != sum(sizes):
            raise ConfigError(f"size {t.shape[dim]} along dim {dim}, "
                              f"expected {sum(sizes)} = {' + '.join(map(str, sizes))}")
        return [p.contiguous() for p in torch.split(t, list(sizes), dim=dim)]

    def cat(ts: Tensors) -> Tensors:
        t = torch.cat(ts, dim=dim)
        return [(post(t) if post else t).contiguous()]

    return Rule(tuple(ours), (hf,), split, cat)


class HFConfig:
    """Read access to an HF config.json dict that names the family and field in every error."""

    def __init__(self, data: dict, model_type: str):
        self.data, self.model_type = data, model_type

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        if self.data.get(key) is None:
            raise ConfigError(f"{self.model_type} config.json lacks the required field {key!r}")
        return self.data[key]

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

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.model_type} config.json: {message}")


def read_rope(c: HFConfig, default_theta: float = 10_000.0, params: dict | None = None,
              aliases: dict[str, str] | None = None,
              kinds: Sequence[str] | None = None) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from legacy `rope_theta` + `rope_scaling` or transformers-5 `rope_parameters`
    (pass `params` to read one entry of a per-layer-type `rope_parameters`). `aliases` renames
    rope types the way a family's HF config class does (Phi-3: su, yarn -> longrope); `kinds`
    limits the types the family's HF model accepts. Defaults follow transformers'
    modeling_rope_utils (a top-level `original_max_position_embeddings` wins over the one in
    the rope dict; yarn/longrope `factor` defaults to max_position_embeddings / original)."""
    nested = params is not None
    if params is None:
        params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    theta = float(params.get("rope_theta") or c.get("rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    kind = (aliases or {}).get(kind, kind)
    supported = list(kinds) if kinds is not None else ["default", *ROPE_READERS.names()]
    if kind not in supported:
        raise c.error(f"rope type {kind!r} (rope_scaling / rope_parameters) is not supported by "
                      f"archlab here (supported: {', '.join(map(repr, supported))})")
    if kind == "default":
        return theta, None
    top = None if nested else c.get("original_max_position_embeddings")
    original = top or params.get("original_max_position_embeddings")
    original = int(original or c.require("max_position_embeddings"))
    try:
        return theta, ROPE_READERS.get(kind)(params, original, c)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise c.error(f"rope type {kind!r}: missing or malformed field {exc}") from exc


# rope type -> reader(params, original_max_position_embeddings, config) -> RopeScaling
ROPE_READERS: Registry[Callable[[dict, int, HFConfig], RopeScaling]] = Registry("HF rope type")


def _implied_factor(params: dict, original: int, c: HFConfig) -> float:
    """transformers: a missing yarn/longrope factor is max_position_embeddings / original."""
    return float(params.get("factor") or c.require("max_position_embeddings") / original)


@ROPE_READERS.register("linear")
def _read_linear(params: dict, original: int, c: HFConfig) -> RopeScaling:
    return RopeScaling(kind="linear", factor=float(params["factor"]))


@ROPE_READERS.register("llama3")
def _read_llama3(params: dict, original: int, c: HFConfig) -> RopeScaling:
    return RopeScaling(kind="llama3", factor=float(params["factor"]),
                       low_freq_factor=float(params["low_freq_factor"]),
                       high_freq_factor=float(params["high_freq_factor"]),
                       original_max_seq_len=original)


@ROPE_READERS.register("yarn")
def _read_yarn(params: dict, original: int, c: HFConfig) -> RopeScaling:
    factor = _implied_factor(params, original, c)
    attention = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:  # DeepSeek: a ratio of two mscales
        def get_mscale(m: float) -> float:
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
        attention = get_mscale(mscale) / get_mscale(mscale_all_dim)
    return RopeScaling(kind="yarn", factor=factor, original_max_seq_len=original,
                       beta_fast=float(params.get("beta_fast") or 32),   # `or`: as transformers
                       beta_slow=float(params.get("beta_slow") or 1),
                       truncate=bool(params.get("truncate", True)),
                       attention_factor=None if attention is None else float(attention))


@ROPE_READERS.register("longrope")
def _read_longrope(params: dict, original: int, c: HFConfig) -> RopeScaling:
    attention = params.get("attention_factor")
    return RopeScaling(kind="longrope", factor=_implied_factor(params, original, c),
                       original_max_seq_len=original,
                       short_factor=params["short_factor"], long_factor=params["long_factor"],
                       attention_factor=None if attention is None else float(attention))


@ROPE_READERS.register("dynamic")
def _read_dynamic(params: dict, original: int, c: HFConfig) -> RopeScaling:
    # transformers scales past max_position_embeddings (not original_max_position_embeddings)
    return RopeScaling(kind="dynamic", factor=float(params["factor"]),
                       original_max_seq_len=int(c.require("max_position_embeddings")))


def write_rope(theta: float, scaling: RopeScaling | None) -> dict:
    """HF rope fields: `rope_parameters` (transformers >= 5) plus legacy `rope_theta`/`rope_scaling`.
    Dynamic NTK scales past max_position_embeddings: `Family.to_hf` sets it."""
    theta = float(theta)
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        params.update(rope_type=scaling.kind, factor=float(scaling.factor))
        if scaling.kind == "llama3":
            params.update(low_freq_factor=float(scaling.low_freq_factor),
                          high_freq_factor=float(scaling.high_freq_factor))
        if scaling.kind in ("llama3", "yarn", "longrope"):
            params["original_max_position_embeddings"] = scaling.original_max_seq_len
        if scaling.kind == "yarn":
            params.update(beta_fast=float(scaling.beta_fast), beta_slow=float(scaling.beta_slow),
                          truncate=scaling.truncate)
        if scaling.kind == "longrope":
            params.update(short_factor=list(scaling.short_factor),
                          long_factor=list(scaling.long_factor))
        if scaling.attention_factor is not None:
            params["attention_factor"] = float(scaling.attention_factor)
    legacy = None
    if params["rope_type"] != "default":
        legacy = {k: v for k, v in params.items() if k != "rope_theta"}
        legacy["type"] = params["rope_type"]
    return {"rope_theta": theta, "rope_scaling": legacy, "rope_parameters": params}


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
    save_priority: int = 100        # lower wins when several families express a config exactly
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

    # ---- helpers for from_config -------------------------------------------------------------
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

    def require(self, cfg: ModelConfig, key: str, allowed: Any) -> None:
        require_switch(cfg, key, allowed, self.model_type)


FAMILIES: Registry[Family] = Registry("HF model_type")


def register_family(cls: type[Family]) -> type[Family]:
    """Class decorator: registers one instance under `cls.model_type`."""
    if not cls.model_type:
        raise ValueError(f"{cls.__name__} sets no model_type")
    FAMILIES.register(cls.model_type)(cls())
    return cls
