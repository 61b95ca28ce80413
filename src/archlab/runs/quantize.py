"""A quantized run folder: `archlab quantize RUN --weights int8 --out DIR` writes the run's model with int8 weights
(nn/int8.quantize_int8: every Linear and the token embedding or LM head, one scale per output row) as an ordinary
run folder: config.yaml (the source's, plus a `quantization` section the loader reads: runs/model_folder), the
tokenizer, and one checkpoint `checkpoints/step_0000000/model.safetensors` holding `*.qweight` (int8) and
`*.scale` (float32). generate, chat, eval, serve and diagnose load it like any run; train, finetune, --init-from
and convert --to-hf refuse it (model_folder.refuse_quantized).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from torch import nn

__all__ = ["write_quantized_run", "SCHEMES"]

SCHEMES = {"int8": "symmetric int8 weights, one float32 scale per output row (nn/quantize.quantize_rows)"}


def write_quantized_run(source: str | Path, quantized: nn.Module, out: str | Path, weights: str = "int8",
                        overwrite: bool = False, measured: dict | None = None) -> Path:
    """`quantized` (a model of `source` after nn/int8.quantize_int8) written as a run folder at `out`, atomically;
    `measured` (the float vs int8 figures) is recorded in the `quantization` section.
    Example: write_quantized_run("runs/smol", quantize_int8(model), "runs/smol-int8")"""
    import yaml

    from archlab.runs.checkpoint import CHECKPOINT_DIR, save_checkpoint
    from archlab.runs.model_folder import CONFIG_FILE, QUANTIZATION, read_run_config
    from archlab.runs.outputs import fresh_output

    source = Path(source)
    sections = dict(read_run_config(source))
    sections[QUANTIZATION] = {"weights": weights, "scheme": SCHEMES[weights], "source": str(source.resolve()),
                              **({"measured": measured} if measured else {})}
    with fresh_output(out, overwrite=overwrite, inputs=[source]) as tmp:
        (tmp / CONFIG_FILE).write_text(yaml.safe_dump(sections, sort_keys=False))
        state = {k: v.detach().contiguous() for k, v in quantized.state_dict().items()}
        save_checkpoint(tmp / CHECKPOINT_DIR, 0, state, {}, keep_last=0,
                        extra_meta={"quantized_from": str(source.resolve()), "weights": weights})
        for name in ("tokenizer", "tokenizer_hf"):
            if (source / name).is_dir():
                shutil.copytree(source / name, tmp / name)
    return Path(out)
