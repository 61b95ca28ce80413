"""Ablation suites as data: a base config, variants (an explicit list and/or a product of axes of
dotted overrides), optional parameter/FLOP matching, budgets per scale, and the claim as rules.

One built-in suite per claim of the architecture lecture (reference notes 000/001/003; published
figures in CLAIMS.md). A suite can also come from YAML with the same fields::

    name: my-norms
    claim: RMSNorm matches LayerNorm
    base: {model: {norm.position: pre}, train: {lr: 3.0e-3}}
    axes:
      - {name: norm, key: norm.kind, values: [layernorm, rmsnorm]}
      - name: lr                                    # or values with labels and several keys
        values:
          - {label: "lr=1e-3", set: {train.lr: 1.0e-3}}
          - {label: "lr=1e-2", set: {train.lr: 1.0e-2}}
    variants:                                       # appended after the axes' product
      - {label: "norm=rmsnorm,lr=3e-3", set: {norm.kind: rmsnorm}, labels: {norm: rmsnorm}}
    match: {by: params, knob: mlp.d_ff, tolerance: 0.02}   # by: params | active (MoE: top_k experts) | flops
    seeds: 3
    scales: {small: {budget: 300, unit: steps}, large: {budget: 4000, unit: steps}}
    measure: [val_loss_2x]
    rules:
      - {kind: parity, metric: final_val_loss, a: {norm: rmsnorm}, b: {norm: layernorm}, tol: 0.02,
         statement: "RMSNorm's loss within 2% of LayerNorm's"}
    analysis: scaling        # optional: a report section of its own (ANALYSES: scaling, emergence, ngram, real_model)
    runs: train              # optional: what a run is (RUN_KINDS: train a model, evaluate an n-gram model,
                             # fine-tune a pretrained base on the post-training demo's task, or evaluate a
                             # pretrained real model: real_model)
    finetune: {bases: per_seed, pretrain: {budget: 100}, test_words: 200}   # optional, runs: finetune only
    extend: {factor: 4, bases: per_seed, train: {lr: 1.0e-3}}   # optional, runs: extend only (archlab.lab.extend)
    corpus: addition-2       # optional: the corpus a sweep prepares unless --corpus / --data say otherwise
    real_model: {measure: quantization, model: smollm2-135m-instruct, tokens: 512, seq_len: 256}
                             # optional, runs: real_model only (archlab.lab.real_model_run.SETTINGS)

A scale may also carry `axes` (replacing the suite's axes of the same name: a model ladder sized for
GPUs) and `corpus`. Per-variant `train.budget` / `train.budget_unit` give each run its own budget (the
scaling suite's token ladder).

Keys starting with `train.` go to TrainConfig, keys starting with `ngram.` to an n-gram run (`order`, `add_k`),
`extend.` to an extend run (`steps`), `real.` to a real-model run's measurement
(e.g. `real.scheme`, `real.window`), all others to ModelConfig.with_overrides. A `finetune` run
(archlab.lab.finetune) pretrains its base from the ModelConfig (once per distinct base, shared by seeds unless
`finetune.bases` is per_seed), then fine-tunes it with the TrainConfig on the demo's chat examples and scores
held-out words (`exact_match`). An `extend` run
(archlab.lab.extend) starts from a base trained once at the suite's length L (shared by the seeds, or one per seed),
gives RoPE the variant's `position.rope_scaling` over `extend.factor` x L, fine-tunes `extend.steps` steps at that
length (0: the base's weights as they are) and scores perplexity by length and passkey retrieval. Variant names
are the axis labels joined with "," (e.g. "norm=post,lr=1e-2"); each run also records its labels per
axis, which is what rules select on.
"""
from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from archlab.config import ConfigError, ModelConfig
from archlab.lab.matching import MATCH_BY
from archlab.lab.verdicts import Rule
from archlab.runs.train_section import merge_train

MEASUREMENTS = ("val_loss_2x", "max_attn_logit", "sinks", "kv_cache_bytes", "paired_step_time", "effective_rank",
                "addition", "expert_load", "icl")

# The tiny model every built-in suite starts from (~0.23M parameters with the byte vocabulary).
BASE_MODEL: dict[str, Any] = {
    "name": "lab-tiny", "vocab_size": 257, "d_model": 64, "n_layers": 4, "max_seq_len": 64,
    "attention.n_heads": 4, "mlp.activation": "swiglu", "mlp.d_ff": 172, "position.kind": "rope",
    "norm.kind": "rmsnorm", "norm.position": "pre",
}
BASE_TRAIN: dict[str, Any] = {
    "lr": 3e-3, "warmup_steps": 20, "schedule": "cosine", "min_lr_ratio": 0.1, "weight_decay": 0.1,
    "grad_clip": 1.0, "batch_size": 16, "seq_len": 64, "eval_every": 100, "eval_batches": 8,
    "dtype": "float32", "nan_policy": "stop",
}
# small: 2 CPU cores, a whole suite (variants x seeds) in <= 15 minutes; large: one GPU.
DEFAULT_SCALES: dict[str, dict[str, Any]] = {
    "small": {"budget": 300, "unit": "steps"},
    "large": {"budget": 4000, "unit": "steps",
              "train": {"batch_size": 64, "seq_len": 256, "eval_every": 500, "eval_batches": 32,
                        "warmup_steps": 200, "dtype": "auto"},
              "model": {"d_model": 256, "n_layers": 8, "attention.n_heads": 8, "mlp.d_ff": 688}},
}


@dataclass(frozen=True)
class Variant:
    name: str
    model: dict[str, Any]          # dotted ModelConfig overrides
    train: dict[str, Any]          # TrainConfig overrides (without the `train.` prefix)
    labels: dict[str, str]         # axis name -> label
    ngram: dict[str, Any] = field(default_factory=dict)   # an n-gram run's settings (without the `ngram.` prefix)
    extend: dict[str, Any] = field(default_factory=dict)  # an extend run's settings (without `extend.`): steps
    real: dict[str, Any] = field(default_factory=dict)    # a real-model run's settings (without the `real.` prefix)


_FIELD_TYPES = {"name": str, "claim": str, "variants": list, "axes": list, "base": dict, "match": dict, "seeds": int,
                "scales": dict, "measure": list, "rules": list, "published": str, "lr_axis": str, "notes": str,
                "timing_seq_len": int, "analysis": str, "corpus": str, "runs": str, "finetune": dict,
                "extend": dict, "real_model": dict}
# report sections beyond the rules' table, by name (archlab.lab.report.ANALYSES holds their code)
ANALYSES = ("scaling", "emergence", "ngram", "context", "real_model", "rlvr")
# what one run of a suite is (archlab.lab.worker.RUN_KINDS holds their code): a trained model, an n-gram
# model counted on the train split and scored on the validation split (no training, no model), or a pretrained base
# fine-tuned on the post-training demo's task and scored on held-out words (archlab.lab.finetune), or a base's
# context extended by RoPE scaling and a few steps at the longer length (archlab.lab.extend), or a pretrained
# model converted once (GGUF -> run folder, cached in the sweep) and measured, none trained (archlab.lab.real_model_run)
RUN_KINDS = ("train", "ngram", "finetune", "extend", "real_model")
_KIND_NAMES = {str: "a string", list: "a list", dict: "a mapping", int: "an integer"}


@dataclass
class Suite:
    name: str
    claim: str
    variants: list[dict] = field(default_factory=list)    # [{label, set, labels}]
    axes: list[dict] = field(default_factory=list)        # [{name, key?, values}]
    base: dict = field(default_factory=dict)              # {model: {...}, train: {...}}
    match: dict | None = None                              # {by, knob, multiple, tolerance}
    seeds: int = 2
    scales: dict = field(default_factory=dict)             # merged over DEFAULT_SCALES
    measure: list[str] = field(default_factory=list)
    rules: list[Rule] = field(default_factory=list)
    published: str = ""
    lr_axis: str | None = None                             # axis plotted as "loss vs learning rate"
    notes: str = ""
    timing_seq_len: int | None = None                      # paired step times at this length, batch 1
                                                           # (None: the runs' own batch and length)
    analysis: str | None = None                            # one of ANALYSES: its own report section
    corpus: str | None = None                              # the corpus a sweep prepares unless told otherwise
    runs: str = "train"                                    # one of RUN_KINDS: what each run is
    finetune: dict | None = None                           # runs: finetune: {bases, pretrain, test_words}
                                                           # (archlab.lab.plan.FINETUNE_SETTINGS)
    extend: dict | None = None                             # runs: extend: {factor, bases, train, passkey_trials}
                                                           # (archlab.lab.plan.EXTEND_SETTINGS)
    real_model: dict | None = None                         # runs: real_model: {measure, model, text, tokens, ...}

    def __post_init__(self):
        for name, kind in _FIELD_TYPES.items():
            value = getattr(self, name)
            if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
                raise ConfigError(f"suite {self.name}: `{name}` must be {_KIND_NAMES[kind]}, got {value!r}")
        for rule in self.rules:
            if not isinstance(rule, (Rule, dict)):
                raise ConfigError(f"suite {self.name}: each of `rules` must be a mapping, got {rule!r}")
        self.rules = [r if isinstance(r, Rule) else Rule(**r) for r in self.rules]
        unknown = set(self.measure) - set(MEASUREMENTS)
        if unknown:
            raise ConfigError(f"suite {self.name}: unknown measurement(s) {sorted(unknown)}; "
                              f"known: {', '.join(MEASUREMENTS)}")
        if not self.variants and not self.axes:
            raise ConfigError(f"suite {self.name} has neither variants nor axes")
        if self.match is not None and self.match.get("by", "params") not in MATCH_BY:
            raise ConfigError(f"suite {self.name}: match.by must be one of {', '.join(MATCH_BY)}")
        if self.seeds < 1:
            raise ConfigError(f"suite {self.name}: seeds={self.seeds} must be >= 1")
        if self.analysis is not None and self.analysis not in ANALYSES:
            raise ConfigError(f"suite {self.name}: analysis={self.analysis!r}; known: {', '.join(ANALYSES)}")
        if self.runs not in RUN_KINDS:
            raise ConfigError(f"suite {self.name}: runs={self.runs!r}; known: {', '.join(RUN_KINDS)}")

    # ---- expansion ---------------------------------------------------------------------------
    def expand(self, scale: str | None = None) -> list[Variant]:
        """The variants to run: the axes' product, then the explicit list; names must be unique. A scale
        may replace axes by name (`scales: {large: {axes: [...]}}`: a model ladder sized for GPUs)."""
        out: list[Variant] = []
        if self.axes:
            own = {a.get("name"): a for a in (self.scales.get(scale, {}).get("axes") or [])} if scale else {}
            options = [_axis_options(own.get(axis.get("name"), axis), self.name) for axis in self.axes]
            for combo in itertools.product(*options):
                sets: dict[str, Any] = {}
                for _, _, s in combo:
                    sets.update(s)
                labels = {axis_name: label for axis_name, label, _ in combo}
                name = ",".join(_label_text(axis, text) for axis, text in labels.items())
                out.append(_variant(name, sets, labels))
        for v in self.variants:
            if "label" not in v:
                raise ConfigError(f"suite {self.name}: every entry of `variants` needs a label")
            labels = {k: str(x) for k, x in (v.get("labels") or {"variant": v["label"]}).items()}
            out.append(_variant(str(v["label"]), dict(v.get("set") or {}), labels))
        names = [v.name for v in out]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ConfigError(f"suite {self.name}: duplicate variant names {sorted(dupes)}")
        return out

    def scale(self, name: str) -> dict[str, Any]:
        """Budget and overrides of a scale: DEFAULT_SCALES merged with the suite's own."""
        if name not in DEFAULT_SCALES and name not in self.scales:
            raise ConfigError(f"unknown scale {name!r}; known: {sorted(set(DEFAULT_SCALES) | set(self.scales))}")
        base = DEFAULT_SCALES.get(name, {})
        own = self.scales.get(name, {})
        return {
            "budget": own.get("budget", base.get("budget")),
            "unit": own.get("unit", base.get("unit", "steps")),
            "model": {**base.get("model", {}), **own.get("model", {})},
            "train": {**base.get("train", {}), **own.get("train", {})},
            "corpus": own.get("corpus"),
        }

    def base_overrides(self, scale: str) -> tuple[dict, dict]:
        """(model overrides, train overrides) of the suite base at a scale, before any variant."""
        sc = self.scale(scale)
        model = {**BASE_MODEL, **sc["model"], **(self.base.get("model") or {})}
        train = merge_train(BASE_TRAIN, sc["train"], self.base.get("train") or {})
        return model, train

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rules"] = [asdict(r) for r in self.rules]
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "Suite":
        if not isinstance(data, dict):
            raise ConfigError("a suite must be a mapping")
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown suite field(s): {', '.join(sorted(unknown))}")
        if "name" not in data or "claim" not in data:
            raise ConfigError("a suite needs `name` and `claim`")
        return cls(**data)


def _label_text(axis: str, label: str) -> str:
    return label if axis == "variant" or "=" in label else f"{axis}={label}"


def _axis_options(axis: dict, suite: str) -> list[tuple[str, str, dict]]:
    if "name" not in axis or "values" not in axis:
        raise ConfigError(f"suite {suite}: an axis needs `name` and `values`")
    out = []
    for value in axis["values"]:
        if isinstance(value, dict):
            if "label" not in value or "set" not in value:
                raise ConfigError(f"suite {suite}, axis {axis['name']}: a value mapping needs label and set")
            out.append((axis["name"], str(value["label"]), dict(value["set"])))
        else:
            if "key" not in axis:
                raise ConfigError(f"suite {suite}, axis {axis['name']}: plain values need the axis `key`")
            out.append((axis["name"], _fmt(value), {axis["key"]: value}))
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _variant(name: str, sets: dict, labels: dict) -> Variant:
    model = {k: v for k, v in sets.items() if not k.startswith(("train.", "ngram.", "extend.", "real."))}
    train, ngram, extend, real = ({k[len(p):]: v for k, v in sets.items() if k.startswith(p)}
                                  for p in ("train.", "ngram.", "extend.", "real."))
    return Variant(name=name, model=model, train=train, labels=labels, ngram=ngram, extend=extend, real=real)


def slug(name: str) -> str:
    """A name as a folder name: runs/<variant>/, models/<file>-<hash>/."""
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", name).strip("_") or "variant"


def build_model_config(model_overrides: dict) -> ModelConfig:
    return ModelConfig().with_overrides(model_overrides)


# --------------------------------------------------------------------------- built-in suites
def _lr_axis(values: list[float]) -> dict:
    return {"name": "lr", "values": [{"label": f"{v:g}", "set": {"train.lr": v}} for v in values]}


# ---- the built-in suites: one function per claim, registered in the order `archlab ablate --list` shows
LRS = [3e-3, 1e-2, 3e-2]     # the learning-rate axis of the stability suites
_BUILTIN_FUNCTIONS: list[Callable[[], Suite]] = []


def builtin_suite(build: Callable[[], Suite]) -> Callable[[], Suite]:
    """Register a function that returns one built-in Suite (its name is the suite's)."""
    _BUILTIN_FUNCTIONS.append(build)
    return build


@builtin_suite
def _norm_position() -> Suite:
    return Suite(
        name="norm_position",
        claim="Pre-norm trains stably without warmup where post-norm does not: lower LR sensitivity "
              "and no more divergences across learning rates",
        axes=[{"name": "norm", "key": "norm.position", "values": ["pre", "post", "sandwich", "post_sublayer"]},
              _lr_axis(LRS)],
        base={"train": {"warmup_steps": 0}},
        seeds=2, lr_axis="lr",
        scales={"small": {"budget": 150, "unit": "steps"}},
        rules=[
            Rule(kind="less", metric="lr_sensitivity", over="lr", a={"norm": "pre"}, b={"norm": "post"},
                 statement="LR sensitivity (Wortsman et al. 2023) of pre-norm below post-norm's"),
            Rule(kind="less", metric="final_val_loss", a={"norm": "pre", "lr": "0.01"},
                 b={"norm": "post", "lr": "0.01"},
                 statement="at LR 1e-2 without warmup, pre-norm ends below post-norm"),
        ],
        published="Xiong et al. 2020: Post-LN gradients at init grow ~20x from layer 1 to 6, Pre-LN flat; "
                  "Pre-LN without warmup reaches Post-LN-with-warmup loss ~3 epochs earlier",
        notes="sandwich = pre+post (Gemma 2); post_sublayer = OLMo 2's norm after each sublayer. Warmup 0.",
    )


@builtin_suite
def _norm_kind() -> Suite:
    return Suite(
        name="norm_kind",
        claim="RMSNorm matches LayerNorm's loss and is faster",
        axes=[{"name": "norm", "key": "norm.kind", "values": ["layernorm", "rmsnorm"]}],
        base={"model": {"bias.norm": True}},
        seeds=3, measure=["paired_step_time"],
        rules=[
            Rule(kind="parity", metric="final_val_loss", a={"norm": "rmsnorm"}, b={"norm": "layernorm"},
                 tol=0.02, statement="RMSNorm's final loss within 2% of LayerNorm's"),
            Rule(kind="less", metric="paired_step_s", a={"norm": "rmsnorm"}, b={"norm": "layernorm"},
                 statement="RMSNorm's step time below LayerNorm's (steps timed side by side)"),
        ],
        published="Zhang & Sennrich 2019: comparable quality, running time -7% to -64%; Narang et al. 2021: "
                  "RMSNorm 1.821 vs vanilla 1.838, 3.68 vs 3.50 steps/s",
        notes="LayerNorm keeps its bias (beta) here, as in the original; RMSNorm has none. On CPU, "
              "PyTorch's LayerNorm is one native kernel each way, RMSNorm ours (nn/fused.py, float32 "
              "math, a hand-written backward): the speed rule compares implementations as much as maths.",
    )


@builtin_suite
def _bias() -> Suite:
    return Suite(
        name="bias",
        claim="Dropping bias terms costs no quality",
        variants=[
            {"label": "none", "set": {}, "labels": {"bias": "none"}},
            {"label": "all", "set": {"bias.qkv": True, "bias.attn_out": True, "bias.mlp": True,
                                     "bias.norm": True, "norm.kind": "layernorm"}, "labels": {"bias": "all"}},
            {"label": "none-layernorm", "set": {"norm.kind": "layernorm"}, "labels": {"bias": "none-ln"}},
        ],
        seeds=3,
        # 0.02 nats: half the smallest effect the lab's `less` rules resolve (gated vs ungated FFNs,
        # about 0.04 nats in CLAIMS.md), so parity cannot hold across a gap the size of a real effect
        rules=[Rule(kind="parity", metric="final_val_loss", a={"bias": "none-ln"}, b={"bias": "all"},
                    tol_abs=0.02, statement="no biases within 0.02 nats of biases everywhere (both LayerNorm)")],
        published="Lecture: modern LMs drop biases for memory and stability (no loss figure given)",
    )


@builtin_suite
def _activation() -> Suite:
    return Suite(
        name="activation",
        claim="Gated FFNs (ReGLU, GeGLU, SwiGLU) beat ungated ones (ReLU, GeLU, ReLU^2) at matched parameters",
        axes=[{"name": "act", "key": "mlp.activation",
               "values": ["relu", "gelu", "relu2", "elu", "selu", "reglu", "geglu", "swiglu", "glu",
                          "bilinear"]}],
        base={"model": {"mlp.activation": "relu", "mlp.d_ff": 256}},
        match={"by": "params", "knob": "mlp.d_ff", "tolerance": 0.02},
        seeds=3,
        scales={"small": {"budget": 250, "unit": "steps"}},
        rules=[
            Rule(kind="less", metric="final_val_loss", a={"act": ["reglu", "geglu", "swiglu"]},
                 b={"act": ["relu", "gelu", "relu2"]},
                 statement="mean loss of the gated group below the ungated group"),
            Rule(kind="less", metric="final_val_loss", a={"act": "swiglu"}, b={"act": "relu"},
                 statement="SwiGLU below ReLU"),
        ],
        published="Shazeer 2020 Table 1 (log-ppl, T5-base 65k steps): ReLU 1.997, GELU 1.983, GLU 1.982, "
                  "Bilinear 1.960, ReGLU 1.953, GEGLU 1.942, SwiGLU 1.944 (std 0.003-0.010); Narang et al. "
                  "2021: vanilla 1.838, SwiGLU 1.789; ELU (Clevert et al. 2015) and SELU (Klambauer et al. "
                  "2017) measured beside them",
        notes="Base is a plain ReLU MLP with d_ff = 4 d_model; every variant's d_ff is solved so its "
              "parameter count is within 2% of the base's (gated ~ 2/3 of the width).",
    )


@builtin_suite
def _ffn_ratio() -> Suite:
    return Suite(
        name="ffn_ratio",
        claim="Loss is flat for d_ff/d_model in 1-4 at fixed parameters and rises slowly beyond",
        axes=[{"name": "ratio", "values": [
            {"label": f"{r:g}", "set": {"mlp.d_ff_ratio": float(r), "mlp.d_ff": None}}
            for r in (1, 2, 4, 8, 16, 32)]}],
        base={"model": {"mlp.activation": "relu", "mlp.d_ff": None, "mlp.d_ff_ratio": 4.0,
                        "attention.head_dim": 16}},
        match={"by": "params", "knob": "d_model", "tolerance": 0.03},
        seeds=2,
        rules=[
            Rule(kind="flat", metric="final_val_loss", a={"ratio": ["1", "2", "4"]}, tol=0.03,
                 statement="final losses for ratios 1, 2, 4 within 3% of each other"),
            Rule(kind="less", metric="final_val_loss", a={"ratio": "4"}, b={"ratio": "32"},
                 statement="ratio 4 below ratio 32"),
        ],
        published="Kaplan et al. 2020 Fig. 5: d_ff/d_model 1-4 ~ flat, ~+1.5% at 8, ~+8% at ~45",
        notes="Parameters held fixed by solving d_model (head_dim fixed at 16, 4 heads); ReLU MLP.",
    )


@builtin_suite
def _heads() -> Suite:
    return Suite(
        name="heads",
        claim="Head count at fixed d_model barely matters; GQA matches MHA and MQA is close, "
              "with the KV cache divided by the group size",
        variants=[
            *({"label": f"h{h}", "set": {"attention.n_heads": h}, "labels": {"heads": str(h), "kv": "mha"}}
              for h in (1, 2, 4, 8, 16)),
            {"label": "h8-gqa2", "set": {"attention.n_heads": 8, "attention.n_kv_heads": 2},
             "labels": {"heads": "8", "kv": "gqa"}},
            {"label": "h8-mqa", "set": {"attention.n_heads": 8, "attention.n_kv_heads": 1},
             "labels": {"heads": "8", "kv": "mqa"}},
        ],
        seeds=2, measure=["kv_cache_bytes"],
        rules=[
            Rule(kind="flat", metric="final_val_loss", a={"kv": "mha", "heads": ["2", "4", "8"]}, tol=0.03,
                 statement="MHA with 2, 4, 8 heads within 3% of each other"),
            Rule(kind="parity", metric="final_val_loss", a={"kv": "gqa"}, b={"kv": "mha", "heads": "8"},
                 tol=0.02, statement="GQA (8 heads, 2 KV heads) within 2% of MHA"),
            Rule(kind="parity", metric="final_val_loss", a={"kv": "mqa"}, b={"kv": "mha", "heads": "8"},
                 tol=0.03, statement="MQA within 3% of MHA"),
            Rule(kind="ratio", metric="kv_cache_bytes", a={"kv": "mqa"}, b={"kv": "mha", "heads": "8"},
                 expected=1 / 8, statement="MQA's KV cache is 1/8 of MHA's (8 heads)"),
            Rule(kind="ratio", metric="kv_cache_bytes", a={"kv": "gqa"}, b={"kv": "mha", "heads": "8"},
                 expected=1 / 4, statement="GQA-2's KV cache is 1/4 of MHA's (8 heads)"),
        ],
        published="Ainslie et al. 2023: T5-XXL avg 47.2 (MHA) vs 47.1 (GQA-8) vs 46.6 (MQA); KV cache / G",
        notes="d_model 64: h16 has head_dim 4. GQA/MQA have fewer K/V parameters (not matched).",
    )


@builtin_suite
def _aspect_ratio() -> Suite:
    return Suite(
        name="aspect_ratio",
        claim="At fixed parameters, loss is insensitive to depth vs width over a wide range",
        axes=[{"name": "layers", "key": "n_layers", "values": [1, 2, 4, 8, 12]}],
        base={"model": {"mlp.d_ff": None, "mlp.d_ff_ratio": 2.6667, "attention.head_dim": 16}},
        match={"by": "params", "knob": "d_model", "tolerance": 0.03},
        seeds=2,
        rules=[Rule(kind="flat", metric="final_val_loss", a={"layers": ["2", "4", "8"]}, tol=0.03,
                    statement="2, 4 and 8 layers (same parameters) within 3% of each other")],
        published="Kaplan et al. 2020 Fig. 5: loss within a few % across aspect ratios ~10-300",
        notes="d_model solved per depth for equal parameters; 4 heads of dim 16 at every width.",
    )


@builtin_suite
def _parallel() -> Suite:
    return Suite(
        name="parallel",
        claim="Parallel attention+MLP blocks match serial blocks' loss and run faster",
        axes=[{"name": "block", "values": [
            {"label": "serial", "set": {"block.parallel": False}},
            {"label": "parallel", "set": {"block.parallel": True}}]}],
        seeds=3, measure=["paired_step_time"],
        rules=[
            Rule(kind="parity", metric="final_val_loss", a={"block": "parallel"}, b={"block": "serial"},
                 tol=0.02, statement="parallel's final loss within 2% of serial's"),
            Rule(kind="less", metric="paired_step_s", a={"block": "parallel"}, b={"block": "serial"},
                 statement="parallel's step time below serial's (steps timed side by side)"),
        ],
        published="PaLM/GPT-J: ~15% faster training at large scale, small quality cost at 8B, none at 62B",
        notes="Our parallel block runs the two branches as separate matmuls (no fused projection, PaLM's "
              "source of the speed-up); it saves one norm and one residual add per block.",
    )


@builtin_suite
def _rank_collapse() -> Suite:
    return Suite(
        name="rank_collapse",
        claim="Encoders are more prone to rank collapse than decoders: a masked-LM encoder's final hidden states "
              "have a lower effective rank than a causal decoder's of the same size",
        # one id past the byte vocabulary (257) for both: the encoder's [MASK], never a target of the decoder
        axes=[{"name": "arch", "values": [
            {"label": "decoder", "set": {"vocab_size": 258}},
            {"label": "encoder", "set": {"arch": "encoder", "vocab_size": 258, "train.mlm.mask_token_id": 257}}]}],
        seeds=3, measure=["effective_rank"],
        rules=[
            Rule(kind="less", metric="final_effective_rank", a={"arch": "encoder"}, b={"arch": "decoder"},
                 statement="the MLM encoder's final effective rank below the causal decoder's"),
        ],
        published="Lecture notes (004): encoders are more prone to rank collapse than decoders; Dong et al. 2021: "
                  "pure self-attention loses rank doubly exponentially with depth, skip connections and MLPs "
                  "counter it",
        notes="Effective rank (Roy & Vetterli 2007): exp of the entropy of the normalized singular values of one "
              "validation window's final hidden states (before the final norm), mean over 4 windows of the "
              "training length. The encoder trains on BERT's masked LM (15%, 80/10/10), the decoder on next "
              "tokens: their losses are not comparable, so no rule compares them. The encoder has the MLM "
              "head's transform on top (+2% parameters). Written for the built-in byte-level data (the [MASK] "
              "id is 257, one past the bytes and end-of-text).",
    )


@builtin_suite
def _lm_architecture() -> Suite:
    return Suite(
        name="lm_architecture",
        claim="Given the same parameters and the same tokens processed, reading the context bidirectionally helps "
              "predict its continuation: a prefix-LM and an encoder-decoder score the continuation better than "
              "a causal decoder",
        # every variant reads the same windows and is scored on the same second halves (objectives.Continuation)
        axes=[{"name": "arch", "values": [
            {"label": "decoder", "set": {"train.objective": "continuation"}},
            {"label": "prefix_lm", "set": {"attention.prefix_lm": True, "train.objective": "continuation"}},
            {"label": "encoder_decoder", "set": {"arch": "encoder_decoder", "n_layers": 2, "decoder_layers": 2,
                                                 "train.objective": "continuation"}}]}],
        match={"by": "params", "knob": "mlp.d_ff", "tolerance": 0.02},
        # init std d_model**-0.5 for all three (T5's scale): at the lab's usual 0.02 a model this narrow keeps its
        # cross-attention near uniform for hundreds of steps, which would judge the init, not the architecture
        scales={"small": {"budget": 300, "unit": "steps", "model": {"init.std": 64 ** -0.5}},
                "large": {"budget": 4000, "unit": "steps",
                          "train": {"batch_size": 64, "seq_len": 256, "eval_every": 500, "eval_batches": 32,
                                    "warmup_steps": 200, "dtype": "auto"},
                          "model": {"d_model": 256, "n_layers": 4, "attention.n_heads": 8, "mlp.d_ff": 688,
                                    "init.std": 256 ** -0.5}}},
        seeds=3,
        rules=[
            Rule(kind="less", metric="final_val_loss", a={"arch": "prefix_lm"}, b={"arch": "decoder"},
                 statement="the prefix-LM's continuation loss below the causal decoder's"),
            Rule(kind="less", metric="final_val_loss", a={"arch": "encoder_decoder"}, b={"arch": "decoder"},
                 statement="the encoder-decoder's continuation loss below the causal decoder's"),
        ],
        published="Raffel et al. 2020 (T5) §3.2, Table 2: with a language-modeling objective, a prefix LM and an "
                  "encoder-decoder transfer better than a causal decoder-only LM; lecture notes (004): decoder-only "
                  "models reuse their KV cache across turns, which encoder-decoders and prefix-LMs cannot",
        notes="Each window of seq_len tokens is split in half: the first half is context, the second is scored "
              "(objectives.Continuation). The decoder reads the window causally and the prefix-LM attends "
              "bidirectionally inside the first half; the encoder-decoder (2 encoder + 2 decoder layers) encodes "
              "the first half and decodes the second. All three read seq_len tokens per row (source + target: "
              "the tokens column) and are scored on the same seq_len / 2 targets. mlp.d_ff is matched so the "
              "parameter counts agree within 2% (the decoder's cross-attention costs the encoder-decoder width). "
              "Matched parameters are not matched compute: each token passes through 2 of the encoder-decoder's "
              "layers against the decoder's 4, about half the FLOPs per token (T5 Table 2's 'P params, M/2 "
              "FLOPs' row; its headline encoder-decoder has 2P parameters at M FLOPs).",
    )


@builtin_suite
def _position() -> Suite:
    return Suite(
        name="position",
        claim="Relative positions (RoPE, ALiBi) beat absolute ones, and ALiBi extrapolates past the "
              "training length where absolute positions do not",
        axes=[{"name": "pos", "key": "position.kind",
               "values": ["sinusoidal", "learned", "rope", "alibi", "none"]}],
        seeds=2, measure=["val_loss_2x"],
        rules=[
            Rule(kind="less", metric="final_val_loss", a={"pos": "rope"}, b={"pos": "sinusoidal"},
                 statement="RoPE's loss below sinusoidal's at the training length"),
            Rule(kind="less", metric="val_loss_2x", a={"pos": "alibi"}, b={"pos": "sinusoidal"},
                 statement="at 2x the training length ALiBi's loss below sinusoidal's"),
            Rule(kind="less", metric="val_loss_2x", a={"pos": "rope"}, b={"pos": "sinusoidal"},
                 statement="at 2x the training length RoPE's loss below sinusoidal's"),
        ],
        published="Press et al. 2021 (ALiBi): extrapolates to 2x+ length at no loss; sinusoidal degrades "
                  "quickly past the training length",
        notes="max_seq_len = training length, so learned positions have no rows at 2x: recorded n/a.",
    )


@builtin_suite
def _stability() -> Suite:
    return Suite(
        name="stability",
        claim="QK-norm, z-loss and attention-logit soft-capping widen the usable learning-rate range",
        axes=[{"name": "trick", "values": [
            {"label": "none", "set": {}},
            {"label": "z_loss", "set": {"z_loss": 1e-4}},
            {"label": "qk_norm", "set": {"attention.qk_norm": "per_head"}},
            {"label": "softcap", "set": {"attention.logit_softcap": 50.0}}]},
            _lr_axis([3e-3, 1e-2, 3e-2, 1e-1])],
        base={"train": {"warmup_steps": 10, "weight_decay": 0.0}},
        seeds=2, lr_axis="lr", measure=["max_attn_logit"],
        scales={"small": {"budget": 120, "unit": "steps"}},
        rules=[
            Rule(kind="less", metric="lr_sensitivity", over="lr", a={"trick": "qk_norm"}, b={"trick": "none"},
                 statement="QK-norm's LR sensitivity below the baseline's"),
            Rule(kind="less", metric="lr_sensitivity", over="lr", a={"trick": "z_loss"}, b={"trick": "none"},
                 statement="z-loss's LR sensitivity below the baseline's"),
            Rule(kind="less", metric="lr_sensitivity", over="lr", a={"trick": "softcap"}, b={"trick": "none"},
                 statement="soft-capping's LR sensitivity below the baseline's"),
            Rule(kind="less", metric="max_attn_logit", a={"trick": "qk_norm", "lr": "0.1"},
                 b={"trick": "none", "lr": "0.1"},
                 statement="at LR 0.1 QK-norm's max attention logit below the baseline's"),
        ],
        published="Wortsman et al. 2023: LR sensitivity = mean over a log LR grid of min(loss, initial) "
                  "- best; QK-norm and z-loss (1e-4) reduce it; attention logits > 1e4 precede divergence; "
                  "Gemma 2 caps attention logits at 50",
        notes="Weight decay 0 (Wortsman's output-logit divergence needs it off). Max attention logit is the "
              "largest raw q.k/sqrt(e) before any cap, over 4 validation windows.",
    )


@builtin_suite
def _regularization() -> Suite:
    return Suite(
        name="regularization",
        claim="Weight decay acts through the LR schedule: with a constant LR it does not help, after "
              "the LR decays it ends lowest; dropout does not help single-epoch pretraining",
        axes=[{"name": "schedule", "key": "train.schedule", "values": ["constant", "cosine"]},
              {"name": "wd", "key": "train.optimizer.weight_decay", "values": [0.0, 0.1, 0.5]}],
        variants=[{"label": "schedule=cosine,wd=0.1,dropout=0.1",
                   "set": {"train.schedule": "cosine", "train.optimizer.weight_decay": 0.1,
                           "attention.dropout": 0.1, "block.residual_dropout": 0.1},
                   "labels": {"schedule": "cosine", "wd": "0.1", "dropout": "0.1"}}],
        seeds=2,
        rules=[
            Rule(kind="less", metric="final_val_loss", a={"schedule": "cosine", "wd": "0.1", "dropout": None},
                 b={"schedule": "cosine", "wd": "0"},
                 statement="with cosine decay, WD 0.1 ends below WD 0"),
            Rule(kind="less", metric="final_val_loss", a={"schedule": "constant", "wd": "0"},
                 b={"schedule": "constant", "wd": "0.5"},
                 statement="with a constant LR, WD 0 ends below WD 0.5"),
            Rule(kind="less", metric="final_val_loss", a={"schedule": "cosine", "wd": "0.1", "dropout": None},
                 b={"dropout": "0.1"}, statement="no dropout ends below dropout 0.1"),
        ],
        published="Andriushchenko et al. 2023: constant LR: higher WD -> higher loss; after LR decay WD "
                  "0.1-0.3 ends lowest (~3.24 vs 3.27)",
    )


@builtin_suite
def _local_global() -> Suite:
    return Suite(
        name="local_global",
        claim="Sliding-window and interleaved local/global attention keep the quality of full attention "
              "and shrink the KV cache",
        variants=[
            {"label": "full", "set": {}, "labels": {"attn": "full"}},
            {"label": "local-w32", "set": {"attention.window": 32}, "labels": {"attn": "local"}},
            {"label": "LLLG-w32", "set": {"attention.window": 32, "attention.layer_pattern": "LLLG"},
             "labels": {"attn": "interleaved"}},
        ],
        seeds=3, measure=["kv_cache_bytes", "paired_step_time"], timing_seq_len=4096,
        rules=[
            Rule(kind="less", metric="paired_step_s", a={"attn": "local"}, b={"attn": "full"},
                 statement="at 4,096 tokens (batch 1, window 32) the sliding window's training step is faster "
                           "than full attention's: its cost follows the pairs attended (block-local kernel)"),
            Rule(kind="less", metric="paired_step_s", a={"attn": "interleaved"}, b={"attn": "full"},
                 statement="at 4,096 tokens the interleaved (3 local : 1 global) step is faster than full's"),
            Rule(kind="parity", metric="final_val_loss", a={"attn": "interleaved"}, b={"attn": "full"},
                 tol=0.02, statement="interleaved 3 local : 1 global within 2% of full attention"),
            Rule(kind="parity", metric="final_val_loss", a={"attn": "local"}, b={"attn": "full"},
                 tol=0.02, statement="sliding window (32) within 2% of full attention"),
            Rule(kind="less", metric="kv_cache_bytes", a={"attn": "interleaved"}, b={"attn": "full"},
                 statement="interleaved attention's KV cache (at 4x the training length) below full's"),
        ],
        published="Gemma 2 9B: window 4096/2048/1024 -> PPL 1.63/1.63/1.64; Gemma 3 local:global 1:1..7:1 "
                  "within ~0.1 PPL; KV-cache overhead at 32k ~60% global-only vs <15% at 1:3",
        notes="At the small scale the window (32) is half the training length (64); KV-cache bytes are "
              "computed at 4x the training length; step times at 4,096 tokens, where a window of 32 keys "
              "against ~2,048 for full attention leaves room to show the cost (training at that length would "
              "not fit the laptop budget).",
    )


@builtin_suite
def _sinks() -> Suite:
    return Suite(
        name="sinks",
        claim="Gated attention (and learned sink logits) remove the first-token attention sink and "
              "shrink massive activations without hurting loss",
        variants=[
            {"label": "baseline", "set": {}, "labels": {"attn": "baseline"}},
            {"label": "gated", "set": {"attention.gated": True}, "labels": {"attn": "gated"}},
            {"label": "learned_sinks", "set": {"attention.learned_sinks": True}, "labels": {"attn": "sinks"}},
        ],
        seeds=2, measure=["sinks"],
        rules=[
            Rule(kind="less", metric="first_token_mass", a={"attn": "gated"}, b={"attn": "baseline"},
                 statement="gated attention's first-token attention share below the baseline's"),
            Rule(kind="less", metric="first_token_mass", a={"attn": "sinks"}, b={"attn": "baseline"},
                 statement="learned sinks' first-token attention share below the baseline's"),
            Rule(kind="less", metric="massive_ratio", a={"attn": "gated"}, b={"attn": "baseline"},
                 statement="gated attention's max/median hidden-state ratio below the baseline's"),
            Rule(kind="parity", metric="final_val_loss", a={"attn": "gated"}, b={"attn": "baseline"}, tol=0.02,
                 statement="gated attention's loss within 2% of the baseline's"),
        ],
        published="Qiu et al. 2025: first-token share 46.7% -> 4.8%, max activation 1053 -> 94, PPL 6.03 -> "
                  "5.76; Xiao et al. 2023: sinks form in from-scratch 160M models; Sun et al. 2024: massive "
                  "activations up to ~1e4-1e5x the median",
        notes="first_token_mass: attention on position 0 averaged over layers, heads and queries 1..t-1 of "
              "4 validation windows (archlab.eval.diagnostics).",
    )


@builtin_suite
def _document_masks() -> Suite:
    return Suite(
        name="document_masks",
        claim="Masking attention across documents changes pretraining loss little at short context",
        axes=[{"name": "attention", "values": [
            {"label": "across-documents", "set": {"train.document_masks": False}},
            {"label": "within-documents", "set": {"train.document_masks": True}}]}],
        corpus="pystdlib",
        base={"model": {"max_seq_len": 256}, "train": {"seq_len": 256}},
        seeds=3,
        rules=[Rule(kind="parity", metric="final_val_loss", a={"attention": "within-documents"},
                    b={"attention": "across-documents"}, tol_abs=0.02,
                    statement="document masks within 0.02 nats of attending across documents (256 bytes)")],
        published="Llama 3 report (2407.21783) sec. 3.2: 'limited impact during standard pre-training', "
                  "important for very long sequences; SkyLadder (2503.15450): intra-document masking gives the "
                  "best perplexity at every context length",
        notes="Byte-level Python standard library (pystdlib: one document per module, most longer than the "
              "256-byte window), so few windows hold a boundary: the claim's short-context regime. With masks "
              "on, evaluation keeps documents apart too and skips the label that would predict a document's "
              "first byte from the previous one's end, so the two sides score almost the same bytes, not "
              "exactly the same. 0.02 nats: the lab's parity bar (see the bias suite).",
    )


def _post_training_base() -> dict:
    """The post-training demo's model and SFT settings (archlab.training.recipes.reverse_words) as a suite `base`:
    every key the demo sets away from the defaults, and every key the lab's base and scales set (so neither leaks
    in)."""
    from archlab.runs.train_section import current_key
    from archlab.training.config import TrainConfig
    from archlab.training.recipes import reverse_words

    def flat(d: dict, prefix: str = "") -> dict:
        out: dict = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    demo = reverse_words(quick=False)
    model, default_model = flat(demo["model"].to_dict()), flat(ModelConfig().to_dict())
    keep = set(BASE_MODEL) | {k for k, v in model.items() if v != default_model.get(k)}
    sft, default_train = flat(demo["sft"].to_dict()), flat(TrainConfig().to_dict())     # today's dotted keys
    scale_keys = [k for sc in DEFAULT_SCALES.values() for k in sc.get("train", {})]
    lab_keys = {current_key(k)[0] for k in [*BASE_TRAIN, *scale_keys]}
    keep_train = lab_keys | {k for k, v in sft.items() if v != default_train.get(k)}
    return {"model": {k: model[k] for k in sorted(keep - {"seed", "vocab_size"}) if k in model},
            "train": {k: sft[k] for k in sorted(keep_train - {"seed", "budget", "budget_unit", "device"})}}


_SFT_BUDGET = {"small": {"budget": 300, "unit": "steps"}, "large": {"budget": 300, "unit": "steps"}}
# What LoRA trains beside its adapters in this suite. The demo's model has learned absolute positions, which no
# rank-r update of the Linears can move: with them frozen, plain LoRA reached 0-4.5% held-out exact match where full
# fine-tuning reached 100% (an earlier report), and LoRA r=16 with the positions trainable reached 100%. ChatML's
# special tokens were never seen in pretraining, so their embedding rows train too (PEFT's trainable_token_indices).
LORA_EXTRA: dict[str, Any] = {"train.lora.modules_to_save": "abs_position", "train.lora.trainable_tokens": "template"}


@builtin_suite
def _lora_rank() -> Suite:
    lora = [{"label": f"lora-r{r}", "set": {"train.lora.r": r, "train.lora.targets": "all-linear", **LORA_EXTRA}}
            for r in (1, 4, 16)]
    return Suite(
        name="lora_rank",
        claim="LoRA at low rank comes close to full fine-tuning: on the post-training demo's task (reverse a word "
              "through the chat template) rank 4 is within a few points of full fine-tuning's exact match",
        axes=[{"name": "method", "values": [{"label": "full", "set": {}}, *lora]}],
        base=_post_training_base(), runs="finetune", corpus="reverse-words", seeds=2, scales=_SFT_BUDGET,
        rules=[
            Rule(kind="parity", metric="exact_match", a={"method": "lora-r4"}, b={"method": "full"}, tol_abs=0.05,
                 statement="LoRA r=4's held-out exact match within 5 points of full fine-tuning's"),
            Rule(kind="parity", metric="exact_match", a={"method": "lora-r1"}, b={"method": "lora-r16"},
                 tol_abs=0.05, statement="LoRA r=1's held-out exact match within 5 points of r=16's (Table 6: "
                                         "rank barely matters)"),
            Rule(kind="parity", metric="final_val_loss", a={"method": "lora-r4"}, b={"method": "full"},
                 tol_abs=0.05, statement="LoRA r=4's SFT validation loss within 0.05 nats per answer token of full "
                                         "fine-tuning's"),
        ],
        published="Hu et al. 2021 (2106.09685) Table 6: GPT-3 175B with LoRA on W_q, W_v, rank 1-8 within ~0.5 "
                  "points of rank 64 on WikiSQL and MultiNLI, at 10,000x fewer trainable parameters; Table 2: "
                  "LoRA matches or beats full fine-tuning on GLUE (RoBERTa, DeBERTa)",
        notes="One base (the demo's 0.6M-parameter decoder pretrained on plain 'reverse abcde' / 'edcba' documents, "
              "200 steps) shared by every run; each run fine-tunes it for the demo's 300 SFT steps (32 rows of "
              "packed ChatML examples, loss on the answers, lr 3e-3 for all methods) and is scored by greedy "
              "decoding on 200 held-out words (exact match, case ignored). LoRA on all Linears, alpha 16 for every "
              "rank (Hu et al. fix alpha and scale by alpha/r). Beside the adapters the learned position embeddings "
              "train whole (train.lora.modules_to_save=abs_position: no adapter on a Linear can move them, and "
              "with them frozen LoRA stayed at 0-4.5% exact match) and so do the embedding rows of ChatML's "
              "special tokens, which pretraining never saw (train.lora.trainable_tokens=template); the rest of "
              "the embedding and the (untied) output head stay frozen. Tolerances: 5 points of "
              "exact match is 10 of 200 words, about two binomial standard errors at 80%; 0.05 nats per answer "
              "token is the full model's probability of the answer within ~5% per token.",
    )


# a light SFT (80 of the demo's 200 steps) so that the fine-tuned model still misses some answers
_RLVR_BUDGET = {"small": {"budget": 80, "unit": "steps"}, "large": {"budget": 200, "unit": "steps"}}


@builtin_suite
def _rlvr() -> Suite:
    return Suite(
        name="rlvr",
        claim="RL with a verifiable reward sharpens, it does not widen: GRPO with an exact-match reward raises pass@1 "
              "much more than pass@16 (at large k the model before RL solves about as many problems)",
        variants=[{"label": "grpo", "set": {}}],
        base=_post_training_base(), runs="finetune", corpus="reverse-words", seeds=3, scales=_RLVR_BUDGET,
        finetune={"rlvr": {"steps": 40, "samples": 16}}, analysis="rlvr",
        rules=[
            Rule(kind="above", metric="pass1_gain", a={}, expected=0.0,
                 statement="GRPO raises pass@1 (after minus before) by more than the std over seeds"),
            Rule(kind="below", metric="passk_share", a={}, expected=0.5,
                 statement="pass@16's gain is less than half of pass@1's (Yue et al.: pass@1 rises much more than "
                           "pass@k at large k), by more than the std over seeds"),
        ],
        published="Yue et al. 2025 (2504.13837) Figs. 1-2: RLVR-trained models (GRPO, PPO on Qwen2.5 7B-32B, math "
                  "and code) beat their base at pass@1, while the base matches or beats them at pass@k for k in the "
                  "tens to 256: RL narrows the answers it samples toward ones the base already finds",
        notes="One base (the post-training demo's 0.6M-parameter decoder pretrained on plain 'reverse abcde' / "
              "'edcba' documents, 200 steps) shared by every run; each run fine-tunes it for 80 SFT steps (the "
              "demo's 200 at scale large; answers in lowercase or capitals by a coin), samples 16 answers per "
              "held-out word at temperature 1 (pass@k before), runs the demo's GRPO stage from it (40 steps, the "
              "demo's 60, of 8 prompts x 8 answers, lr 3e-4, beta 0, reward 1 when an answer is exactly the "
              "lowercase reversal) and samples again with the same seed (pass@k after). The 'before' is the 0-step "
              "model of the same seed. The reward model part of the claim list (held-out accuracy before PPO) is "
              "not measured here.",
    )


@builtin_suite
def _norm_transfer() -> Suite:
    return Suite(
        name="norm_transfer",
        claim="Post-norm transfers better in fine-tuning: fine-tuned the same way, a post-norm base ends with a "
              "higher held-out exact match and a lower fine-tuning loss than a pre-norm base",
        axes=[{"name": "norm", "key": "norm.position", "values": ["pre", "post"]}],
        base=_post_training_base(), runs="finetune", corpus="reverse-words", seeds=3, scales=_SFT_BUDGET,
        finetune={"bases": "per_seed"},
        rules=[
            Rule(kind="less", metric="exact_match", a={"norm": "pre"}, b={"norm": "post"},
                 statement="the post-norm base's fine-tuned held-out exact match above the pre-norm base's"),
            Rule(kind="less", metric="final_val_loss", a={"norm": "post"}, b={"norm": "pre"},
                 statement="the post-norm base's SFT validation loss below the pre-norm base's"),
        ],
        published="The lecture notes (001, PreNorm vs PostNorm, after kexue.fm/archives/9009): pre-norm trains more "
                  "easily, 'for the post-training fine-tuning, the post-normalization architecture has better "
                  "transfer performance'; Xiong et al. 2020 show Post-LN's bottom-layer gradients are smaller "
                  "at init; no published figure at this scale",
        notes="Each seed pretrains its own pre- and post-norm base (the demo's 2-layer decoder, 200 steps on plain "
              "'reverse abcde' / 'edcba' documents, the same data and settings) and fine-tunes each the same "
              "way (full fine-tuning, the demo's 300 SFT steps through ChatML), so the spread over seeds holds "
              "pretraining's noise as well as fine-tuning's. Scored by greedy decoding on 200 held-out words. "
              "Two layers is far from the depths where the pre/post difference is reported. Read the verdict with "
              "the bases' own exact match: at this scale no pretraining setting tried (lower lr, longer warmup, 3x "
              "the steps, BERT's embedding norm) gave a post-norm base the pre-norm one's quality "
              "(docs/lab_report/norm_transfer/), and bases of unequal quality do not test transfer.",
    )


def _size_axis(shapes: list[tuple[int, int]]) -> dict:
    """Model sizes as (d_model, n_layers): heads of dim 16, a SwiGLU width of ~8/3 d_model (a multiple of 4)."""
    return {"name": "size", "values": [
        {"label": f"d{d}L{n}", "set": {"d_model": d, "n_layers": n, "attention.n_heads": max(1, d // 16),
                                       "mlp.d_ff": round(8 / 3 * d / 4) * 4}} for d, n in shapes]}


def _tokens_axis(budgets: list[float]) -> dict:
    """Token budgets: each run's budget in tokens, its cosine schedule decaying over exactly that many."""
    def label(n: float) -> str:
        return f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}k"
    return {"name": "tokens", "values": [
        {"label": label(n), "set": {"train.budget": float(n), "train.budget_unit": "tokens"}} for n in budgets]}


@builtin_suite
def _scaling() -> Suite:
    # total parameters about doubling along each ladder, tokens doubling: anti-diagonals share C = 6 N D,
    # so the grid holds IsoFLOP profiles (approach 2) as well as the surface (approach 3)
    return Suite(
        name="scaling",
        claim="Loss falls as a power law in parameters N and in training tokens D: L(N, D) = E + A/N^alpha + "
              "B/D^beta fits the ladder, and the compute-optimal model grows with the compute budget",
        axes=[_size_axis([(32, 2), (48, 2), (64, 3), (80, 4), (96, 5)]),
              _tokens_axis([1e5 * 2 ** k for k in range(6)])],
        base={"train": {"eval_every": 200, "eval_batches": 32}},
        seeds=1, analysis="scaling",
        scales={"small": {"budget": 1e5, "unit": "tokens"},
                "large": {"budget": 1e7, "unit": "tokens",
                          "axes": [_size_axis([(128, 4), (192, 6), (256, 8), (384, 8), (512, 10)]),
                                   _tokens_axis([1e7 * 2 ** k for k in range(6)])]}},
        rules=[
            Rule(kind="power_law", metric="final_val_loss", params="total", tol=0.02,
                 statement="with N all parameters (Chinchilla's count), the fitted law's N and D terms each fall by "
                           "more than 2% of the loss over the ladder (95% bootstrap) and fit log L within 2% RMS"),
            Rule(kind="power_law", metric="final_val_loss", params="non_embedding", tol=0.02,
                 statement="the same with N the non-embedding parameters (Kaplan's count)"),
        ],
        published="Hoffmann et al. 2022 (approach 3, eq. 10): L = 1.69 + 406.4/N^0.34 + 410.7/D^0.28, N and D grow "
                  "about equally with compute, ~20 tokens per parameter (approaches 1-2); Kaplan et al. 2020: "
                  "L(N) ~ N^-0.076 (non-embedding N), L(D) ~ D^-0.095; Besiroglu et al. 2024 refit Chinchilla's "
                  "points and found intervals that exclude some published constants",
        notes="A ladder of 5 sizes (41k to 604k parameters, each about twice the last; 24k to 554k without the "
              "vocabulary and position matrices) x 6 token budgets (100k to 3.2M tokens, doubling), one seed: the "
              "fit's bootstrap gives the intervals. At the large scale: d128L4 to d512L10, 10M to 320M tokens. "
              "Each run's cosine schedule ends at its own budget (Hoffmann et al.: a schedule longer than the run "
              "overstates its loss). The variants set their budgets in tokens, so --budget does not apply. The "
              "byte-level Shakespeare corpus holds 4.9M training tokens, so no run repeats data at the small "
              "scale; the large one needs a corpus of >= 320M tokens for that.",
    )


@builtin_suite
def _emergence() -> Suite:
    return Suite(
        name="emergence",
        claim="The task's metric is not smooth: on multi-digit addition, exact match over the whole answer jumps "
              "across the model ladder while the per-digit accuracy behind it grows smoothly; in-context learning "
              "(k-shot lookups of random mappings given in the prompt) improves with model size",
        axes=[_size_axis([(32, 2), (48, 2), (48, 3), (64, 2), (64, 3), (80, 4)])],
        base={"train": {"eval_every": 500, "eval_batches": 16}},
        seeds=3, measure=["addition", "icl"], analysis="emergence", corpus="addition-2+icl",
        scales={"small": {"budget": 2e6, "unit": "tokens"},
                "large": {"budget": 2e7, "unit": "tokens", "corpus": "addition-4+icl",
                          "axes": [_size_axis([(128, 4), (192, 6), (256, 8), (384, 8), (512, 10)])]}},
        rules=[Rule(kind="sharper", metric="exact_match", versus="digit_accuracy", tol=0.15,
                    statement="exact match's largest rise between neighbouring sizes is a larger share of its "
                              "whole rise than per-digit accuracy's (by 0.15 or more)"),
               Rule(kind="less", metric="icl_accuracy", a={"size": "d32L2"}, b={"size": "d80L4"},
                    statement="k-shot accuracy (1 to 3 earlier examples of a fresh random mapping) of the largest "
                              "model above the smallest's")],
        published="Schaeffer et al. 2023: abilities that look emergent under exact match or multiple-choice grade "
                  "become smooth under per-token or edit-distance metrics (exact match ~ per-token accuracy ^ "
                  "answer length); Wei et al. 2022: emergent abilities appear abruptly with scale; Olsson et al. "
                  "2022 (2209.11895): in-context learning improves abruptly early in training, as induction heads "
                  "(prefix-matching attention) form, in models of 2+ layers",
        notes="The corpus is generated: addition lines (archlab.data.arithmetic) with k-shot mapping episodes among "
              "them (archlab.data.incontext: after each addition line, with probability 1/5, a line of 12 "
              "`key>value` pairs, 3 keys each shown 4 times with values drawn afresh per line; about half the "
              "bytes). In-context scores on 512 fresh episodes from one teacher-forced forward: the accuracy of "
              "values whose key was shown 1 to 3 times before (icl_accuracy; 0-shot is chance, 1/26), per shot "
              "count, and their NLL; beside them the largest prefix-matching score of any head on repeated random "
              "letters (induction heads, archlab diagnose). Addition: lines `a+b=s` of 2-digit numbers (4-digit at the "
              "large scale), the sum written least-significant digit first, 4.0M bytes; 512 held-out problems "
              "(pairs never in the corpus) are scored after training from one teacher-forced forward: exact "
              "match (every answer digit right, what greedy decoding writes), per-digit accuracy (overall and "
              "per position), and the answer's NLL per digit. Every size reads the same 2M tokens, so compute "
              "grows with N. Six sizes from 41k to 348k parameters, denser around 100k-200k, where single runs "
              "of 2-digit addition alone went from a plateau (d48L2: per-digit 0.37, exact 0) to solving it (d64L3: "
              "per-digit 0.95, exact 0.85); with the episodes, each size reads about half as much addition.",
    )


def _repeats_axis(budget: int, epochs: list[int]) -> dict:
    """One token budget drawn from budget / r unique tokens (chunks strided over the training split) repeated r
    times."""
    return {"name": "epochs", "values": [
        {"label": str(r), "set": {"train.budget": float(budget), "train.budget_unit": "tokens",
                                  "train.stream.unique_tokens": budget // r, "train.stream.unique_spread": True}}
        for r in epochs]}


REPETITION_EPOCHS = [1, 4, 16]


@builtin_suite
def _repetition() -> Suite:
    # budget ~ 20 tokens per parameter (Hoffmann et al.) for the small scale's 108k-parameter model, as Muennighoff
    # et al. size their models to the budget; 2^21 tokens divide evenly by 4 and 16
    return Suite(
        name="repetition",
        claim="Repeating data is almost as good as fresh data for a few epochs, then its value decays: at a fixed "
              "token budget, 4 epochs over a quarter of the data end within a small tolerance of one epoch over "
              "fresh data, while 16 epochs over a sixteenth end clearly worse",
        axes=[_repeats_axis(2 ** 21, REPETITION_EPOCHS)],
        base={"train": {"eval_every": 512, "eval_batches": 64}},
        seeds=3,
        scales={"small": {"budget": 2 ** 21, "unit": "tokens",
                          "model": {"d_model": 48, "n_layers": 3, "attention.n_heads": 3, "mlp.d_ff": 128}},
                "large": {"budget": 2 * 10 ** 7, "unit": "tokens", "corpus": "pystdlib-full",
                          "model": {"d_model": 128, "n_layers": 4, "attention.n_heads": 8, "mlp.d_ff": 344},
                          "axes": [_repeats_axis(2 * 10 ** 7, REPETITION_EPOCHS)]}},
        rules=[
            Rule(kind="parity", metric="final_val_loss", a={"epochs": "4"}, b={"epochs": "1"}, tol_abs=0.02,
                 statement="4 epochs over a quarter of the data within 0.02 nats of one epoch over fresh data"),
            Rule(kind="less", metric="final_val_loss", a={"epochs": "1"}, b={"epochs": "16"}, margin=0.02,
                 statement="16 epochs over a sixteenth of the data clearly worse: fresh data's loss below it by "
                           "more than 0.02 nats plus the seed spread"),
        ],
        published="Muennighoff et al. 2023 (2305.16264, Scaling Data-Constrained Language Models): with a fixed "
                  "compute budget, up to ~4 epochs of repeated data give negligible changes in loss against unique "
                  "data; the value of a repeated token decays with the repetitions (fitted R*_D ~ 15.4: 4 epochs are "
                  "worth ~93% of fresh tokens, 16 epochs ~66%), toward zero past ~16 (40 epochs: barely worth "
                  "training on)",
        notes="Every run reads the same token budget (2^21 = 2.1M bytes at the small scale, ~19 tokens per parameter "
              "of the 108k-parameter d48L3 model; the large scale: d128L4 on 20M tokens of the Python standard "
              "library with its tests) with the same cosine schedule; only the unique data differs: budget / r "
              "tokens of the training split (train.stream.unique_tokens), taken as chunks of at least 32 windows "
              "(2,048 tokens) evenly strided over the whole split (train.stream.unique_spread), so every work is "
              "represented at every r; the sampler repeats them for r epochs, each epoch in its own order and window "
              "offset, and no window crosses a chunk seam. (Taking the split's first budget / r tokens instead "
              "measured narrower data as much as repetition: 4 epochs then covered 4-5 of the works against 15.) "
              "The variants set their budgets in tokens, so --budget does not apply. "
              "Validation is the validation split (works never trained on), 64 batches of 16 x 64 tokens. "
              "Tolerances: 0.02 nats, the lab's parity bar (see the bias suite), also the margin by which 16 "
              "epochs must be worse.",
    )


@builtin_suite
def _ngram_baseline() -> Suite:
    return Suite(
        name="ngram_baseline",
        claim="The n-gram trade-off: if n is too small the model cannot capture long dependencies, if n is too "
              "large the probabilities cannot be estimated; smoothing with back-off (Kneser-Ney) keeps the gain",
        axes=[{"name": "order", "values": [{"label": str(n), "set": {"ngram.order": n, "ngram.add_k": 1.0}}
                                           for n in range(1, 9)]}],
        seeds=1, runs="ngram", analysis="ngram",
        rules=[
            Rule(kind="falls", metric="kn_bpb", over="order", tol=0.02,
                 statement="Kneser-Ney's validation bits/byte falls from n=1 to its best n by more than 2%"),
            Rule(kind="falls", metric="add_k_bpb", over="order", tol=0.02,
                 statement="the add-1 estimate's validation bits/byte falls from n=1 to its best n by more than 2%"),
            Rule(kind="rises_past_best", metric="add_k_bpb", versus="kn_bpb", over="order", tol=0.02,
                 statement="past its best n, the add-1 estimate's bits/byte rises by more than 2% of its best, "
                           "while Kneser-Ney's stays within 2% of its own best (flattens)"),
        ],
        published="Chen & Goodman 1998 compared n-gram smoothing methods across orders and training-set sizes: "
                  "interpolated modified Kneser-Ney was consistently the best, additive (add-k) smoothing among the "
                  "worst",
        notes="No model is trained: each run counts n-grams (n = 1..8) on the train split and scores every "
              "validation token (archlab.eval.ngram), once with interpolated modified Kneser-Ney and once with "
              "maximum likelihood plus add-1 (Laplace: (c(hw) + 1) / (c(h.) + V); an unseen history gets 1/V). "
              "Both are deterministic, so one seed; the rules compare the curves over n with a 2% tolerance.",
    )


_MOE = {"mlp.moe.n_experts": 8, "mlp.moe.top_k": 2}
_BALANCE = {"none": {**_MOE, "mlp.moe.aux_loss_coef": 0.0},
            "loss": {**_MOE, "mlp.moe.aux_loss_coef": 0.01},
            "bias": {**_MOE, "mlp.moe.balance": "bias", "mlp.moe.bias_update_rate": 0.001}}


@builtin_suite
def _moe() -> Suite:
    return Suite(
        name="moe",
        claim="Experts add parameters without adding compute: at matched active parameters and tokens, 8 experts "
              "with top-2 routing reach a lower validation loss than a dense MLP; without balancing the routing "
              "collapses onto few experts, and a balance loss or DeepSeek-V3's expert bias keeps it spread",
        variants=[{"label": "dense", "set": {}, "labels": {"mlp": "dense"}},
                  *({"label": f"moe8-top2,balance={b}", "set": sets, "labels": {"mlp": "moe", "balance": b}}
                    for b, sets in _BALANCE.items())],
        match={"by": "active", "knob": "mlp.d_ff", "tolerance": 0.02},
        seeds=3, measure=["expert_load"],
        rules=[
            Rule(kind="less", metric="final_val_loss", a={"mlp": "moe", "balance": "loss"}, b={"mlp": "dense"},
                 statement="8 experts top-2 with the balance loss end below dense at the same active parameters"),
            Rule(kind="less", metric="final_val_loss", a={"mlp": "moe", "balance": "bias"}, b={"mlp": "dense"},
                 statement="8 experts top-2 with the expert bias end below dense at the same active parameters"),
            Rule(kind="above", metric="busiest_expert_share", a={"balance": "none"}, expected=0.5,
                 statement="without balancing, the busiest expert is the first choice of more than 50% of tokens"),
            Rule(kind="below", metric="busiest_expert_share", a={"balance": "loss"}, expected=0.25,
                 statement="with the balance loss, the busiest expert is the first choice of less than 25% of tokens"),
            Rule(kind="below", metric="busiest_expert_share", a={"balance": "bias"}, expected=0.25,
                 statement="with the expert bias, the busiest expert is the first choice of less than 25% of tokens"),
        ],
        published="Fedus et al. 2021 (Switch, 2101.03961): Switch-Base reached T5-Base's quality up to 7x faster at "
                  "equal FLOPs per token; Shazeer et al. 2017: without a balancing term the gating network "
                  "converges to a state where it always gives large weights to the same few experts; DeepSeek-V3 "
                  "(2412.19437) and Wang et al. 2024 (2408.15664): a per-expert bias on the routing scores, moved "
                  "by +-gamma per step (gamma 0.001), balances without an auxiliary loss and ends with a lower loss "
                  "than the loss-balanced model",
        notes="Dense is the lab's SwiGLU MLP (d_ff 172); each MoE variant has 8 SwiGLU experts with d_ff solved so "
              "its active parameters (2 experts + the router per layer) are within 2% of dense's: about half the "
              "width, and 2.7x the total parameters. Every variant reads the same tokens. Balancing: none (no "
              "balance loss), loss (Switch's loss at 0.01 per layer, transformers' Mixtral scale), bias "
              "(DeepSeek-V3's bias, gamma 0.001 per optimizer step, no balance loss). 'Busiest expert' is "
              "measured after training on the validation batches: per MoE layer, the largest share of tokens "
              "whose first choice one expert is (1/8 = 12.5% at perfect balance), averaged over the 4 layers. "
              "It counts first choices because with top-2 an expert takes at most one of a token's two slots: "
              "its share of routed slots cannot pass 50%, and its share of tokens routed to it (either slot) "
              "cannot fall below 25%; both are in the table too (expert_load_routed).",
    )


# context_extension's methods: RoPE scaling kinds (nn/position.py); "ntk" is dynamic NTK, which at the extended
# length is NTK-aware scaling of the base (bloc97 2023), and below the original length changes nothing
_EXTENSIONS = {"none": None, "linear": "linear", "ntk": "dynamic", "yarn": "yarn"}


@builtin_suite
def _context_extension() -> Suite:
    methods = [{"label": name, "set": {"position.rope_scaling.kind": kind} if kind else {}}
               for name, kind in _EXTENSIONS.items()]
    zero_shot = {"steps": "0"}
    return Suite(
        name="context_extension",
        claim="RoPE scaling extends a model's context: without fine-tuning NTK-aware scaling and YaRN keep the "
              "perplexity at 4x the trained length where plain RoPE and position interpolation do not; after a "
              "short fine-tuning YaRN reaches what interpolation reaches, in fewer steps; passkey retrieval works "
              "at 4x after extension and not before",
        axes=[{"name": "method", "values": methods},
              {"name": "steps", "values": [{"label": str(n), "set": {"extend.steps": n}} for n in (0, 50, 200)]}],
        variants=[{"label": "method=yarn,steps=100", "set": {"position.rope_scaling.kind": "yarn", "extend.steps": 100},
                   "labels": {"method": "yarn", "steps": "100"}}],
        runs="extend", analysis="context", seeds=2,
        extend={"factor": 4, "bases": "per_seed", "lengths": [0.5, 1, 2, 4], "passkey_trials": 10,
                "train": {"lr": 1e-3, "warmup_steps": 5, "batch_size": 4, "eval_every": 1000, "eval_batches": 16}},
        scales={"small": {"budget": 600, "unit": "steps"},
                "large": {"budget": 4000, "unit": "steps"}},
        rules=[
            *[Rule(kind="less", metric="ppl_extended", a={"method": good, **zero_shot}, b={"method": bad, **zero_shot},
                   statement=f"without fine-tuning, {good.upper() if good == 'ntk' else 'YaRN'}'s perplexity at 4x "
                             f"the trained length below {'plain RoPE' if bad == 'none' else 'linear interpolation'}'s")
              for good in ("ntk", "yarn") for bad in ("linear", "none")],
            Rule(kind="less", metric="ppl_extended", a={"method": "yarn", "steps": "100"},
                 b={"method": "linear", "steps": "200"},
                 statement="YaRN after 100 steps below linear interpolation's perplexity at 4x after 200 steps "
                           "(it reaches it in half the steps)"),
            Rule(kind="above", metric="passkey_extended", a={"method": "yarn", "steps": "200"}, expected=0.9,
                 statement="after extension (YaRN, 200 steps) passkey accuracy at 4x the trained length above 90%"),
            Rule(kind="below", metric="passkey_extended", a={"method": "none", **zero_shot}, expected=0.2,
                 statement="before extension (plain RoPE, no fine-tuning) passkey accuracy at 4x below 20%"),
        ],
        published="Chen et al. 2023 (position interpolation, 2306.15595): LLaMA 7B-65B extended to 32,768 tokens "
                  "within ~1,000 fine-tuning steps, where extrapolation without it fails; Peng et al. 2023 (YaRN, "
                  "2309.00071): 10x fewer tokens and 2.5x fewer steps than earlier methods, Llama 2 to 64k/128k in "
                  "~400 steps, passkey retrieval ~100% over the extended context; NTK-aware scaling (bloc97 2023) "
                  "works without fine-tuning to ~2x",
        notes="Each seed trains one base at L = the scale's seq_len (small: the lab's 0.23M-parameter byte model, "
              "600 steps of 16 x 64 bytes of Shakespeare; large: the large scale's model at 256), shared by every "
              "method and step count. Each run gives RoPE its scaling over factor 4 with original_max_seq_len = L "
              "(what `archlab train --init-from RUN --set position.rope_scaling...` does), then either scores the "
              "base's weights as they are (steps 0) or fine-tunes them at 4L (batch 4, lr 1e-3, 5 warmup steps, "
              "cosine) for 50, 100 (YaRN only, for the rule) or 200 steps. 'ntk' is dynamic NTK (as transformers' "
              "`dynamic`: the base grows with the call's length past L). Perplexity: 16 validation batches of about "
              "4 x 4L tokens at each length, the same windows for every run; passkey: 10 keys at depths 0, 0.5 "
              "and 1 (Mohtashami & Jaggi's prompt, greedy). At L = 64 the passkey prompt only just fits 4L = 256 "
              "bytes (243 without filler), and a byte model of Shakespeare has never had to copy a number: the "
              "passkey rules can fail for that reason alone, which the verdicts then say.",
    )


# ---- the real-model suites (runs: real_model): a pretrained model converted from GGUF and measured, none trained
_REAL_NOTES = ("No model is trained: SmolLM2-135M-Instruct (the `models` extra's GGUF, Q4_1 dequantized to float32) is "
               "converted once into the sweep's models/ folder (--model takes another .gguf, a packaged model's name "
               "or a run folder), and each variant measures one condition on Hamlet (the Shakespeare corpus, past "
               "its header) in the model's own tokenizer. The measurements are deterministic: one seed, and the rules "
               "(kind bound) compare the values with the claim's bar, no spread. ")


@builtin_suite
def _massive_activations() -> Suite:
    return Suite(
        name="massive_activations",
        claim="Massive activations (Sun et al. 2024): in a pretrained LM a few activations of the first token reach "
              ">= 1,000x the median in middle layers, in <= 2 dimensions, and the model depends on them: zeroing "
              "them destroys perplexity, zeroing as many random activations does not",
        axes=[{"name": "zeroed", "values": [{"label": z, "set": {"real.zeroed": z}}
                                            for z in ("none", "massive", "random")]}],
        seeds=1, runs="real_model", analysis="real_model",
        real_model={"measure": "massive_activations", "tokens": 1024, "seq_len": 256},
        rules=[
            Rule(kind="bound", metric="peak_ratio", a={"zeroed": "none"}, at_least=1_000,
                 statement="max/median |h| >= 1,000 in a middle layer (layers 2 .. L-3)"),
            Rule(kind="bound", metric="massive_at_first_token", a={"zeroed": "none"}, at_least=1.0,
                 statement="every massive activation (|h| > 100 and >= 1,000x the median) is at the first token"),
            Rule(kind="bound", metric="massive_dims", a={"zeroed": "none"}, at_least=1, at_most=2,
                 statement="they sit in 1 or 2 dimensions"),
            Rule(kind="bound", metric="ppl", a={"zeroed": "massive"}, b={"zeroed": "none"}, at_least=10,
                 statement="zeroing them (after every block from where they appear) multiplies perplexity by >= 10"),
            Rule(kind="bound", metric="ppl", a={"zeroed": "random"}, b={"zeroed": "none"}, at_most=1.05,
                 statement="zeroing as many random activations (token > 0; mean of 3 draws) keeps it within 5%"),
        ],
        published="Sun et al. 2024 (arXiv 2402.17762): a few fixed dimensions reach ~10^4-10^5x the median on the "
                  "first token from the early-middle layers on; setting them to zero destroys perplexity, setting "
                  "them to their mean does not",
        notes=_REAL_NOTES + "The probe (archlab.eval.diagnostics) reads 256 tokens; perplexity is over 1,024 tokens "
              "in windows of 256.",
    )


@builtin_suite
def _quantization() -> Suite:
    schemes = ("float", "w8a8_per_tensor", "w8a8_per_token", "int8_weight_only", "outlier_split")
    within = [Rule(kind="bound", metric="ppl", a={"scheme": s}, b={"scheme": "float"}, at_least=0.98, at_most=1.02,
                   statement=f"{label} stays within 2% of float's perplexity")
              for s, label in (("w8a8_per_token", "per-token W8A8"), ("int8_weight_only", "int8 weight-only"),
                               ("outlier_split", "the LLM.int8 outlier split (threshold 6)"))]
    return Suite(
        name="quantization",
        claim="Outliers break per-tensor int8 but not per-token, weight-only or LLM.int8's mixed precision "
              "(Dettmers et al. 2022)",
        axes=[{"name": "scheme", "values": [{"label": s, "set": {"real.scheme": s}} for s in schemes]}],
        seeds=1, runs="real_model", analysis="real_model",
        real_model={"measure": "quantization", "tokens": 512, "seq_len": 256},
        rules=[Rule(kind="bound", metric="ppl", a={"scheme": "w8a8_per_tensor"}, b={"scheme": "float"}, at_least=1.2,
                    statement="per-tensor W8A8 raises perplexity by >= 20%"), *within],
        published="Dettmers et al. 2022 (arXiv 2208.07339): systematic outlier features (magnitude >= 6) appear from "
                  "~6.7B parameters; vector-wise quantization with the mixed-precision decomposition keeps full "
                  "quality where per-tensor absmax int8 degrades",
        notes=_REAL_NOTES + "Every linear of the blocks is quantized (the head and embeddings stay float): weights "
              "int8 per output row, activations per tensor or per token (nn/quantize, the math the int8 run uses); "
              "int8 weight-only is `archlab quantize`'s own path (nn/int8); the outlier split keeps input columns "
              "with any |x| >= 6 in float. Perplexity over 512 tokens in windows of 256.",
    )


STREAMING_WINDOWS = (64, 256, 1024)     # cache sizes, the last the paper's
STREAMING_ROWS, STREAMING_SCORED = 4, 256   # stretches of text decoded as one batch, targets scored past the window


@builtin_suite
def _streaming() -> Suite:
    fair = str(STREAMING_WINDOWS[-1])
    return Suite(
        name="streaming",
        claim="Attention sinks (Xiao et al. 2023): past the window, a cache that drops the first tokens has a "
              "perplexity >= 3x that of one keeping 4 sink tokens (StreamingLLM), which stays within 10% of the "
              "full cache's",
        axes=[{"name": "cache", "values": [{"label": c, "set": {"real.cache": c}}
                                           for c in ("full", "window", "sinks")]},
              {"name": "window", "key": "real.window", "values": list(STREAMING_WINDOWS)}],
        seeds=1, runs="real_model", analysis="real_model",
        real_model={"measure": "streaming", "rows": STREAMING_ROWS, "scored": STREAMING_SCORED, "sinks": 4,
                    "tokens": STREAMING_ROWS * (STREAMING_WINDOWS[-1] + 1 + STREAMING_SCORED)},
        rules=[
            Rule(kind="bound", metric="ppl", a={"cache": "window", "window": fair},
                 b={"cache": "sinks", "window": fair},
                 at_least=3.0, statement=f"at window {fair} (the paper's cache size), dropping the first tokens gives "
                                         ">= 3x the perplexity of keeping 4 sinks"),
            Rule(kind="bound", metric="ppl", a={"cache": "sinks", "window": fair}, b={"cache": "full", "window": fair},
                 at_most=1.10, statement=f"at window {fair}, 4 sinks + {int(fair) - 4} recent tokens stay within 10% "
                                         "of the full cache"),
        ],
        published="Xiao et al. 2023 (arXiv 2309.17453), Table 1: Llama-2-13B on PG19 with a 1,024-token cache, window "
                  "attention (0+1024) perplexity 5,158 against 5.40 keeping 4 initial tokens (4+1020); a 160M model "
                  "trained from scratch: 27.87 (0+1024) against 18.05 (4+1020), a milder 1.54x",
        notes=_REAL_NOTES + f"For each window w, {STREAMING_ROWS} consecutive stretches of w + 1 + {STREAMING_SCORED} "
              "tokens are scored as decoding them one token at a time through the cache would score them "
              "(nn/kv_cache.SinkKVCache, positions inside the cache as in the paper; computed in one forward per "
              "variant, SinkKVCache.stretch, tested equal to the token-by-token decode) and the "
              f"{STREAMING_SCORED} targets of each past its window are scored (every one with more context than the "
              "cache holds); the full cache is one causal forward over the same tokens (what decoding through a "
              "full cache computes). The rules judge the paper's cache size, "
              f"{fair}; windows {', '.join(map(str, STREAMING_WINDOWS[:-1]))} show how the gap moves with it.",
    )


BUILTIN: dict[str, Suite] = {s.name: s for s in (build() for build in _BUILTIN_FUNCTIONS)}


def names() -> list[str]:
    return list(BUILTIN)


def load(name_or_path: str | Path) -> Suite:
    """A built-in suite by name, or a suite from a YAML file."""
    key = str(name_or_path)
    if key in BUILTIN:
        return BUILTIN[key]
    path = Path(key).expanduser()
    if path.is_file():
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
        return Suite.from_dict(data)
    raise ConfigError(f"{key!r} is neither a built-in suite ({', '.join(BUILTIN)}) nor a YAML file")


def initial_loss(vocab_size: int) -> float:
    """Loss of a uniform prediction, ln V: what a diverged run is scored as in LR sensitivity."""
    return math.log(vocab_size)
