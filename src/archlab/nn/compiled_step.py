"""A compiled decode step: the model's own forward over one token per row, traced once by torch.compile
(inductor) and held by the model's DecodePlan.

Eager decoding of a small model is dominated by fixed costs, not by reading weights: ~40 aten calls and the
module logic per layer, each small op starting cold (docs/benchmarks.md, "Where a step goes"). Compiled, the
step's elementwise ops fuse (RMSNorm, RoPE, the mask, the cache writes, the residual adds, SwiGLU's product) and
the graph runs from a C++ wrapper (`cpp_wrapper`), so a step is its matmuls, its attention and little else.

What is traced is `model(tokens, positions=..., cache=SlotWrites(...))`: the plain module path, the reference
the eager decode is tested equal to, nothing rewritten. The KV cache is the generation's StaticKVCache (built
without rolling buffers), whose whole buffers enter the graph as inputs and are written in place at a slot given
as a tensor (nn/kv_cache.SlotWrites); the capacity dimension is marked dynamic, so neither the growing cache nor
another call's prompt length recompiles. Attention reads the slots up to the next multiple of SPAN past the
tokens held, not the whole capacity: their count is a second dynamic size, and the keys and values are cut to it
inside the graph, after the write (views of the buffers, not copies; a step into a cache's last slot runs the
same function eagerly, as the graph is traced for a cut). What does recompile: another batch size, dtype or
device (one graph each, up to torch._dynamo's recompile limit, 8 per model, after which the step runs
uncompiled, still correct), a cache made inside inference mode after one made outside it or the reverse (dynamo
guards on the kind of tensor), and weights replaced or changed in place since the compile (the plan notices at
the next session and compiles again: a graph may hold what it derived from them). Guards are checked on a
session's first compiled step; its later steps skip them (`skip_guard_eval_unsafe`): inside one generate call
nothing they check may change, as for the DecodeSession.
The model's plan holds the step and the step holds the model and the plan weakly, so no cycle keeps a deleted
model (or its weights) alive until the cycle collector runs.

Compiling takes tens of seconds (docs/benchmarks.md), so it is an opt-in: `generate(..., compile=True)`,
`archlab generate --compile`, `archlab chat --compile`. A model the step cannot take (hooks, int8 weights,
a compile that fails) decodes eagerly, with one warning where compiling failed.
Example: step = compiled_step(model.decode_plan(), model); logits = step(tokens, positions, cache, first=True)
"""
from __future__ import annotations

import time
import types
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from archlab.nn.int8 import is_quantized
from archlab.nn.kv_cache import SlotWrites, StaticKVCache

__all__ = ["CompiledStep", "compiled_step", "compilable", "INDUCTOR_OPTIONS", "SPAN"]

SPAN = 16    # a step attends over its cache's slots up to the next multiple of this past the tokens held

# cpp_wrapper: the graph's kernel calls from C++ rather than Python. Measured on the 8.5M-parameter benchmark model
# (CPU time per step, shared machine): at batch 1 plain inductor 2.03 ms, with the C++ wrapper ~1.6 ms, guards
# skipped after a session's first step ~0.1 ms less (the eager step 2.3-3.0 ms). Inductor's `freezing` (weights as
# constants, pre-packed) gained nothing at batch 8 (A/B 1.016x, 7 interleaved rounds) and doubled the compile
# time: not used. Passed per compile, so no global inductor setting changes.
INDUCTOR_OPTIONS = {"cpp_wrapper": True}


def compilable(model: nn.Module) -> str | None:
    """Why `model` cannot decode through a compiled step, or None when it can: a decoder-only TransformerLM
    (a `config`, no encoder) in floating point, no int8 layers (their decode kernels are fbgemm's)."""
    if (getattr(model, "config", None) is None or hasattr(model, "encode")
            or not callable(getattr(model, "decode_plan", None))):
        return "a decoder-only archlab model"
    if any(is_quantized(m) for m in model.modules()):
        return "floating-point weights (int8 layers decode through their own kernels)"
    return None


class CompiledStep:
    """One model's compiled decode step (the module docstring), and the weights it was traced with: `stale()`
    says whether any parameter or buffer was replaced or changed in place since. `compile_seconds`: the first call
    of each new graph (batch size, dtype), summed."""

    def __init__(self, model: nn.Module, plan: Any = None):
        from archlab.nn.fused import DecodeSession

        # the step's own session over the plan (no direct views: compiled, module calls cost nothing): the packed
        # weights (q/k/v as one matmul, gate/up as one, W transposed once) enter the graph as the eager decode
        # path multiplies by them; its packs are filled by an eager step before the first compile. The plan holds
        # this step, so the step holds the plan and the model weakly: `del model` frees them without the cycle
        # collector (no plan given: the session's own, held by it alone)
        self.session = DecodeSession(weakref.proxy(plan) if plan is not None else None)   # type: ignore[arg-type]
        session = self.session
        model_ref = weakref.ref(model)
        self.sources = [t for t in (*model.parameters(), *model.buffers())]
        self.versions = list(map(_version, self.sources))
        self.compile_seconds = 0.0
        self.graphs: set[tuple] = set()
        self.failed: str | None = None
        self.marked: torch.Tensor | None = None     # the positions buffer of the last buffers marked dynamic

        def step(tokens: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor, keys: list[torch.Tensor],
                 values: list[torch.Tensor], pos: torch.Tensor, span: torch.Tensor) -> torch.Tensor:  # (b, 1) -> (b, v)
            lm = model_ref()
            assert lm is not None, "a generation calling the step holds the model"
            cache = SlotWrites(keys, values, pos, slot, span)
            return lm(tokens, positions=positions, cache=cache, session=session)[:, -1]

        # a code object of its own: torch.compile keeps its graphs (and its recompile limit) per code object, so a
        # rebuilt step never finds the graphs traced with the old weights, nor another model's
        own = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, step.__defaults__,
                                 step.__closure__)
        self.eager = step
        self.compiled = torch.compile(own, fullgraph=True, dynamic=False, options=dict(INDUCTOR_OPTIONS))

    def stale(self, model: nn.Module) -> bool:
        """A parameter or buffer of `model` replaced or changed in place since the compile."""
        now = [t for t in (*model.parameters(), *model.buffers())]
        return (len(now) != len(self.sources) or any(a is not b for a, b in zip(now, self.sources))
                or any(_version(t) != v for t, v in zip(now, self.versions)))

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache, *,
                 first: bool) -> torch.Tensor | None:
        """Logits (b, v) after one token per row (tokens, positions (b, 1)) written at the cache's next slot; the
        cache counts it. `first`: the session's first step (guards checked). None when the step failed to compile
        (a warning, once per model): the caller decodes eagerly."""
        if self.failed is not None:
            return None
        args = self.arguments(tokens, positions, cache)
        keys, span = args[3], args[6].shape[0]
        if not 2 <= span < keys[0].shape[2]:    # into the cache's last slot, or a 2-slot cache: eagerly
            out = self.eager(*args)
            cache.advance(tokens.shape[1])
            return out
        key = (tokens.shape[0], keys[0].dtype, keys[0].device)      # batch, dtype, device: a graph each
        logits = None if first or key not in self.graphs else self._unguarded(args)
        if logits is None:                                   # guards checked; a new graph compiles here
            t0 = time.perf_counter()
            try:
                if key not in self.graphs:     # the session's packs filled eagerly (it writes what the graph writes)
                    self.eager(*args)
                logits = self.compiled(*args)
            except Exception as exc:   # noqa: BLE001  (a compiler error of any kind: decode eagerly)
                self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                warnings.warn(f"the compiled decode step failed to compile ({self.failed}); decoding eagerly",
                              stacklevel=3)
                return None
            if key not in self.graphs:
                self.graphs.add(key)
                self.compile_seconds += time.perf_counter() - t0
        cache.advance(tokens.shape[1])
        return logits

    def arguments(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache) -> tuple:
        """The step's inputs (tokens, positions, slot, keys, values, pos, span) for one token per row at the cache's
        next slot: the whole buffers, and as `span`'s length how many slots attention reads, those up to the next
        multiple of SPAN past the tokens held. On the benchmark model (batch 8, 161 slots) a 128-token decode reads
        104 slots on average instead of 161: the attention kernel's time goes with them."""
        keys, values, pos = cache.slots()
        held, slots = len(cache), pos.shape[1]
        # fewer than all the slots, always: the graph is traced for views (dynamo guards that their size and strides
        # differ from the buffer's), so a step into the last slot reads them all and runs eagerly (the generation's
        # cache has a slot to spare: generation/stepper.py)
        span = min(-(-(held + tokens.shape[1]) // SPAN) * SPAN, slots - 1) if held + tokens.shape[1] < slots else slots
        if pos is not self.marked:                        # new buffers (a new cache, a grown one, beams reordered)
            for t in (*keys, *values):
                torch._dynamo.maybe_mark_dynamic(t, 2)         # the capacity: one graph for every cache length
            torch._dynamo.maybe_mark_dynamic(pos, 1)
            self.marked = pos
        reads = torch.empty(span, dtype=torch.int8, device=pos.device)       # (span,) its length only
        torch._dynamo.maybe_mark_dynamic(reads, 0)             # one graph for every step
        tokens, positions = tokens.contiguous(), positions.contiguous()    # beams hand on views (index_select)
        return tokens, positions, torch.tensor(held, device=pos.device), keys, values, pos, reads

    def _unguarded(self, args: tuple) -> torch.Tensor | None:
        """The step without evaluating its guards (a session's later steps), or None where dynamo finds that the
        inputs need another graph (it refuses to compile without guards): the caller checks them."""
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self.compiled(*args)
        except RuntimeError as exc:
            if "Recompilation" not in str(exc):
                raise
            return None


def _version(t: torch.Tensor) -> int:
    """t's in-place version counter; -1 for a tensor made under inference_mode, which has none (a model built
    there is seen stale only when a tensor is replaced)."""
    return -1 if t.is_inference() else t._version


def compiled_step(plan: Any, model: nn.Module) -> CompiledStep | None:
    """`model`'s compiled step, kept by its decode plan (nn/fused.DecodePlan.step) and rebuilt when the weights
    changed; None when the model cannot take one (`compilable`). Example:
    step = compiled_step(model.decode_plan(), model)"""
    if compilable(model) is not None:
        return None
    step = plan.step
    if step is None or step.stale(model):
        step = plan.step = CompiledStep(model, plan)
    return step
