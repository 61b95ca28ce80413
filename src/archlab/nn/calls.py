"""Calling a child module without nn.Module.__call__'s bookkeeping where nothing can tell the difference.

`module(x)` goes through two Python frames that look for hooks, a compiled wrapper and a JIT trace before
they call `forward`: about 3 us a call measured on a 2-core EPYC (an RMSNorm called as a module against its
forward). A training step does not notice; a decode step makes some 30 such calls for a 6-layer model,
where each microsecond of Python shows. `call(module, *args)` checks the
same conditions and runs `module.forward(*args)` directly when none holds, so hooks (the module's own and
global ones), torch.compile and torch.jit.trace see exactly what they would see with `module(*args)`.

A decode loop checks a whole model once instead (`hook_free`), and within `direct(True)` every `call` runs
`forward` at once: a hook registered in the middle of that loop is not seen (as packed weights, nn/fused.py).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn.modules import module as _module

__all__ = ["call", "direct", "hook_free"]

_DIRECT = False   # a plain global (torch.compile traces it): set only within `direct`, over a checked model


def _global_hooks() -> bool:
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or module._compiled_call_impl is not None)


def call(module: nn.Module, *args: Any) -> Any:
    """module(*args), skipping __call__'s bookkeeping when no hook, compiled wrapper or trace is there to see it.
    Example: x = x + call(self.attn, call(self.attn_norm, x), inputs)"""
    if _DIRECT:
        return module.forward(*args)
    if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
            or _module._global_forward_hooks or _module._global_forward_pre_hooks
            or _module._global_backward_hooks or _module._global_backward_pre_hooks
            or module._compiled_call_impl is not None or torch.compiler.is_compiling()
            or torch._C._get_tracing_state()):
        return module(*args)
    return module.forward(*args)


def hook_free(model: nn.Module) -> bool:
    """No hook or compiled wrapper on any of model's modules, no global hook, no compile or trace running:
    `call` may skip every check for this model (`direct`)."""
    if _global_hooks() or torch.compiler.is_compiling() or torch._C._get_tracing_state():
        return False
    return not any(_hooked(m) for m in model.modules())


@contextlib.contextmanager
def direct(enabled: bool) -> Iterator[None]:
    """Within: `call` runs every module's forward without checks. Enable it only for a model `hook_free`
    has just checked. Example: with direct(hook_free(model)): logits = model(tok, positions=p, cache=c)"""
    global _DIRECT
    before, _DIRECT = _DIRECT, enabled
    try:
        yield
    finally:
        _DIRECT = before
