"""Calling a child module without nn.Module.__call__'s bookkeeping where nothing can tell the difference.

`module(x)` goes through two Python frames that look for hooks, a compiled wrapper and a JIT trace before
they call `forward`: about 3 us a call measured on a 2-core EPYC (an RMSNorm called as a module against its
forward). A training step does not notice; a decode step makes some 30 such calls for a 6-layer model,
where each microsecond of Python shows. `call(module, *args)` checks the
same conditions and runs `module.forward(*args)` directly when none holds, so hooks (the module's own and
global ones), torch.compile and torch.jit.trace see exactly what they would see with `module(*args)`.

A decode loop checks a whole model once instead (`hook_free`, through nn/fused.DecodeSession), and its forwards
hand that set to their calls (`call(module, *args, direct=inputs.direct)`: nn/masks.AttnInputs carries the
session's set): a `call` on one of those modules runs `forward` at once, so a hook registered in the middle
of that loop is not seen (as packed weights). Any other module, and every call of a forward given no
session, keeps every check.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module

__all__ = ["call", "hook_free"]

NO_MODULES: frozenset[nn.Module] = frozenset()   # `direct` of a forward without a decode session


def _global_hooks() -> bool:
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or module._compiled_call_impl is not None)


def call(module: nn.Module, *args: Any, direct: frozenset[nn.Module] = NO_MODULES) -> Any:
    """module(*args), skipping __call__'s bookkeeping when no hook, compiled wrapper or trace is there to see it;
    `direct`: modules a decode session checked hook-free (DecodeSession.direct), called with no check at all.
    Example: x = x + call(self.attn, call(self.attn_norm, x), inputs)"""
    if direct and module in direct:   # a hook-free model whose decode session this forward was given
        return module.forward(*args)
    if _hooked(module) or _global_hooks() or torch.compiler.is_compiling() or torch._C._get_tracing_state():
        return module(*args)
    return module.forward(*args)


def hook_free(model: nn.Module) -> frozenset[nn.Module]:
    """model's modules, when none has a hook or compiled wrapper and no global hook, compile or trace is
    running (`call` may then skip every check for them); else the empty set.
    Example: DecodeSession(model).direct == hook_free(model)   # what a session's forward hands to `call`"""
    if _global_hooks() or torch.compiler.is_compiling() or torch._C._get_tracing_state():
        return frozenset()
    modules = frozenset(model.modules())
    return frozenset() if any(_hooked(m) for m in modules) else modules
