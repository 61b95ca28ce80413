"""Any model folder a user points at: an archlab run folder (config.yaml + checkpoints/ + tokenizer/, or the
model.safetensors an older `convert` wrote) or a Hugging Face folder (config.json + safetensors +
tokenizer.json). One loader serves generate, diagnose and serve; `load_masked_lm` opens an encoder for fill-mask.
For generation, a folder's generation_config.json is read as data and attached as `model.generation_config`
(archlab.generation.GenerationConfig), which `archlab generate` applies.
"""
from __future__ import annotations

from pathlib import Path

from archlab.errors import UserError

__all__ = ["check_vocabulary", "folder_arch", "load_masked_lm", "load_model_and_tokenizer"]


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
        from archlab.runs.checkpoint import latest_checkpoint, load_run, load_run_tokenizer
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
    read as data (safetensors)."""
    from safetensors.torch import load_file

    from archlab.config import ModelConfig
    from archlab.runs.checkpoint import MODEL_FILE, confined, model_with_weights, read_run_config

    weights = confined(path, MODEL_FILE, "config.yaml")   # no meta.json, so no sha256: at least not a foreign link
    return model_with_weights(ModelConfig.from_dict(read_run_config(path)["model"]), load_file(weights), weights)


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
        from archlab.runs.checkpoint import read_run_config
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
