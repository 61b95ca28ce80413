"""Weights to start a new run from: `archlab train --init-from RUN_OR_HF_FOLDER_OR_HUB_ID --data ... --out ...`.

Only the weights come along. The optimizer and the LR schedule start fresh, the run is a new run folder,
and the model config is the source's (`--set` may change what keeps every weight's shape: dropout, a
window, z-loss...). The data must be encoded by the source's tokenizer, compared by what encodes
(runs.provenance.tokenizer_fingerprint), not by the files beside it.

    source = read_init_source("runs/qwen")           # a run folder, an HF folder, or hf:ORG/NAME[@REV]
    cfg = source.model_config.with_overrides({"dropout": 0.1})
    source.check_model(cfg)                            # ConfigError when a weight changes shape
    train(cfg, train_cfg, "data/mine", "runs/mine", init_from=source)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from archlab.config import ConfigError, ModelConfig
from archlab.errors import DataError, UserError
from archlab.models.legacy_keys import upgrade_keys

__all__ = ["InitSource", "read_init_source", "extended_config"]


@dataclass(frozen=True)
class InitSource:
    """A model to start from: its config, its weights (our parameter names, on CPU), where they came from,
    and the folder holding its tokenizer (None: it has none)."""

    spec: str
    model_config: ModelConfig
    state: dict[str, torch.Tensor]
    weights: str
    tokenizer_dir: Path | None

    def check_model(self, cfg: ModelConfig) -> None:
        """ConfigError unless `cfg` builds a model with exactly the source's weight names and shapes."""
        from archlab.models import build_model

        with torch.device("meta"):                        # shapes only: no memory, no init
            wanted = {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items()}
        have = {k: tuple(v.shape) for k, v in self.state.items() if not _is_scalar_head(k)}   # a method's, not cfg's
        for name in sorted(wanted.keys() | have.keys()):
            if wanted.get(name) != have.get(name):
                ours = "no such weight" if name not in wanted else f"shape {wanted[name]}"
                theirs = "no such weight" if name not in have else f"shape {have[name]}"
                raise ConfigError(f"--init-from {self.spec}: the model config gives {name} {ours}, the source "
                                  f"{theirs}; only --set overrides that keep every weight's shape apply")

    def check_tokenizer(self, data_tokenizer: Path, data_dir: str | os.PathLike) -> None:
        """DataError unless the data folder's tokenizer encodes as the source's does."""
        from archlab.runs.provenance import tokenizer_fingerprint

        ours = tokenizer_fingerprint(self.tokenizer_dir) if self.tokenizer_dir is not None else None
        if ours is None:
            raise DataError(f"--init-from {self.spec} holds no tokenizer (tokenizer/ or tokenizer.json), so the "
                            f"tokens of --data {data_dir} cannot be checked against the ones it was trained on")
        if tokenizer_fingerprint(data_tokenizer) != ours:
            raise DataError(f"--data {data_dir} was prepared with a different tokenizer ({data_tokenizer}, "
                            f"{_size(data_tokenizer)}) than --init-from {self.spec}'s ({self.tokenizer_dir}, "
                            f"{_size(self.tokenizer_dir)}): the tokenizers differ, so the ids mean other text; "
                            f"prepare it with `archlab data prepare --tokenizer {self.tokenizer_dir}`")

    def weights_for(self, fresh: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The source's weights for a run whose method adds the modules `fresh` holds: a scalar head the source has
        (a reward run's score head, a PPO policy's value head) is kept only where this run has one too, so a PPO
        policy or a reward model can be the base of another method."""
        return {k: v for k, v in self.state.items() if not _is_scalar_head(k) or k in fresh}

    def record(self) -> dict:
        """What config.yaml keeps of the source."""
        from archlab.runs.provenance import tokenizer_fingerprint

        return {"source": self.spec, "weights": self.weights,
                "tokenizer_fingerprint": tokenizer_fingerprint(self.tokenizer_dir) if self.tokenizer_dir else None}


def _is_scalar_head(name: str) -> bool:
    from archlab.nn.heads import SCALAR_HEADS

    return name.split(".", 1)[0] in SCALAR_HEADS


def read_init_source(spec: str | os.PathLike) -> InitSource:
    """An InitSource from a run folder (its newest checkpoint, sha256 verified), an HF folder
    (archlab.interop.load_hf) or an `hf:ORG/NAME[@REVISION]` id (safetensors and configs only)."""
    from archlab.runs.hub import resolve_model

    text = os.fspath(spec)
    folder = resolve_model(text)
    if not folder.is_dir():
        raise UserError(f"--init-from {text}: no such folder")
    if (folder / "config.yaml").is_file():
        return _from_run(text, folder)
    if (folder / "config.json").is_file():
        return _from_hf(text, folder)
    raise UserError(f"--init-from {text} is neither a run folder (config.yaml) nor an HF folder (config.json)")


def _from_run(spec: str, folder: Path) -> InitSource:
    from archlab.runs import checkpoint as ckpt_io
    from archlab.runs import model_folder

    model_folder.refuse_quantized(folder, "--init-from (training)")
    cfg = ModelConfig.from_dict(model_folder.read_run_config(folder)["model"])
    latest = ckpt_io.latest_checkpoint(folder)
    if latest is None:
        raise ckpt_io.CheckpointError(f"--init-from {spec}: no checkpoint under {folder / ckpt_io.CHECKPOINT_DIR}")
    state, _ = ckpt_io.load_checkpoint(latest, weights_only_model=True, full_verify=True)
    state = upgrade_keys(state, cfg.arch)              # a run folder of an earlier module layout
    if any(".lora_" in k for k in state):              # a LoRA run: its adapters folded in, as load_run does
        from archlab.nn.lora import merge_lora

        model = model_folder.model_with_weights(cfg, state, latest / ckpt_io.MODEL_FILE,
                                                train=model_folder.read_run_config(folder).get("train"))
        state = {k: v.detach() for k, v in merge_lora(model).state_dict().items()}
    tokenizer = next((folder / name for name in ("tokenizer", "tokenizer_hf") if (folder / name).is_dir()), None)
    return InitSource(spec, cfg, state, str(latest / ckpt_io.MODEL_FILE), tokenizer)


def _from_hf(spec: str, folder: Path) -> InitSource:
    from archlab.interop.hf import load_hf

    model = load_hf(folder, dtype=None)
    return InitSource(spec, model.config, {k: v.detach() for k, v in model.state_dict().items()}, str(folder),
                      folder)


def extended_config(source: ModelConfig, cfg: ModelConfig, overrides: dict) -> tuple[ModelConfig, str | None]:
    """Context extension of an --init-from model: when --set gives RoPE a new `position.rope_scaling`, the
    length it was trained at (the source's max_seq_len) becomes `original_max_seq_len` and max_seq_len grows to
    original * factor, unless --set names them. Returns (config, a line saying what changed, or None).
    UserError for a factor <= 1 (nothing to extend) or a model without RoPE.
    Example: extended_config(src, src.with_overrides({"position.rope_scaling.kind": "yarn",
             "position.rope_scaling.factor": 4}), {...})  # max_seq_len 256 -> 1024, original 256"""
    scaling = cfg.position.rope_scaling
    if scaling is None or scaling == source.position.rope_scaling:
        return cfg, None
    if cfg.position.kind != "rope":
        raise UserError(f"position.rope_scaling extends RoPE; this model's position.kind is {cfg.position.kind!r}")
    if scaling.kind != "longrope" and scaling.factor <= 1:
        raise UserError(f"position.rope_scaling.factor={scaling.factor:g} must be > 1 to extend the context "
                        f"(the extended length is original_max_seq_len x factor)")
    changes: dict = {}
    original = scaling.original_max_seq_len
    if source.position.rope_scaling is None and "position.rope_scaling.original_max_seq_len" not in overrides:
        original = changes["position.rope_scaling.original_max_seq_len"] = source.max_seq_len
    if "max_seq_len" not in overrides:
        changes["max_seq_len"] = max(cfg.max_seq_len, round(original * scaling.factor))
    cfg = cfg.with_overrides(changes) if changes else cfg
    return cfg, (f"extending the context: RoPE scaling {scaling.kind} x{scaling.factor:g} over the original "
                 f"{original} positions; max_seq_len {source.max_seq_len} -> {cfg.max_seq_len}")


def _size(tokenizer_dir: str | os.PathLike) -> str:
    """"N tokens" of a tokenizer folder, as an error names it ("unreadable" when it cannot load)."""
    from archlab.tokenizer.loading import load

    try:
        return f"{load(tokenizer_dir).vocab_size:,} tokens"
    except Exception:  # noqa: BLE001 - only a description in an error that is already being raised
        return "unreadable"


def source_context(spec: str | os.PathLike) -> int | None:
    """The context (max_seq_len) of a run folder's or an HF folder's model, read from its config alone (no
    weights); None for an hf: id or a folder of neither kind (the full read says what is wrong with it).
    Example: source_context("runs/base") -> 128"""
    from archlab.interop.hf import family_for, read_hf_config
    from archlab.runs import model_folder

    folder = Path(os.fspath(spec))
    try:
        if (folder / "config.yaml").is_file():
            return int(ModelConfig.from_dict(model_folder.read_run_config(folder)["model"]).max_seq_len)
        if (folder / "config.json").is_file():
            hf = read_hf_config(folder)
            return int(family_for(hf).to_config(hf).max_seq_len)
    except (UserError, ValueError, KeyError, TypeError):
        return None
    return None

