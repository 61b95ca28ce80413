"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

PEFT names an adapter tensor after the HF module it wraps (`base_model.model.<module>.lora_A.weight`, (r, in);
`lora_B.weight`, (out, r)). Those module names come from the same family rules that name the base weights
(interop/families): the rule whose `ours` holds `blocks.0.attn.q_proj.weight` names the HF tensor
`model.layers.0.self_attn.q_proj.weight`, so the adapter of our `blocks.0.attn.q_proj` is PEFT's adapter of
`model.layers.0.self_attn.q_proj`. What a rule does to the weight's rows (a fused q/k/v split, a head
reorder, GPT-2's Conv1D transpose) is read off by pushing an index tensor through it, and done to B's rows:
  - one HF module = one Linear of ours: A and B as they are;
  - one HF module = several of ours (GPT-2's c_attn = q, k, v): loading gives each of ours PEFT's A and its rows
    of B (the same function); saving stacks our A's (rank r * n) and puts each B in its rows and its own
    columns, with that module's rank and alpha in PEFT's `rank_pattern` / `alpha_pattern`, so PEFT computes
    the same update.
Trainable token rows (nn/trainable_tokens.py) are PEFT's `trainable_token_indices` (the list form: the input
embedding's rows; a tied head follows it in PEFT as here; loading also reads one {embedding module: ids}, and
refuses other forms): the ids in adapter_config.json and the rows' new values,
E[i] + delta (PEFT stores values, not a difference), as `<embedding module>.token_adapter.trainable_tokens_delta`.
Modules trained whole (`modules_to_save`, e.g. GPT-2's `transformer.wpe`) are PEFT's `modules_to_save`: the HF
module names in adapter_config.json and their full tensors under the HF names the family rules give
(`base_model.model.transformer.wpe.weight`), converted by the rule as save_hf converts the base; a module whose
tensors no single-tensor rule names, or whose weight a tied head shares (PEFT copies the module and leaves the head
on the original), is refused.
`save_peft(model, folder)` writes an adapted model's adapters; `load_peft(model, folder)` wraps a model loaded from
the base's HF folder (`archlab.interop.load_hf(base, adapter=folder)`); `hf_module_names(model)` lets LoRA targets
name a family's HF modules (q_proj, c_attn, query, SelfAttention.q, ...).
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from archlab.config import ConfigError, ModelConfig
from archlab.interop.families import FAMILIES, Family, infer_family
from archlab.interop.families.tables import Rule, WeightsError, _identity
from archlab.interop.folders import read_json_object
from archlab.nn.lora import ALL_LINEAR, LoRAConfig, linear_paths, lora_modules, lora_scaling, saved_modules, wrap
from archlab.nn.trainable_tokens import EMBED_PATH, token_module, wrap_embedding
from archlab.runs.checkpoint import make_readable

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "PREFIX", "save_peft", "load_peft", "hf_module_names",
           "hf_slots", "peft_targeted"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."          # PeftModel -> LoraModel -> the HF model
TASK_TYPES = {"decoder": "CAUSAL_LM", "encoder_decoder": "SEQ_2_SEQ_LM", "encoder": None}
# adapter_config.json switches whose non-default values change the function: refused rather than ignored
REFUSED = {"use_dora": False, "lora_bias": False, "bias": "none", "target_parameters": None, "layer_replication": None,
           "use_qalora": False, "alora_invocation_tokens": None}
TOKENS_KEY = "trainable_token_indices"
TOKENS_TENSOR = "token_adapter.trainable_tokens_delta"     # after the embedding module's name


@dataclass
class Slot:
    """One HF module and the Linears of ours it holds: (our path, the HF output rows its weight comes from)."""

    module: str
    out_features: int
    conv1d: bool                                   # HF stores the weight (in, out): PEFT's fan_in_fan_out
    members: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    @property
    def single(self) -> bool:
        """One of ours, all of the HF rows in order: the adapter tensors pass unchanged."""
        if len(self.members) != 1:
            return False
        rows = self.members[0][1]
        return bool(torch.equal(rows, torch.arange(self.out_features, device=rows.device)))


def _row_map(rule: Rule, shapes: list[tuple[int, int]]) -> tuple[list[torch.Tensor], bool] | None:
    """For each of the rule's `ours` (out_i, in): the HF output row each of its rows comes from, and whether HF
    stores the matrix transposed; None when the rule is not a rearrangement of whole rows (no adapter maps).
    The probe is index arithmetic on the CPU whatever the default device is: under `torch.device("meta")` (the
    checks build the model there) a meta probe has no values to compare."""
    with torch.device("cpu"):
        return _probe_rows(rule, shapes)


def _probe_rows(rule: Rule, shapes: list[tuple[int, int]]) -> tuple[list[torch.Tensor], bool] | None:
    n_in, n_out = shapes[0][1], sum(s[0] for s in shapes)
    if any(s[1] != n_in for s in shapes):
        return None
    if rule.to_ours is _identity and len(shapes) == 1:       # a rename: the rows as they are, no probe
        return [torch.arange(n_out)], False
    index = (torch.arange(n_out, dtype=torch.float64)[:, None] * n_in
             + torch.arange(n_in, dtype=torch.float64)[None])          # (out, in): o * in + i, exact in float64
    for conv1d in (False, True):
        probe = index.t().contiguous() if conv1d else index
        try:
            ours = rule.to_ours([probe])
        except (ConfigError, RuntimeError, ValueError):
            continue
        if len(ours) != len(shapes) or any(tuple(t.shape) != s for t, s in zip(ours, shapes)):
            continue
        rows = [torch.div(t, n_in, rounding_mode="floor") for t in ours]
        cols_ok = all(torch.equal(t - r * n_in, torch.arange(n_in, dtype=torch.float64).expand_as(t))
                      for t, r in zip(ours, rows))
        if cols_ok and all(bool((r == r[:, :1]).all()) for r in rows):
            return [r[:, 0].long() for r in rows], conv1d
    return None


def hf_slots(model: nn.Module, fam: Family | None = None) -> dict[str, Slot]:
    """Our Linear path -> the Slot of the HF module holding it, for every Linear a family rule names alone
    (a rule from one HF `.weight` tensor whose rows it rearranges). `fam`: the config's family by default."""
    cfg: ModelConfig = model.config                                   # type: ignore[assignment]
    fam = fam or infer_family(cfg)
    linears = {f"{p}.weight": p for p in linear_paths(model)}
    shapes = {name: tuple(model.get_parameter(name).shape) for name in linears}
    slots: dict[str, Slot] = {}
    for rule in fam.weight_rules(cfg):
        if len(rule.hf) != 1 or not rule.hf[0].endswith(".weight") or not all(o in linears for o in rule.ours):
            continue
        mapped = _row_map(rule, [shapes[o] for o in rule.ours])      # type: ignore[misc]
        if mapped is None:
            continue
        rows, conv1d = mapped
        slot = Slot(rule.hf[0][: -len(".weight")], sum(int(shapes[o][0]) for o in rule.ours), conv1d)
        slot.members = [(linears[o], r) for o, r in zip(rule.ours, rows)]
        for path, _ in slot.members:
            slots[path] = slot
    return slots


def hf_module_names(model: nn.Module) -> Callable[[str], list[str]]:
    """For nn.lora.apply_lora: the HF module name of each Linear of ours, and of each other module whose tensors
    single-tensor rules name (none where no family expresses the model's config), so targets and modules_to_save
    may name the checkpoint family's modules (q_proj, c_attn, SelfAttention.q, wpe)."""
    try:
        fam = infer_family(model.config)                              # type: ignore[arg-type]
        slots = hf_slots(model, fam)
        whole = {path: sorted({hf.rpartition(".")[0] for hf, _ in tensors.values()})
                 for path, tensors in hf_tensors(model, fam).items()}
    except ConfigError:
        slots, whole = {}, {}
    return lambda path: [slots[path].module] if path in slots else whole.get(path, [])


def hf_tensors(model: nn.Module, fam: Family) -> dict[str, dict[str, tuple[str, Rule]]]:
    """Our module path -> {our parameter name: (the HF tensor, the rule)} for every module each of whose
    parameters one rule fills from one HF tensor alone: the modules PEFT's modules_to_save can carry.
    Example: hf_tensors(gpt2, FAMILIES.get("gpt2"))["abs_position.embedding"] -> {"weight": ("transformer.wpe.weight",
    rule)}"""
    cfg: ModelConfig = model.config                                   # type: ignore[assignment]
    single = {rule.ours[0]: rule for rule in fam.weight_rules(cfg) if len(rule.ours) == 1 and len(rule.hf) == 1}
    found: dict[str, dict[str, tuple[str, Rule]]] = {}
    for path, module in model.named_modules():
        names = [name for name, _ in module.named_parameters(recurse=False)]
        keys = [f"{path}.{name}" if path else name for name in names]
        if names and all(k in single for k in keys):
            found[path] = {name: (single[k].hf[0], single[k]) for name, k in zip(names, keys)}
    return found


def hf_embedding_name(model: nn.Module, fam: Family) -> str | None:
    """The HF module name of the model's input embedding (`model.embed_tokens`, `transformer.wte`, `shared`):
    the module PEFT's trainable_token_indices list adapts (transformers' get_input_embeddings)."""
    cfg: ModelConfig = model.config                                   # type: ignore[assignment]
    for rule in fam.weight_rules(cfg):
        if tuple(rule.ours) == (f"{EMBED_PATH}.weight",) and len(rule.hf) == 1 and rule.hf[0].endswith(".weight"):
            return rule.hf[0][: -len(".weight")]
    return None


# ---- saving ------------------------------------------------------------------------------------------
def _scale_alpha(scaling: float, rank: int, rslora: bool) -> float:
    """PEFT's lora_alpha giving `scaling` at `rank` (the inverse of nn.lora.lora_scaling)."""
    return scaling / lora_scaling(1.0, rank, rslora)


def _slot_tensors(slot: Slot, adapted: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A, B, scaling) of PEFT's adapter on `slot` from our adapters on its members (absent members: zero rows)."""
    present = [(path, rows, adapted[path]) for path, rows in slot.members if path in adapted]
    scalings = {m.scaling for _, _, m in present}
    if len(scalings) != 1:
        raise ConfigError(f"{slot.module}: its parts carry adapters of different scales; PEFT has one per module")
    scaling = scalings.pop()
    if slot.single:
        m = present[0][2]
        return m.lora_A.detach(), m.lora_B.detach(), scaling
    first = present[0][2].lora_A.detach()
    shared = len(present) == len(slot.members) and all(torch.equal(m.lora_A, first) for _, _, m in present)
    ranks = [0 if shared else m.r for _, _, m in present]
    a = first if shared else torch.cat([m.lora_A.detach() for _, _, m in present])       # (R, in)
    b = torch.zeros(slot.out_features, a.shape[0], dtype=a.dtype)                        # (out, R)
    col = 0
    for (_, rows, m), rank in zip(present, ranks):
        width = m.r if not shared else a.shape[0]
        b[rows, col:col + width] = m.lora_B.detach()
        col += rank
    return a, b, scaling


def save_peft(model: nn.Module, folder: str | Path, *, family: str | None = None, base_model: str | None = None,
              overwrite: bool = False, inputs: Iterable[str | Path] = ()) -> Path:
    """Write the model's LoRA adapters as PEFT does (`adapter_config.json`, `adapter_model.safetensors`), for the
    HF family of its config (inferred unless `family`); `base_model`: written as base_model_name_or_path. An
    existing non-empty folder is refused unless `overwrite` (replaced atomically), and so is a folder that is,
    holds or sits inside one of `inputs` (what the model was read from; runs.outputs.check_output)."""
    from safetensors.torch import save_file

    from archlab.runs.outputs import check_output, fresh_output

    adapted = lora_modules(model)
    tokens = token_module(model)
    saved = saved_modules(model)
    if not adapted and tokens is None and not saved:
        raise ConfigError("this model carries no LoRA adapters to save")
    inputs = list(inputs)
    check_output(folder, inputs=inputs, overwrite=overwrite)
    cfg: ModelConfig = model.config                                   # type: ignore[assignment]
    fam = FAMILIES.get(family) if family else infer_family(cfg)
    first = next(iter(adapted.values()), None)
    lora_cfg: LoRAConfig = getattr(model, "lora_config", None) or (
        LoRAConfig(r=first.r, alpha=first.scaling * first.r) if first is not None else LoRAConfig())
    slots = hf_slots(model, fam)
    missing = [p for p in adapted if p not in slots]
    if missing:
        raise ConfigError(f"{fam.model_type}: no HF module holds {', '.join(missing[:4])} alone; "
                          "PEFT cannot name its adapter")
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for slot in {id(slots[p]): slots[p] for p in adapted}.values():
        a, b, scaling = _slot_tensors(slot, adapted)
        tensors[f"{PREFIX}{slot.module}.lora_A.weight"] = a.contiguous().cpu()
        tensors[f"{PREFIX}{slot.module}.lora_B.weight"] = b.contiguous().cpu()
        rank = a.shape[0]
        if rank != lora_cfg.r or not math.isclose(scaling, lora_cfg.scaling, rel_tol=1e-12):
            ranks[slot.module] = rank
            alphas[slot.module] = _scale_alpha(scaling, rank, lora_cfg.use_rslora)
    modules = sorted({slots[p].module for p in adapted})
    token_ids = None
    if tokens is not None:
        embedding = hf_embedding_name(model, fam)
        if embedding is None:
            raise ConfigError(f"{fam.model_type}: no HF module holds the input embedding alone; PEFT cannot name "
                              f"its {TOKENS_KEY}")
        token_ids = tokens.token_indices.tolist()
        tensors[f"{PREFIX}{embedding}.{TOKENS_TENSOR}"] = tokens.rows().contiguous().cpu()
    whole = _saved_tensors(model, fam, saved)
    tensors.update({PREFIX + name: t for name, t in whole.items()})
    config = {
        "peft_type": "LORA", "task_type": TASK_TYPES.get(cfg.arch), "base_model_name_or_path": base_model,
        "r": lora_cfg.r, "lora_alpha": lora_cfg.alpha, "lora_dropout": lora_cfg.dropout,
        "use_rslora": lora_cfg.use_rslora, "target_modules": modules,
        "fan_in_fan_out": any(slots[p].conv1d for p in adapted), "bias": "none", "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": sorted({name.rpartition(".")[0] for name in whole}) or None,
        "rank_pattern": ranks, "alpha_pattern": alphas, "use_dora": False, TOKENS_KEY: token_ids,
    }
    with fresh_output(Path(folder), overwrite=overwrite, inputs=inputs) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        make_readable(tmp / WEIGHTS_FILE)
    return Path(folder)


def _saved_tensors(model: nn.Module, fam: Family, saved: list[str]) -> dict[str, torch.Tensor]:
    """HF tensor name -> value for the modules trained whole, converted by their family rules."""
    cfg: ModelConfig = model.config                                   # type: ignore[assignment]
    named = hf_tensors(model, fam)
    out: dict[str, torch.Tensor] = {}
    for path in saved:
        if path not in named:
            raise ConfigError(f"{fam.model_type}: no HF module holds {path} alone; PEFT cannot name it in "
                              "modules_to_save")
        if path == EMBED_PATH and cfg.tie_embeddings:
            raise ConfigError(f"modules_to_save {path}: the head is tied to it, and PEFT would train a copy of the "
                              "embedding with the head left on the original (use trainable tokens)")
        module = model.get_submodule(path)
        for name, (hf, rule) in named[path].items():
            out[hf] = rule.to_hf([getattr(module, name).detach()])[0].contiguous().cpu()
    return out


# ---- loading -----------------------------------------------------------------------------------------
def read_adapter_config(folder: str | Path) -> dict:
    """adapter_config.json as data, checked: a LoRA adapter whose switches archlab computes alike."""
    path = Path(folder) / CONFIG_FILE
    data = read_json_object(folder, CONFIG_FILE, "PEFT adapter folder")
    if data.get("peft_type") != "LORA":
        raise ConfigError(f"{path}: peft_type {data.get('peft_type')!r} is not LORA (archlab loads LoRA adapters)")
    for key, default in REFUSED.items():
        value = data.get(key, default)
        if value not in (default, None, False, [], {}):
            raise ConfigError(f"{path}: {key}={value!r} is not supported by archlab (needs {default!r})")
    for key in ("r", "lora_alpha"):
        if not _positive(data.get(key)):
            raise ConfigError(f"{path}: {key}={data.get(key)!r} must be a positive number")
    for key in ("rank_pattern", "alpha_pattern"):
        value = data.get(key) or {}
        if not isinstance(value, dict) or not all(isinstance(k, str) and _positive(v) for k, v in value.items()):
            raise ConfigError(f"{path}: {key}={value!r} must map module names to positive numbers")
    _token_indices(data, path)
    return data


def _token_indices(config: dict, path: Path) -> tuple[str | None, list[int]]:
    """(the embedding module a dict form names, or None; the ids) of adapter_config.json's trainable_token_indices:
    a list of distinct ids (the input embedding), or one {module: ids}; other forms are a ConfigError."""
    value = config.get(TOKENS_KEY)
    if value in (None, [], {}):
        return None, []
    module, ids = (next(iter(value.items())) if isinstance(value, dict) and len(value) == 1 else (None, value))
    if (not isinstance(ids, list) or not ids or len(set(ids)) != len(ids)
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
        raise ConfigError(f"{path}: {TOKENS_KEY}={value!r} is not supported by archlab (a list of distinct token ids, "
                          "or one {embedding module: ids})")
    return module, ids


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _pattern(config: dict, key: str, module: str) -> tuple[str, float]:
    """PEFT's rank_pattern / alpha_pattern lookup (get_pattern_key): (where the value comes from, the value) of
    the first pattern key matching the module name's end, else the config's r / lora_alpha."""
    for name, value in (config.get(f"{key}_pattern") or {}).items():
        if re.match(rf"(.*\.)?({name})$", module):
            return f"{key}_pattern[{name!r}]", value
    default = "r" if key == "rank" else "lora_alpha"
    return default, config[default]


def _named(value, module: str) -> bool:
    """PEFT's module selection by one config field: a string is a regex matched in full against the module's name
    ("all-linear" every Linear), a list names modules by name or by the name's end."""
    if isinstance(value, str):
        return value.lower() == ALL_LINEAR or re.fullmatch(value, module) is not None
    return any(module == name or module.endswith("." + name) for name in value or ())


def peft_targeted(config: dict, module: str) -> bool:
    """Whether PEFT puts an adapter on the HF Linear `module` by adapter_config.json (PEFT's
    check_target_module_exists: exclude_modules, then modules_to_save, then target_modules). PEFT drops adapter
    tensors of a module it does not target, so such an adapter is refused, not loaded otherwise than PEFT would.
    Example: peft_targeted({"target_modules": ["q_proj"]}, "model.layers.0.self_attn.q_proj") -> True"""
    if config.get("exclude_modules") and _named(config["exclude_modules"], module):
        return False
    if any(re.match(rf"(^|.*\.){m}($|\..*)", module) for m in config.get("modules_to_save") or ()):
        return False
    return _named(config.get("target_modules") or [], module)


def _check_targets(config: dict, slots: dict[str, Slot], adapted: list[str], path: Path) -> None:
    """The adapter's tensors are those of the modules its target_modules name: a tensor PEFT would drop, or a
    named module without tensors (a config written for other tensors), is a ConfigError naming it."""
    targets = config.get("target_modules") or []
    if not isinstance(targets, (str, list)) or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"{path}: target_modules={targets!r} must be a regex string or a list of module names")
    try:
        dropped = [m for m in adapted if not peft_targeted(config, m)]
        named = [m for m in slots if m not in adapted and peft_targeted(config, m)]
    except re.error as exc:
        raise ConfigError(f"{path}: target_modules or exclude_modules is not a valid regular expression: {exc}"
                          ) from None
    if dropped:
        raise ConfigError(f"{path}: target_modules={targets!r} does not name {dropped[0]}, whose lora_A/lora_B "
                          f"{WEIGHTS_FILE} holds (PEFT would drop them): the config and the tensors disagree")
    if named and config.get("layers_to_transform") in (None, [], ()):
        raise ConfigError(f"{path}: target_modules={targets!r} names {named[0]}, which has no lora_A/lora_B in "
                          f"{WEIGHTS_FILE}: the config and the tensors disagree")


def _check_finite(stored: dict[str, torch.Tensor], path: Path) -> None:
    """NaN or inf in an adapter tensor is refused naming it: it would turn the adapted layer's output to NaN (or
    silently to zeros past an attention kernel's masking)."""
    for name, tensor in stored.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise WeightsError(f"{path}: tensor {name} {tuple(tensor.shape)} holds {bad} NaN or inf value(s)")


def _adapter_tensors(folder: Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(HF module -> {"A": (r, in), "B": (out, r)} from adapter_model.safetensors (read as data), an embedding's
    trainable token rows as {"rows": (n, d)}; every other tensor by its HF name: modules_to_save's)."""
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise WeightsError(f"{folder}: no {WEIGHTS_FILE}")
    try:
        stored = load_file(str(path))
    except Exception as exc:   # safetensors raises its own types for truncated files
        raise WeightsError(f"corrupt or unreadable adapter file {path}: {exc}") from exc
    _check_finite(stored, path)
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    whole: dict[str, torch.Tensor] = {}
    pattern = re.compile(rf"{re.escape(PREFIX)}(.+)\.lora_([AB])(?:\.default)?\.weight")
    rows = re.compile(rf"{re.escape(PREFIX)}(.+)\.{re.escape(TOKENS_TENSOR)}(?:\.default)?")
    for name, tensor in stored.items():
        match = pattern.fullmatch(name)
        if match is not None:
            by_module.setdefault(match[1], {})[match[2]] = tensor
        elif (match := rows.fullmatch(name)) is not None:
            by_module.setdefault(match[1], {})["rows"] = tensor
        elif name.startswith(PREFIX):
            whole[name[len(PREFIX):]] = tensor
        else:
            raise WeightsError(f"{path}: tensor {name} is not a LoRA A or B matrix, token rows or a saved module's "
                               "tensor archlab can load")
    for module, pair in by_module.items():
        if set(pair) != {"A", "B"} and set(pair) != {"rows"}:
            raise WeightsError(f"{path}: {module} has lora_{'A' if 'A' not in pair else 'B'} missing")
    return by_module, whole


def _saved_plan(model: nn.Module, fam: Family, config: dict, whole: dict[str, torch.Tensor], folder: Path
                ) -> dict[str, dict[str, torch.Tensor]]:
    """Our module path -> {parameter name: value} for the adapter's modules_to_save tensors, converted by the
    family rules and checked: a tensor outside the config's modules_to_save, one no module of ours holds alone, a
    shape that differs or a listed module without tensors is an error naming it."""
    listed = config.get("modules_to_save") or []
    if not isinstance(listed, list) or not all(isinstance(m, str) for m in listed):
        raise ConfigError(f"{folder / CONFIG_FILE}: modules_to_save={listed!r} must be a list of module names")
    by_hf = {hf: (path, name, rule) for path, params in hf_tensors(model, fam).items()
             for name, (hf, rule) in params.items()}
    plan: dict[str, dict[str, torch.Tensor]] = {}
    for hf, tensor in whole.items():
        module = hf.rpartition(".")[0]
        if not any(module.endswith(m) for m in listed):                     # PEFT's rule: the name's end
            raise WeightsError(f"{folder / WEIGHTS_FILE}: tensor {PREFIX}{hf} is not a LoRA A or B matrix, token "
                               f"rows or a tensor of {CONFIG_FILE}'s modules_to_save")
        if hf not in by_hf:
            raise WeightsError(f"adapter for another base: {hf} (modules_to_save) is no tensor archlab's "
                               f"{fam.model_type} model holds alone")
        path, name, rule = by_hf[hf]
        if path == EMBED_PATH and model.config.tie_embeddings:          # type: ignore[union-attr]
            raise ConfigError(f"{folder / CONFIG_FILE}: modules_to_save {module}: this model's head is tied to its "
                              "input embedding, and PEFT trains a copy that the head does not read: archlab cannot "
                              "compute it alike")
        value = rule.to_ours([tensor])[0]
        own = model.get_submodule(path).get_parameter(name)
        if tuple(value.shape) != tuple(own.shape):
            raise WeightsError(f"adapter for another base: {hf} {tuple(tensor.shape)} does not fit this model's "
                               f"({tuple(own.shape)})")
        plan.setdefault(path, {})[name] = value
    missing = [m for m in listed if not any(h.rpartition(".")[0].endswith(m) for h in whole)]
    if missing:
        raise WeightsError(f"{folder / WEIGHTS_FILE}: no tensors for modules_to_save {', '.join(missing)}")
    return plan


def load_peft(model: nn.Module, folder: str | Path, *, family: str | None = None) -> nn.Module:
    """Wrap `model` (built from the adapter's base, e.g. by load_hf) with the PEFT adapter in `folder`, in place:
    its output equals PeftModel.from_pretrained(base, folder)'s. An adapter for another base (a module this
    model lacks, a shape that differs) is a WeightsError naming it."""
    folder = Path(folder)
    config = read_adapter_config(folder)
    tensors, whole = _adapter_tensors(folder)
    cfg: ModelConfig = model.config                                   # type: ignore[assignment]
    fam = FAMILIES.get(family) if family else infer_family(cfg)
    saved = _saved_plan(model, fam, config, whole, folder)
    by_module: dict[str, Slot] = {slot.module: slot for slot in hf_slots(model, fam).values()}
    rslora = bool(config.get("use_rslora", False))
    dropout = float(config.get("lora_dropout") or 0.0)
    token_rows = _token_rows(model, fam, config, tensors, folder)
    plan = []
    for module, pair in tensors.items():
        if "rows" in pair:
            continue
        slot = by_module.get(module)
        if slot is None:
            raise WeightsError(f"adapter for another base: {module} is not a Linear of this {fam.model_type} model")
        a, b = pair["A"], pair["B"]
        n_in = model.get_submodule(slot.members[0][0]).in_features
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape != (slot.out_features, a.shape[0]):
            raise WeightsError(f"adapter for another base: {module} lora_A {tuple(a.shape)}, lora_B "
                               f"{tuple(b.shape)} do not fit its weight ({slot.out_features}, {n_in})")
        source, rank = _pattern(config, "rank", module)
        alpha = _pattern(config, "alpha", module)[1]
        if a.shape[0] != rank:
            raise ConfigError(f"{folder / CONFIG_FILE}: {source}={rank!r} but {PREFIX}{module}.lora_A.weight is "
                              f"{tuple(a.shape)} and lora_B {tuple(b.shape)} (rank {a.shape[0]}): PEFT refuses "
                              "an adapter whose rank disagrees with its tensors")
        rank, alpha = int(rank), float(alpha)
        plan.append((slot, a, b, lora_scaling(alpha, rank, rslora)))
    _check_targets(config, by_module, [slot.module for slot, *_ in plan], folder / CONFIG_FILE)
    model.requires_grad_(False)
    for slot, a, b, scaling in plan:
        for path, rows in slot.members:
            adapted = wrap(model, path, a.shape[0], scaling, dropout)
            with torch.no_grad():
                adapted.lora_A.copy_(a)
                adapted.lora_B.copy_(b[rows])
    if token_rows is not None:
        ids, values = token_rows
        adapted_rows = wrap_embedding(model, ids)       # its rows sorted by id
        order = sorted(range(len(ids)), key=ids.__getitem__)
        with torch.no_grad():   # PEFT holds the rows' values; ours is the difference from the base rows
            base = adapted_rows.weight[adapted_rows.token_indices]
            adapted_rows.trainable_tokens_delta.copy_(values[order].to(base) - base)
    for module_path, params in saved.items():       # modules_to_save: PEFT's copies replace the base's tensors
        owner = model.get_submodule(module_path)
        with torch.no_grad():
            for name, value in params.items():
                owner.get_parameter(name).copy_(value)
        owner.requires_grad_(True)
    targets = sorted({slot.module.rsplit(".", 1)[-1] for slot, *_ in plan})
    model.lora_config = LoRAConfig(r=int(config["r"]), alpha=float(config["lora_alpha"]), dropout=dropout,
                                   targets=tuple(targets) or ("all-linear",), use_rslora=rslora,
                                   trainable_tokens=tuple(token_rows[0]) if token_rows else (),
                                   modules_to_save=tuple(saved))   # type: ignore[assignment]
    return model


def _token_rows(model: nn.Module, fam: Family, config: dict, tensors: dict, folder: Path
                ) -> tuple[list[int], torch.Tensor] | None:
    """(ids, their rows' values (n, d)) of the adapter's trainable tokens, checked against the model; None
    without. Rows stored for another module, or missing, or of another shape, are a WeightsError naming them."""
    module, ids = _token_indices(config, folder / CONFIG_FILE)
    stored = {name: pair["rows"] for name, pair in tensors.items() if "rows" in pair}
    if not ids and not stored:
        return None
    embedding = hf_embedding_name(model, fam)
    if embedding is None or (module is not None and embedding != module and not embedding.endswith("." + module)):
        raise ConfigError(f"{folder / CONFIG_FILE}: {TOKENS_KEY} for {module or 'the input embedding'}: archlab "
                          f"trains token rows of this {fam.model_type} model's input embedding ({embedding}) only")
    values = stored.pop(embedding, None)
    if stored or values is None or not ids:
        odd = next(iter(stored), embedding)
        raise WeightsError(f"{folder / WEIGHTS_FILE}: trainable token rows of {odd} do not match {TOKENS_KEY} of "
                           f"{CONFIG_FILE}")
    n_rows, d = model.get_submodule(EMBED_PATH).get_parameter("weight").shape
    if tuple(values.shape) != (len(ids), d) or max(ids) >= n_rows:
        raise WeightsError(f"adapter for another base: {embedding} trainable token rows {tuple(values.shape)} for ids "
                           f"up to {max(ids)} do not fit its embedding ({n_rows}, {d})")
    return ids, values
