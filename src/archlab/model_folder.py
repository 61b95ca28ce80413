"""Any model folder a user points at: an archlab run folder (config.yaml + checkpoints/ + tokenizer/, or the
model.safetensors an older `convert` wrote) or a Hugging Face folder (config.json + safetensors +
tokenizer.json). One loader serves generate, diagnose and serve.
"""
from __future__ import annotations

from pathlib import Path

from archlab.errors import UserError

__all__ = ["load_model_and_tokenizer"]


def load_model_and_tokenizer(path: str | Path, device: str = "cpu", *, need_tokenizer: bool = True):
    """(TransformerLM in eval mode, tokenizer or None) from a run folder, an HF folder, or an
    `hf:ORG/NAME[@REVISION]` id (archlab.hub: safetensors, configs and tokenizer files only).
    Example: model, tok = load_model_and_tokenizer("runs/demo")"""
    from archlab.hub import resolve_model

    path = resolve_model(path)
    if (path / "config.yaml").is_file():
        from archlab.checkpoint import latest_checkpoint, load_run, load_run_tokenizer
        if latest_checkpoint(path) is not None:
            model, tok = load_run(path, device=device)
        elif (path / "model.safetensors").is_file():   # `archlab convert` output of earlier versions
            from archlab.interop.run import load_run_model
            model, tok = load_run_model(path).to(device), load_run_tokenizer(path)
        else:
            raise UserError(f"{path} has config.yaml but no checkpoints/ or model.safetensors")
        if tok is None and need_tokenizer:
            raise UserError(f"{path} has no tokenizer/ folder to encode the prompt")
        return model.eval(), tok
    if (path / "config.json").is_file():
        from archlab.interop import load_hf
        from archlab.tokenizer import load as load_tokenizer
        model = load_hf(path).to(device).eval()
        if model.config.arch != "decoder":   # BERT, RoBERTa: masked LMs (archlab verify compares them)
            raise UserError(f"{path} holds an {model.config.arch} ({model.config.name}, a masked LM): "
                            "generate, diagnose and serve need a decoder-only LM")
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
