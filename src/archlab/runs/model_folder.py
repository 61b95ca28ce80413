"""Any model folder a user points at: an archlab run folder (config.yaml + checkpoints/ + tokenizer/, or the
model.safetensors an older `convert` wrote) or a Hugging Face folder (config.json + safetensors +
tokenizer.json). One loader, `load_model_and_tokenizer`, serves generate, diagnose, serve and chat; `load_run` is
its run-folder branch (the newest checkpoint, verified), `load_masked_lm` opens an encoder for fill-mask; a run
folder's config.yaml is written and read here (`write_run_config`, `read_run_config`).
For generation, a folder's generation_config.json is read as data and attached as `model.generation_config`
(archlab.generation.GenerationConfig), which `archlab generate` applies.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import yaml

from archlab.config import ConfigError, ModelConfig
from archlab.errors import UserError
from archlab.runs.checkpoint import CHECKPOINT_DIR, MODEL_FILE, CheckpointError, latest_checkpoint, verified_weights

__all__ = ["quantization_of", "refuse_quantized", "QUANTIZATION",
           "check_vocabulary", "folder_arch", "load_masked_lm", "load_model_and_tokenizer", "load_run",
           "load_run_tokenizer", "model_with_weights", "read_run_config", "write_run_config", "export_peft",
           "CONFIG_FILE"]

CONFIG_FILE = "config.yaml"


def load_model_and_tokenizer(path: str | Path, device: str = "cpu", *, need_tokenizer: bool = True,
                             archs: tuple[str, ...] = ("decoder",), purpose: str = "generation",
                             generation_config: bool = False):
    """(model in eval mode, tokenizer or None) from a run folder, an HF folder, or an `hf:ORG/NAME[@REVISION]` id
    (archlab.runs.hub: safetensors, configs and tokenizer files only). `archs`: the kinds of model (ModelConfig.arch)
    the caller can use; another kind is a UserError naming `purpose`. generation_config=True: the folder's
    generation_config.json, if any, becomes `model.generation_config` (for archlab.generate(..., generation_config=)).
    Example: model, tok = load_model_and_tokenizer("runs/demo")"""
    from archlab.runs.hub import resolve_model

    path = resolve_model(path)
    model, tok = _load_model_and_tokenizer(path, device, need_tokenizer, archs, purpose)
    if generation_config:
        from archlab.generation.config import read_generation_config
        settings = read_generation_config(path)
        if settings is not None:
            model.generation_config = settings
    return model, tok


def _load_model_and_tokenizer(path: Path, device: str, need_tokenizer: bool, archs: tuple[str, ...], purpose: str):
    if (path / "config.yaml").is_file():
        if latest_checkpoint(path) is not None:
            model, tok = load_run(path, device=device)
        elif (path / "model.safetensors").is_file():   # `archlab convert` output of earlier versions
            model, tok = _load_flat_run(path).to(device), load_run_tokenizer(path)
        else:
            raise UserError(f"{path} has config.yaml but no checkpoints/ or model.safetensors")
        _check_arch(path, model.config, archs, purpose)
        if tok is None and need_tokenizer:
            raise UserError(f"{path} has no tokenizer/ folder to encode the prompt")
        return model.eval(), tok
    if (path / "config.json").is_file():
        from archlab.interop import load_hf
        from archlab.tokenizer import load as load_tokenizer
        model = load_hf(path).to(device).eval()
        _check_arch(path, model.config, archs, purpose)
        if not (path / "tokenizer.json").is_file():
            if need_tokenizer:
                raise UserError(f"{path} has no tokenizer.json")
            return model, None
        try:  # native reader, else the `tokenizers` library (HFTokenizer)
            return model, load_tokenizer(path)
        except ValueError:
            if need_tokenizer:
                raise
            return model, None                     # weights-only uses (diagnostics) still work
    raise UserError(f"{path} is neither a run folder (config.yaml) nor an HF folder (config.json)")


def _load_flat_run(path: Path):
    """config.yaml + one model.safetensors beside it (no checkpoints/): the model the config names, its weights
    read as data (safetensors) and refused when not finite, as a checkpoint's are (checkpoint.load_weights)."""
    from archlab.runs.checkpoint import confined, load_weights

    weights = confined(path, MODEL_FILE, "config.yaml")   # no meta.json, so no sha256: at least not a foreign link
    return model_with_weights(ModelConfig.from_dict(read_run_config(path)["model"]), load_weights(weights), weights)


_KINDS = {"decoder": "a decoder-only LM", "encoder": "an encoder (a masked LM)",
          "encoder_decoder": "an encoder-decoder"}


def _check_arch(path: Path, cfg, archs: tuple[str, ...], purpose: str) -> None:
    if cfg.arch not in archs:
        wanted = " or ".join(_KINDS.get(a, a) for a in archs)
        raise UserError(f"{path} holds {_KINDS.get(cfg.arch, cfg.arch)} ({cfg.name}): {purpose} needs {wanted}")


def load_masked_lm(path: str | Path, device: str = "cpu"):
    """(EncoderLM in eval mode, tokenizer) from a run folder or an HF folder (bert, roberta) or an hf: id. The
    model's kind is read from its config before any weights load: a decoder is one line. A tokenizer.json with a
    post-processor loads through the `tokenizers` library (archlab.tokenizer.HFTokenizer), so fill-mask encodes
    with the special tokens the model was trained with ([CLS] ... [SEP], <s> ... </s>).
    Example: model, tok = load_masked_lm("runs/demo-encoder")"""
    from archlab.eval.fill_mask import require_encoder
    from archlab.runs.hub import resolve_model

    path = resolve_model(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    arch = folder_arch(path)
    if arch is not None:
        require_encoder(str(path), arch)
    if (path / "config.yaml").is_file():
        model, tok = load_model_and_tokenizer(path, device, archs=("encoder",), purpose="fill-mask")
        return model, _with_post_processor(tok, path / "tokenizer")
    if (path / "config.json").is_file():
        from archlab.interop import load_hf
        if not (path / "tokenizer.json").is_file():
            raise UserError(f"{path} has no tokenizer.json")
        from archlab.tokenizer import load as load_tokenizer
        model = load_hf(path).to(device).eval()
        return model, _with_post_processor(load_tokenizer(path), path)
    raise UserError(f"{path} is neither a run folder (config.yaml) nor an HF folder (config.json)")


def check_vocabulary(model, tokenizer) -> None:
    """A tokenizer with ids the model cannot embed would fail every prompt that holds one: refused before use."""
    size, vocab = getattr(tokenizer, "vocab_size", None), model.config.vocab_size
    if size is not None and size > vocab:
        raise UserError(f"the tokenizer has {size} tokens but the model's vocabulary has {vocab}: ids {vocab}.."
                        f"{size - 1} cannot be embedded (a tokenizer from another model?)")


def folder_arch(path: Path) -> str | None:
    """The kind of model a folder holds (ModelConfig.arch), read from config.yaml or config.json before any
    weights load; None when neither names one (the loaders then say what is wrong)."""
    if (path / "config.yaml").is_file():
        model_cfg = read_run_config(path).get("model")
        return str(model_cfg.get("arch", "decoder")) if isinstance(model_cfg, dict) else None
    if (path / "config.json").is_file():
        from archlab.interop.hf import family_for, read_hf_config
        return family_for(read_hf_config(path)).arch
    return None


def _with_post_processor(tok, folder: Path):
    """`tok`, or the same tokenizer.json through the `tokenizers` library when it has a post-processor that
    archlab's native readers skip (RoBERTa's byte-level BPE with <s> ... </s>)."""
    from archlab.tokenizer import HFTokenizer
    from archlab.tokenizer.loading import read_tokenizer_json

    if tok is None or isinstance(tok, HFTokenizer) or not (folder / "tokenizer.json").is_file():
        return tok
    if not read_tokenizer_json(folder).get("post_processor"):
        return tok
    try:
        return HFTokenizer.from_file(folder)
    except ImportError:
        raise UserError(f"{folder / 'tokenizer.json'} has a post-processor (special tokens around the text) that "
                        "only the `tokenizers` package applies: pip install 'archlab[hf]'") from None


# --------------------------------------------------------------------------- run folders
def write_run_config(run_dir: str | os.PathLike, model: dict, train: dict, data: dict,
                     init_from: dict | None = None) -> Path:
    """config.yaml: `model`, `train`, `data`, and `init_from` (the weights a run started from) when given."""
    path = Path(run_dir) / CONFIG_FILE
    sections = {"model": model, "train": train, "data": data}
    if init_from is not None:
        sections["init_from"] = init_from
    text = yaml.safe_dump(sections, sort_keys=False)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def read_run_config(run_dir: str | os.PathLike) -> dict:
    """The raw config.yaml mapping of a run folder (keys model, train, data)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{run_dir} is not a run folder: no {CONFIG_FILE}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise CheckpointError(f"corrupt run config {path}: {exc}") from exc
    if not isinstance(data, dict) or "model" not in data:
        raise CheckpointError(f"{path} has no `model` section")
    return data


def load_run(run_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
             device: str | torch.device = "cpu", *, merge_adapters: bool = True):
    """(model in eval mode with the latest (or given) checkpoint's weights, tokenizer or None): a TransformerLM,
    or the class the config's `arch` names (archlab.models.build_model). The weights file is verified first
    (`verified_weights`: sha256 against meta.json, no link out of the run folder). A LoRA run's adapters
    (train.lora) are folded into the weights, or with merge_adapters=False kept as adapters (nn.lora.LoRALinear)."""
    run_dir = Path(run_dir)
    run_cfg = read_run_config(run_dir)
    cfg = ModelConfig.from_dict(run_cfg["model"])
    ckpt = Path(checkpoint) if checkpoint is not None else latest_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{run_dir} has no checkpoint under {run_dir / CHECKPOINT_DIR}")
    state = verified_weights(ckpt, run_dir if checkpoint is None else None)
    model = model_with_weights(cfg, state, ckpt / MODEL_FILE, train=run_cfg.get("train"),
                               quantization=quantization_of(run_dir, run_cfg))
    if merge_adapters:
        from archlab.nn.lora import merge_lora
        merge_lora(model)
    model.to(device).eval()
    return model, load_run_tokenizer(run_dir)


def _adapters_for(model, state: dict, train: dict | None) -> None:
    """Wrap the Linears whose adapters `state` holds (`<path>.lora_A` / `.lora_B`, a LoRA run's checkpoint), at
    the rank their A has and the scale the run's train section (train.lora: alpha, use_rslora) gives; the embedding
    on the rows a run trained with train.lora.trainable_tokens (its checkpoint names them)."""
    from archlab.nn.lora import lora_scaling, wrap
    from archlab.nn.trainable_tokens import wrap_from_state
    from archlab.runs.train_section import lora_section

    wrap_from_state(model, state)
    paths = [name[: -len(".lora_A")] for name in state if name.endswith(".lora_A")]
    if not paths:
        return
    settings = lora_section(train if isinstance(train, dict) else None)
    alpha, rslora = (settings.alpha, settings.use_rslora) if settings is not None else (16.0, False)
    for path in paths:
        rank = int(state[f"{path}.lora_A"].shape[0])
        try:
            wrap(model, path, rank, lora_scaling(alpha, rank, rslora))
        except (AttributeError, ConfigError) as exc:
            raise CheckpointError(f"adapter {path}.lora_A names no Linear of the model in config.yaml") from exc


def model_with_weights(cfg: ModelConfig, state: dict, source: Path, train: dict | None = None,
                       quantization: dict | None = None):
    """The model `cfg.arch` names (archlab.models.build_model) holding `state`, every parameter exactly once; a
    mismatch is a CheckpointError naming `source`, the file the weights came from. LoRA adapters in `state` are
    put on their Linears (scaled by the run's `train` section); `quantization` (a run's section, `archlab
    quantize`) gives the model int8 layers (nn/int8.quantize_int8) before `state` loads into them.
    Example: model = model_with_weights(cfg, load_file(path), path)"""
    from archlab.models import build_model
    from archlab.models.accounting import check_weights_fit
    from archlab.models.legacy_keys import upgrade_keys
    from archlab.nn.heads import SCALAR_HEADS, attach_score_head

    check_weights_fit(cfg, what=f"the model in {CONFIG_FILE} (for {source})")
    model = build_model(cfg)
    state = upgrade_keys(state, cfg.arch)              # a run folder of an earlier module layout
    _adapters_for(model, state, train)
    for head in SCALAR_HEADS:       # a reward run's scalar head (methods/reward), a PPO policy's value head
        if any(name.startswith(head + ".") for name in state):
            attach_score_head(model, head)
    if quantization is not None:
        from archlab.nn.int8 import quantize_int8
        quantize_int8(model, layout_only=True)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(f"{source} does not match the model in config.yaml: {exc}") from exc
    return model


QUANTIZATION = "quantization"           # config.yaml's section of a quantized run (archlab quantize)
_SCHEMES = ("int8",)                    # what `quantization.weights` may name


def quantization_of(run_dir: str | os.PathLike, run_cfg: dict | None = None) -> dict | None:
    """A run folder's `quantization` section ({weights: int8, ...}), None for a float run; a section naming an
    unknown scheme is a CheckpointError.
    Example: if quantization_of("runs/smol-int8"): ..."""
    section = (read_run_config(run_dir) if run_cfg is None else run_cfg).get(QUANTIZATION)
    if section is None:
        return None
    if not isinstance(section, dict) or section.get("weights") not in _SCHEMES:
        raise CheckpointError(f"{Path(run_dir) / CONFIG_FILE}: `{QUANTIZATION}` must name weights: "
                              f"{' or '.join(_SCHEMES)}, got {section!r}")
    return section


def refuse_quantized(folder: str | os.PathLike, purpose: str) -> None:
    """A UserError when `folder` is a quantized run (its int8 weights cannot train or export as floats).
    Example: refuse_quantized(base, "finetune")"""
    folder = Path(folder)
    if (folder / CONFIG_FILE).is_file() and quantization_of(folder) is not None:
        raise UserError(f"{folder} holds int8 weights (archlab quantize): {purpose} needs a float run; "
                        f"use the run it was quantized from")


def refuse_score_head(model: torch.nn.Module, run_dir: Path, target: str) -> None:
    """A reward run's score head (nn/heads.SCORE_HEAD) is what the run learnt: an export without it would keep the
    backbone and silently lose the reward, so it is refused (--to-hf, --to-gguf and --to-peft alike) before anything
    is written. A PPO policy's value head is training state and is dropped (interop/convert.drop_value_head).
    Example: refuse_score_head(model, Path("runs/rm"), "GGUF") raises UserError for a reward run"""
    from archlab.nn.heads import SCORE_HEAD

    if hasattr(model, SCORE_HEAD):
        raise UserError(f"{run_dir} is a reward model (its score head, {SCORE_HEAD}.weight, is what it learnt): "
                        f"{target} has no place for a reward head; score with `archlab score {run_dir} ...`")


def load_run_tokenizer(run_dir: str | os.PathLike):
    tok_dir = Path(run_dir) / "tokenizer"
    if not tok_dir.is_dir():
        return None
    from archlab.data.tokenizer_adapter import load_tokenizer

    return load_tokenizer(tok_dir)


def export_peft(run_dir: str | Path, out: str | Path, *, family: str | None = None, overwrite: bool = False) -> Path:
    """A LoRA run folder's adapters (latest checkpoint) in PEFT's format, for the HF export of the run's base
    (the model the run started from). A run without adapters, or a reward run (its score head is no causal LM's), is a
    UserError."""
    from archlab.interop.peft import hf_module_names, save_peft
    from archlab.nn.lora import LoRAConfig, lora_modules, select_modules
    from archlab.runs.outputs import check_output
    from archlab.runs.train_section import lora_section

    refuse_quantized(run_dir, "convert --to-peft")
    if family is None:
        _peft_family(run_dir)                       # a run no family expresses: said first, in one short line
    check_output(out, inputs=[run_dir], overwrite=overwrite)        # before loading anything
    model, _ = load_run(run_dir, merge_adapters=False)
    refuse_score_head(model, Path(run_dir), "--to-peft's causal-LM adapter")   # it would drop the learnt reward
    if not lora_modules(model):
        raise UserError(f"{run_dir} holds no LoRA adapters (train.lora was not set): export it with --to-hf")
    settings = lora_section(read_run_config(run_dir).get("train"))      # the run's LoRA config, typed
    if settings is None:
        first = next(iter(lora_modules(model).values()))
        settings = LoRAConfig(r=first.r, alpha=first.scaling * first.r, targets=("all-linear",))
    model.lora_config = dataclasses.replace(                          # type: ignore[assignment]
        settings, modules_to_save=tuple(select_modules(model, settings.modules_to_save, hf_module_names(model))))
    return save_peft(model, out, family=family, overwrite=overwrite, inputs=[run_dir])


def _peft_family(run_dir: str | Path) -> None:
    """A UserError unless an HF family expresses the run's model (PEFT names adapters after its modules), naming
    the closest family and what differs, from config.yaml alone."""
    from archlab.interop.families import infer_family

    try:
        infer_family(ModelConfig.from_dict(read_run_config(run_dir)["model"]))
    except ConfigError as exc:
        lines = str(exc).splitlines()
        closest = f" (closest: {lines[1].strip()})" if len(lines) > 1 else ""
        raise UserError(f"convert --to-peft {run_dir}: no Hugging Face family expresses this run's model{closest}, "
                        "so PEFT has no module names for its adapters; --family MODEL_TYPE names one to try") from None

