"""Activation checkpointing (Chen et al. 2016, arXiv 1604.06174): each block keeps only its inputs
for backward and recomputes its own activations there. About one more forward of compute buys
activation memory that no longer grows with the per-layer activations, only with the residual stream.
Applied to a built model from outside, like DDP and FSDP (`train.activation_checkpointing=true`);
parameter names, and so checkpoints, do not change."""
from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["checkpoint_blocks"]


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Make every block of `model` (a TransformerLM) recompute its activations in backward.
    Example: model = checkpoint_blocks(TransformerLM(cfg)); the trainer does it for
    `archlab train ... --set train.activation_checkpointing=true`."""
    for block in model.blocks:
        # an instance attribute shadows the class's forward; nn.Module.__call__ (and its hooks) still run
        block.forward = functools.partial(_checkpointed, block.forward)
    return model


def _checkpointed(forward, *args, **kwargs):
    # non-reentrant: works with kwargs, FSDP2 and torch.compile; dropout masks are replayed exactly
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
