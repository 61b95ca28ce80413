"""Weight tables: how a family names its tensors. A `Rule` maps HF tensors to ours (renamed, transposed, fused);
a family writes its rules as a table of name patterns, HF -> ours with `{i}` for the layer (in the manner of
torchtitan's state-dict adapters), and `table_rules` turns the table into the rules of one config: expanded over
its layers and kept where its model has the parameters."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch

from archlab.config import ConfigError, ModelConfig
from archlab.errors import UserError
from archlab.models import build_model
from archlab.models.legacy_keys import current_key


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


PRE_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}   # HF's names of a pre-norm
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
        # our names as the model holds them today (a table may use an earlier layout's: models/legacy_keys)
        rule = dataclasses.replace(rule, ours=tuple(current_key(name, cfg.arch) for name in rule.ours))
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
