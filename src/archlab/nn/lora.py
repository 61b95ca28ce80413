"""LoRA: low-rank adapters on a model's Linears (Hu et al. 2021, arXiv 2106.09685).

    y = W x + b + s * B (A dropout(x))       A (r, in), B (out, r), s = alpha / r (or alpha / sqrt(r): rsLoRA,
                                             Kalajdzievski 2023, arXiv 2312.03732)

`apply_lora(model, cfg)` swaps the targeted nn.Linear modules for `LoRALinear` in place and freezes every other
parameter. A LoRALinear is an nn.Linear that keeps the base `weight` and `bias` under their own names (state-dict
keys of the base are unchanged) and adds `lora_A` and `lora_B` beside them; A starts kaiming-uniform and B at zero,
as PEFT's default, so a fresh adapter changes nothing. `merge_lora(model)` folds W += s * B A and puts plain
Linears back. Decoding reads a Linear's matrix through `effective_weight()` (nn/fused packs the merged matrix), so
a packed decode step multiplies by W + s B A, not by the base alone.

Targets name Linears by archlab's short names (q, k, v, o, gate, up, down), by module names or dotted suffixes
(`q_proj`, `attn.q_proj`, `cross_attn.v_proj`), by a regular expression matched in full against a module's
names (`.*(q|v)_proj`: PEFT's string target_modules), or `all-linear` (every Linear but the LM head, as PEFT does);
the interop layer adds the checkpoint family's HF names (`module_names`). `trainable_tokens` (token ids) also
trains those rows of the input embedding (nn/trainable_tokens.py: PEFT's trainable_token_indices).
`modules_to_save` (PEFT's name) trains whole modules beside the adapters, e.g. learned position embeddings, which
a rank-r update of the Linears cannot reach: named as targets are (a module or one of its ancestors, by archlab's
path or the family's HF name); their parameters simply stay trainable, so their keys and merging are unchanged.
"""
from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from archlab.config import ConfigError
from archlab.nn.trainable_tokens import EMBED_PATH, parse_token_list, token_module, unwrap_embedding, wrap_embedding

__all__ = ["LoRAConfig", "LoRALinear", "ALIASES", "ALL_LINEAR", "apply_lora", "merge_lora", "lora_modules",
           "lora_state", "adapter_names", "linear_paths", "select", "select_modules", "saved_modules", "wrap",
           "parse_targets", "lora_scaling", "is_regex"]

ALIASES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
           "down": "down_proj"}
ALL_LINEAR = "all-linear"
HEAD_NAMES = ("lm_head",)          # the output layer all-linear leaves alone, as PEFT does


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """r: the rank; alpha: the scale's numerator; dropout on the adapter's input; targets: Linears by name (see
    the module docstring); use_rslora: scale alpha / sqrt(r) instead of alpha / r; trainable_tokens: token ids whose
    input-embedding rows train too (nn/trainable_tokens.py); modules_to_save: modules that train whole (an adapted
    model's config holds their resolved paths)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")
    use_rslora: bool = False
    trainable_tokens: tuple[int | str, ...] = ()   # ids; a run's config may name token texts / `template` until
                                                   # training.lora.resolve_tokens turns them into ids
    modules_to_save: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("targets", "modules_to_save"):
            value: object = getattr(self, name)
            object.__setattr__(self, name, parse_targets(value) if isinstance(value, str) else tuple(value))  # type: ignore[arg-type]
        tokens: object = self.trainable_tokens
        items: list = parse_token_list(tokens) if isinstance(tokens, str) else list(tokens)  # type: ignore[call-overload]
        items = [int(i) if isinstance(i, str) and i.isdecimal() else i for i in items]      # "5" is an id
        if any(isinstance(i, bool) or not isinstance(i, (int, str)) or (isinstance(i, int) and i < 0) for i in items):
            raise ConfigError(f"lora.trainable_tokens={items!r} must be token ids >= 0 (or token texts)")
        ids = sorted({i for i in items if isinstance(i, int)})
        texts = list(dict.fromkeys(i for i in items if isinstance(i, str)))
        object.__setattr__(self, "trainable_tokens", (*ids, *texts))
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ConfigError(f"lora.r={self.r!r} must be an integer >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout!r} must be in [0, 1)")
        if not self.targets:
            raise ConfigError("lora.targets is empty: name Linears (q, v, ...) or all-linear")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ConfigError(f"lora.alpha={self.alpha!r} must be a positive number")

    @property
    def scaling(self) -> float:
        return lora_scaling(self.alpha, self.r, self.use_rslora)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """trainable_tokens as ids; token texts left unresolved are a ConfigError naming them."""
        texts = [t for t in self.trainable_tokens if isinstance(t, str)]
        if texts:
            raise ConfigError(f"lora.trainable_tokens holds token texts {texts}: resolve them to ids with the run's "
                              "tokenizer first (training.lora.resolve_tokens)")
        return tuple(int(t) for t in self.trainable_tokens)

    @classmethod
    def from_dict(cls, data: dict) -> "LoRAConfig":
        """The config of a mapping (a run's config.yaml train.lora); unknown keys are a ConfigError.
        Example: LoRAConfig.from_dict({"r": 4, "targets": ["q", "v"]})"""
        from archlab.config import _build

        return _build(cls, data, "train.lora")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["targets"] = list(self.targets)
        d["trainable_tokens"] = list(self.trainable_tokens)
        d["modules_to_save"] = list(self.modules_to_save)
        return d


def lora_scaling(alpha: float, r: int, rslora: bool = False) -> float:
    """The update's scale: alpha / r (Hu et al. 2021), or alpha / sqrt(r) (rsLoRA)."""
    return alpha / (math.sqrt(r) if rslora else r)


def parse_targets(text: str) -> tuple[str, ...]:
    """"q, v,down" -> ("q", "v", "down"): a comma list as the command line gives it."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


class LoRALinear(nn.Linear):
    """nn.Linear plus a rank-r update: base `weight` / `bias` (frozen) and `lora_A` (r, in), `lora_B` (out, r)."""

    def __init__(self, base: nn.Linear, r: int, scaling: float, dropout: float = 0.0,
                 generator: torch.Generator | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias          # the same Parameters: base keys unchanged
        for name, value in vars(base).items():                   # plain flags the init reads (is_residual_out)
            if not name.startswith("_") and name not in ("in_features", "out_features", "training"):
                setattr(self, name, value)
        self.train(base.training)
        device, dtype = base.weight.device, base.weight.dtype
        a = torch.empty(r, self.in_features)               # drawn on the CPU: one generator gives one A anywhere
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)   # PEFT's default (init_lora_weights=True)
        self.lora_A = nn.Parameter(a.to(device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, device=device, dtype=dtype))
        self.scaling = scaling
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    @property
    def r(self) -> int:
        return self.lora_A.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # (..., in) -> (..., out)
        update = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)   # (..., r) -> (..., out)
        return F.linear(x, self.weight, self.bias) + update * self.scaling

    def delta_weight(self) -> torch.Tensor:                       # (out, in)
        return (self.lora_B @ self.lora_A) * self.scaling

    def effective_weight(self) -> torch.Tensor | None:
        """The matrix this layer multiplies by, W + s B A (nn/fused packs it for decoding); None while adapter
        dropout is active (training mode), when no single matrix is the layer."""
        if not self.has_matrix():
            return None
        with torch.no_grad():
            return self.weight + self.delta_weight().to(self.weight.dtype)

    def has_matrix(self) -> bool:
        """Whether one matrix is the layer now (not while adapter dropout is active)."""
        return not (self.training and isinstance(self.dropout, nn.Dropout))

    def weight_sources(self) -> list[torch.Tensor]:
        """The tensors effective_weight reads (a packed copy is rebuilt when one of them changes)."""
        return [self.weight, self.lora_A, self.lora_B]

    def merged(self) -> nn.Linear:
        """A plain nn.Linear holding W + s B A (the base Parameter updated in place) and the base bias."""
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        with torch.no_grad():
            self.weight += self.delta_weight().to(self.weight.dtype)
        out.weight, out.bias = self.weight, self.bias
        for name, value in vars(self).items():
            if not name.startswith("_") and name not in ("in_features", "out_features", "training", "scaling"):
                setattr(out, name, value)
        return out.train(self.training)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, scaling={self.scaling:g}"


def linear_paths(model: nn.Module) -> list[str]:
    """Dotted paths of the model's nn.Linear modules that an adapter may wrap (the LM head excluded)."""
    return [path for path, m in model.named_modules()
            if isinstance(m, nn.Linear) and path.rsplit(".", 1)[-1] not in HEAD_NAMES]


REGEX_CHARS = frozenset("*+?[](){}|^$\\")   # a target holding one of these is a regex (dots alone: a dotted suffix)


def is_regex(target: str) -> bool:
    """Whether a target is a regular expression, as PEFT's string target_modules is (matched in full against the
    module's name): it holds a regex operator other than '.'. Example: is_regex(".*(q|v)_proj") -> True"""
    return any(c in REGEX_CHARS for c in target)


def _matches(target: str, names: Iterable[str]) -> bool:
    """PEFT's rules: a name target matches a module one of whose names equals it or ends with '.' + it (PEFT's
    list form); a regex target (is_regex) one of whose names it matches in full (PEFT's string form,
    re.fullmatch). (The short aliases q, v, ... are the caller's: they name Linears only.)"""
    if is_regex(target):
        try:
            pattern = re.compile(target)
        except re.error as exc:
            raise ConfigError(f"lora target {target!r} is not a valid regular expression: {exc}") from None
        return any(pattern.fullmatch(n) for n in names)
    return any(n == target or n.endswith("." + target) for n in names)


def select(model: nn.Module, targets: Iterable[str],
           module_names: Callable[[str], Iterable[str]] | None = None) -> list[str]:
    """The Linear paths `targets` name (in model order); a target naming nothing is a ConfigError naming it.
    module_names(path): other names the Linear at `path` answers to (the family's HF module paths)."""
    paths = linear_paths(model)
    names = {p: [p, *(module_names(p) if module_names else ())] for p in paths}
    chosen: set[str] = set()
    for target in targets:
        if target == ALL_LINEAR:
            chosen.update(paths)
            continue
        hits = [p for p in paths if _matches(ALIASES.get(target, target), names[p])]
        if not hits:
            short = sorted({p.rsplit(".", 1)[-1] for p in paths})
            raise ConfigError(f"lora target {target!r} matches no Linear of this model "
                              f"(its Linears: {', '.join(short)}; or all-linear)")
        chosen.update(hits)
    return [p for p in paths if p in chosen]


def select_modules(model: nn.Module, names: Iterable[str],
                   module_names: Callable[[str], Iterable[str]] | None = None) -> list[str]:
    """The paths of the modules holding parameters that `names` name (in model order): a module matches a name
    when it, one of its ancestors or (module_names) its HF name is the name or ends with '.' + name. A name
    matching nothing is a ConfigError naming it. Example: select_modules(model, ["abs_position"]) ->
    ["abs_position.embedding"]"""
    owners = [path for path, m in model.named_modules()
              if path and next(m.parameters(recurse=False), None) is not None]

    def aliases(path: str) -> list[str]:
        parts = path.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts) + 1)] + list(module_names(path) if module_names
                                                                               else ())
    found = {p: aliases(p) for p in owners}
    chosen: set[str] = set()
    for name in names:
        hits = [p for p in owners if _matches(name, found[p])]
        if not hits:
            tops = sorted({p.split(".", 1)[0] for p in owners})
            raise ConfigError(f"lora modules_to_save {name!r} matches no module of this model (its modules: "
                              f"{', '.join(tops)})")
        chosen.update(hits)
    return [p for p in owners if p in chosen]


def saved_modules(model: nn.Module) -> list[str]:
    """The module paths an adapted model trains whole (its lora_config's modules_to_save).
    Example: saved_modules(apply_lora(gpt2, LoRAConfig(modules_to_save=("wpe",)), names))
    -> ["abs_position.embedding"]"""
    cfg = getattr(model, "lora_config", None)
    return list(cfg.modules_to_save) if isinstance(cfg, LoRAConfig) else []


def apply_lora(model: nn.Module, cfg: LoRAConfig, module_names: Callable[[str], Iterable[str]] | None = None,
               generator: torch.Generator | None = None) -> nn.Module:
    """Wrap the Linears `cfg.targets` name in LoRALinear (in place), and the input embedding in TrainableTokens
    when cfg.trainable_tokens lists ids; freeze every other parameter; returns the model. The adapters' A draws
    from `generator` (a CPU generator), else torch's global RNG.
    Example: apply_lora(model, LoRAConfig(r=8, alpha=16, targets=("q", "v")))"""
    if lora_modules(model) or token_module(model) is not None:
        raise ConfigError("this model already carries LoRA adapters (merge_lora first to add another)")
    paths = select(model, cfg.targets, module_names)
    saved = select_modules(model, cfg.modules_to_save, module_names)
    _check_saved(saved, paths, bool(cfg.trainable_tokens))
    _warn_rank(model, paths, cfg.r)
    model.requires_grad_(False)
    for path in paths:
        wrap(model, path, cfg.r, cfg.scaling, cfg.dropout, generator)
    if cfg.trainable_tokens:
        wrap_embedding(model, cfg.token_ids)
    for path in saved:
        model.get_submodule(path).requires_grad_(True)
    # read by saving and merging: the saved modules by their resolved paths
    model.lora_config = dataclasses.replace(cfg, modules_to_save=tuple(saved))   # type: ignore[assignment]
    return model


def _warn_rank(model: nn.Module, paths: list[str], r: int) -> None:
    """One warning when r exceeds min(in, out) of a target: B A then has rank min(in, out) at most, so the extra
    rank only costs memory and changes the alpha / r scale. A warning, not an error: PEFT accepts it and its
    adapters load alike, and a full-rank update of a small Linear is a legitimate choice."""
    shapes = [(p, int(m.in_features), int(m.out_features)) for p in paths
              if isinstance(m := model.get_submodule(p), nn.Linear)]
    over = [(p, n_in, n_out) for p, n_in, n_out in shapes if r > min(n_in, n_out)]
    if over:
        path, n_in, n_out = over[0]
        more = f" (and {len(over) - 1} more)" if len(over) > 1 else ""
        warnings.warn(f"lora.r={r} exceeds min(in, out)={min(n_in, n_out)} of {path} ({n_out}x{n_in}){more}: "
                      "the update's rank cannot exceed that; a smaller r gives the same reach", stacklevel=3)


def _check_saved(saved: list[str], adapted: list[str], tokens: bool) -> None:
    """A module trained whole cannot also carry an adapter, nor be the embedding whose rows train."""
    for path in saved:
        inner = next((p for p in adapted if p == path or p.startswith(path + ".")), None)
        if inner is not None:
            raise ConfigError(f"lora modules_to_save {path!r} holds the LoRA target {inner}: a module trains whole "
                              "or through an adapter, not both")
        if tokens and path == EMBED_PATH:
            raise ConfigError(f"lora modules_to_save {path!r} is the input embedding whose trainable_tokens rows "
                              "train: give one or the other")


def wrap(model: nn.Module, path: str, r: int, scaling: float, dropout: float = 0.0,
         generator: torch.Generator | None = None) -> LoRALinear:
    """Swap the nn.Linear at `path` for a LoRALinear around it (in place); returns it. For adapters whose ranks
    differ by module (a PEFT adapter's rank_pattern); `apply_lora` is the usual entry."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    base = getattr(parent, name)
    if not isinstance(base, nn.Linear) or isinstance(base, LoRALinear):
        raise ConfigError(f"{path} is not a plain Linear: no adapter can wrap it")
    adapted = LoRALinear(base, r, scaling, dropout, generator)
    setattr(parent, name, adapted)
    return adapted


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Path -> LoRALinear, in model order."""
    return {path: m for path, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_names(model: nn.Module) -> list[str]:
    """State-dict keys of the adapters' tensors (`...q_proj.lora_A`, `...q_proj.lora_B`; `embed.token_indices` and
    `embed.trainable_tokens_delta` with trainable tokens; the parameters of the modules trained whole)."""
    names = [f"{path}.{part}" for path in lora_modules(model) for part in ("lora_A", "lora_B")]
    if token_module(model) is not None:
        names += [f"{EMBED_PATH}.token_indices", f"{EMBED_PATH}.trainable_tokens_delta"]
    names += [f"{path}.{name}" for path in saved_modules(model)
              for name, _ in model.get_submodule(path).named_parameters(recurse=False)]
    return names


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by state-dict key (detached)."""
    own = model.state_dict()
    return {name: own[name].detach() for name in adapter_names(model)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += s B A; trainable token rows E[i] += delta) and put plain
    Linears (and a plain embedding) back, in place; the logits are the adapted model's. Parameters become
    trainable again, as in a freshly built model."""
    for path, m in lora_modules(model).items():
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, m.merged())
    unwrap_embedding(model)
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model.requires_grad_(True)
