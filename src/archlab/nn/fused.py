"""Eager-mode savings: hand-written backward passes for two elementwise layers, and one matmul for
several projections of the same input under autocast.

Eager PyTorch runs every op of a composite layer as its own pass over memory. For RMSNorm that is
~3 passes forward and ~9 backward, and autograd keeps x, x^2's mean and the normalized x; here the
forward keeps only the normalized x and 1/rms, and the backward is 5 passes (forward + backward measured
1.6x faster on CPU, about 5% of a LLaMA-style training step). RoPE's backward is the transposed
rotation, one multiply and one multiply-add (1.6x faster in isolation; within the noise of a step).
tests/nn/test_fused.py checks values and gradients against the composite formulas.

Decoding is the other end: a step over a few rows is dominated by per-op and per-module overhead, so
without gradients `rms_norm` and `rope_half` run their forward math directly (no autograd.Function), and
the decode form of a model is one object, its `DecodePlan`, which the model builds and keeps
(`model.decode_plan()`: per model, released with it; no module-level table). The plan holds

- packed weights: transposed copies of the Linears a decode step multiplies by (q/k/v as one, gate/up as one,
  o, down, the head), built at their first use and rebuilt when a weight is replaced or changed in place
  (at one row `x @ W_t` runs MKL's faster gemv layout, ~1.3x on the weights that dominate a step; one
  extra copy of the weights, per model, weakly keyed by the modules so a replaced module's copy goes with it);
- the direct call path: `direct(module, session)`, a view of a module whose children are their `forward`s,
  so a step's ~35 module calls skip nn.Module.__call__'s two frames of hook checks (~1.5 us each, 3-5% of a
  small model's step). The modules still read `self.norm(x)` off the view or themselves: the plain path
  stays the reference the decode path is tested equal to, and no module or class is changed;
- the compiled step, where a generation asks for one (`compile=True`): the plain forward of one token per row
  traced by torch.compile (nn/compiled_step.py), rebuilt when the weights change.

A `DecodeSession` is one decode loop's use of the plan (a generate call, a server's batch composition),
handed to every forward of the loop (`model(tok, positions=p, cache=c, session=s)`, then `AttnInputs.session`,
the MLP's and the head's `session` argument): it checks the model once for hooks (none anywhere: the direct
path; else every call goes through its module) and keeps each module's decode weights after their first use
in the session, so a step looks each module up once. Two threads decoding two models each use their own
session and plan; two sessions of one model share its plan's packed copies.
"""
from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, Hashable, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from archlab.nn.int8 import Int8Matrix, Int8Packed, int8_pack, is_quantized

__all__ = ["rms_norm", "rope_half", "project", "linear", "head_linear", "packed_linears",
           "packed_matmul", "packed_split", "packed_groups", "packable", "decode_weights", "DecodeSession",
           "DecodePlan", "PlannedDecode", "decode_session", "direct", "call", "materialized", "matrix", "DECODE_ROWS"]

DECODE_ROWS = 32   # at most this many rows without gradients: the packed (decode) path of project/linear


class DecodePlan:
    """A model's decode form (the module docstring): its packed weights, kept across sessions while the weights
    are unchanged, and the direct views of its modules. Built by the model (`PlannedDecode.decode_plan`) and
    held by it and by each session decoding it; a copy or a pickle of the model starts a fresh, empty plan.
    Example: session = DecodeSession(model.decode_plan(), model)"""

    __slots__ = ("packs", "step", "__weakref__")

    def __init__(self) -> None:
        # first module of a group (or a head's owner) -> {key: packed weights}; weak keys: a replaced module's
        # copies go with it, and the plan never keeps a module (nor its model) alive
        self.packs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # the compiled decode step (nn/compiled_step.CompiledStep), built on a compiling session's first use
        self.step: Any = None

    def __reduce__(self):                     # copy.deepcopy / pickle of a model: an empty plan, rebuilt on use
        return (DecodePlan, ())

    def packed(self, owner: nn.Module, key: str, weights: list[torch.Tensor], biases: list[torch.Tensor],
               sources: list[torch.Tensor] | None = None) -> _Packed:
        """`weights` (out_i, in) concatenated and transposed to (in, sum out_i), `biases` (all or none of them)
        concatenated; kept per `owner` and `key`, rebuilt when a tensor is replaced or changed in place.
        `sources`: the tensors the weights are computed from, when they are not the weights themselves (an
        adapted Linear's W + s B A is computed from W, A and B)."""
        sources = (weights if sources is None else sources) + biases
        slot = self._slot(owner)
        hit = slot.get(key)
        if hit is None or not hit.fresh(sources):
            slot[key] = hit = _Packed(sources, weights, biases)
        return hit

    def fresh(self, owner: nn.Module, key: str, sources: list[torch.Tensor]) -> _Packed | None:
        """The packed weights under (owner, key) if they were built from `sources`, unchanged since; else None."""
        hit = self.packs.get(owner, {}).get(key)
        return hit if hit is not None and hit.fresh(sources) else None

    def int8(self, modules: tuple[Int8Matrix, ...], bias: list[torch.Tensor] | None = None) -> Int8Packed | None:
        """Some int8 modules' decode form (nn/int8.int8_pack), kept per module group while their int8 tensors
        and the decode kernel are unchanged."""
        from archlab.nn.int8 import decode_kernel

        slot, key = self._slot(modules[0]), (decode_kernel(), len(modules))
        hit = slot.get(key)
        if hit is None or not hit.fresh(modules):
            hit = int8_pack(modules, bias, kernel=key[0])
            if hit is not None:
                slot[key] = hit
        return hit

    def _slot(self, owner: nn.Module) -> dict:
        slot = self.packs.get(owner)
        if slot is None:
            slot = self.packs[owner] = {}
        return slot


class PlannedDecode:
    """Mixin for an LM that decodes (before nn.Module in its bases): its DecodePlan, made with the model and kept
    by it (an attribute, not a module: no state-dict key, released with the model)."""

    def __init__(self) -> None:
        super().__init__()
        self._decode_plan = DecodePlan()

    def decode_plan(self) -> DecodePlan:
        """This model's decode plan (nn/fused.DecodePlan).
        Example: session = DecodeSession(model.decode_plan(), model)"""
        plan = self.__dict__.get("_decode_plan")
        if plan is None:
            plan = self.__dict__["_decode_plan"] = DecodePlan()
        return plan


class DecodeSession:
    """One decode loop's use of a model's plan, checked once (a generate call, a server step), handed to every
    forward of the loop (`model(..., session=session)`): each module's packed weights at their first use in the
    session (built from the current tensors, no hooks on the module, no autocast), then reused without checks.
    So a weight changed in place between two generate calls is seen; one changed in the middle of a call is not
    (nor is a hook registered mid-call). Given the model, the session also takes the direct call path when no
    hook is anywhere (`direct`); without it every module is called as a module and its hooks fire.
    Example: session = decode_session(model)
             for each step: with torch.no_grad(): logits = model(tok, positions=p, cache=c, session=session)"""

    __slots__ = ("plan", "packs", "views")

    def __init__(self, plan: DecodePlan | None = None, model: nn.Module | None = None) -> None:
        self.plan = plan if plan is not None else DecodePlan()
        self.packs: dict = {}     # a module | linears tuple | ("head", owner) -> its decode weights, or None
        # module -> its direct view (None: every call through nn.Module.__call__): only for a hook-free model
        self.views: dict[nn.Module, _Direct] | None = {} if model is not None and _hook_free(model) else None


def decode_session(model: nn.Module) -> DecodeSession:
    """A session over `model`'s own plan (`model.decode_plan()` where the model builds one, else a plan for this
    session alone). Example: session = decode_session(model); logits = model(tok, cache=c, session=session)"""
    build = getattr(model, "decode_plan", None)
    return DecodeSession(build() if callable(build) else None, model)


def _hook_free(model: nn.Module) -> bool:
    """No hook or compiled wrapper on any module of `model`, no global hook, no compile or trace running."""
    if (_module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks
            or _module._global_backward_pre_hooks or torch.compiler.is_compiling()
            or torch._C._get_tracing_state()):
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                   or m._compiled_call_impl is not None for m in model.modules())


class _Direct:
    """A module's direct view: each child (and each child of a tuple attribute, a stack's `layers`) as its
    `forward`, an absent one (None) as None, every other attribute read from the module itself."""

    def __init__(self, module: nn.Module):
        self._module = module
        for name, value in vars(module).items():
            if value is None or (isinstance(value, tuple) and value and all(isinstance(v, nn.Module) for v in value)):
                setattr(self, name, None if value is None else tuple(v.forward for v in value))
        for name, child in module._modules.items():
            setattr(self, name, None if child is None else child.forward)

    def __getattr__(self, name: str) -> Any:      # only for what the view does not hold: the module's own
        return getattr(self._module, name)


def direct(module: nn.Module, session: DecodeSession | None) -> Any:
    """`module` itself, or, in a session that takes the direct path, its view whose children are their forwards:
    `direct(self, session).norm(x)` is `self.norm(x)` without nn.Module.__call__. Example (Block.forward):
    m = direct(self, inputs.session); x = x + m.attn(m.attn_norm(x), inputs)"""
    views = None if session is None else session.views
    if views is None:
        return module
    view = views.get(module)
    if view is None:
        view = views[module] = _Direct(module)
    return view


def call(module: nn.Module, session: DecodeSession | None) -> Callable[..., Any]:
    """`module` as a callable: its forward in a session that takes the direct path, else the module.
    Example: logits = call(model.lm_head, session)(hidden, session)"""
    return module if session is None or session.views is None else module.forward


def decode_weights(session: DecodeSession | None, x: torch.Tensor, owner: Hashable,
                   build: Callable[[torch.Tensor, DecodePlan], Any]) -> Any:
    """`owner`'s prepared decode weights when x is a decode input (a session, a few rows, no gradients),
    else None: the session's entry for `owner`, `build(x, plan)` at its first use in the session (None from
    build: the module runs its usual path all session). One lookup per module and step.
    Example (DenseMLP.forward): packs = decode_weights(session, x, self, self._decode_weights)"""
    if session is None or torch.is_grad_enabled() or x.shape[:-1].numel() > DECODE_ROWS:
        return None
    hit = session.packs.get(owner, _MISSING)
    if hit is _MISSING:
        hit = session.packs[owner] = build(x, session.plan)
    return hit


def _linears_pack(session: DecodeSession | None, x: torch.Tensor, linears: tuple[nn.Linear, ...]
                  ) -> _Packed | Int8Packed | None:
    """`decode_weights` for some Linears of the same input, keyed by the Linears themselves."""
    if session is None:
        return None
    return decode_weights(session, x, linears,
                          lambda x, plan: packed_linears(plan, linears) if packable(x, linears) else None)


_MISSING = object()


def packable(x: torch.Tensor, modules: tuple[nn.Module, ...]) -> bool:
    """No hooks to honour (global, or on the modules), no autocast (which casts per matmul): `modules` may
    run through packed weights for input x. Example: if packable(x, (mlp.up_proj,)): ..."""
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return False
    if any(m._forward_hooks or m._forward_pre_hooks for m in modules):
        return False
    return not torch.is_autocast_enabled(x.device.type)


class _Packed:
    """W_t (in, sum of outs) and the concatenated bias of some Linears' tensors, with what they were built
    from (`sources` and their in-place version counters)."""

    __slots__ = ("sources", "versions", "w_t", "bias", "sizes")

    def __init__(self, sources: list[torch.Tensor], weights: list[torch.Tensor], biases: list[torch.Tensor]):
        self.sources = sources
        try:
            self.versions: list[int] | None = list(map(_VERSION, sources))
        except RuntimeError:   # tensors created under inference_mode have no version counter: no reuse
            self.versions = None
        with torch.no_grad():
            self.w_t = torch.cat(weights).t().contiguous()                    # (in, sum of outs)
            self.bias = torch.cat(biases) if biases else None
        self.sizes = [w.shape[0] for w in weights]

    def fresh(self, sources: list[torch.Tensor]) -> bool:
        """Built from these very tensors, none changed in place since."""
        return (self.versions is not None and len(sources) == len(self.sources)
                and all(map(operator.is_, sources, self.sources)) and list(map(_VERSION, sources)) == self.versions)


_VERSION = operator.attrgetter("_version")


def packed_groups(plan: DecodePlan, x: torch.Tensor, *groups: tuple[nn.Linear, ...]
                  ) -> tuple[_Packed | Int8Packed, ...] | None:
    """A module's decode weights from `plan`: each group of its Linears packed (`packed_linears`), or None when
    one of them must run as itself for input x (hooks, autocast: `packable`) or a group mixes bias settings.
    Example (DenseMLP._decode_weights):
        return packed_groups(plan, x, (self.gate_proj, self.up_proj), (self.down_proj,))"""
    if not packable(x, tuple(lin for group in groups for lin in group)):
        return None
    packs = [packed_linears(plan, group) for group in groups]
    return tuple(pack for pack in packs if pack is not None) if None not in packs else None


def matrix(lin: nn.Linear) -> torch.Tensor | None:
    """The (out, in) matrix `lin(x)` multiplies by: its weight, or an adapted Linear's merged W + s B A
    (nn/lora.LoRALinear.effective_weight); None when no single matrix is the layer (adapter dropout in
    training): it must run as itself."""
    effective = getattr(lin, "effective_weight", None)
    return lin.weight if effective is None else effective()


def _always() -> bool:
    return True


def _matrix_sources(lin: nn.Linear) -> list[torch.Tensor]:
    sources = getattr(lin, "weight_sources", None)
    return [lin.weight] if sources is None else sources()


def packed_linears(plan: DecodePlan, linears: tuple[nn.Linear, ...]) -> _Packed | Int8Packed | None:
    """The packed weights of `linears`, kept in `plan` (None when some have a bias and some do not, or one has no
    single matrix: `matrix`); int8 layers (nn/int8.py) pack into their decode kernel's form, or run as
    themselves beside float ones. Example: pack = packed_linears(model.decode_plan(), (attn.q_proj, attn.k_proj))"""
    if any(map(is_quantized, linears)):
        return plan.int8(cast(tuple[Int8Matrix, ...], linears)) if all(map(is_quantized, linears)) else None
    biases: list[torch.Tensor] = [lin.bias for lin in linears if lin.bias is not None]
    if biases and len(biases) != len(linears):
        return None
    key = f"project{len(linears)}"
    if not any(hasattr(lin, "effective_weight") for lin in linears):
        return plan.packed(linears[0], key, [lin.weight for lin in linears], biases)
    if not all(getattr(lin, "has_matrix", _always)() for lin in linears):
        return None
    sources = [t for lin in linears for t in _matrix_sources(lin)]
    hit = plan.fresh(linears[0], key, sources + biases)
    if hit is not None:                                       # adapters unchanged: no new W + s B A
        return hit
    weights = cast(list[torch.Tensor], [matrix(lin) for lin in linears])
    return plan.packed(linears[0], key, weights, biases, sources)


def packed_matmul(x: torch.Tensor, pack: _Packed | Int8Packed) -> torch.Tensor:   # (..., in) -> (..., sum of outs)
    """x times the packed weights (+ bias)."""
    if isinstance(pack, Int8Packed):
        return pack.matmul(x)
    if torch.compiler.is_compiling():
        rows = _rows(x)                                                              # (n, in)
        out = torch.mm(rows, pack.w_t) if pack.bias is None else torch.addmm(pack.bias, rows, pack.w_t)
        return out.view(*x.shape[:-1], out.shape[-1])
    if x.dim() == 2:
        return torch.mm(x, pack.w_t) if pack.bias is None else torch.addmm(pack.bias, x, pack.w_t)
    out = x @ pack.w_t                                # matmul folds (b, t, in) into one mm in C++: no Python views
    return out if pack.bias is None else out.add_(pack.bias)


def _rows(x: torch.Tensor) -> torch.Tensor:                                          # (..., in) -> (n, in)
    """x's rows as one matrix for a traced matmul, strided (in, 1) explicitly: inductor's view of a (1, 1, in) buffer
    as (1, in) gets stride 0 on its size-1 dimension, which MKL's gemm takes for a non-contiguous matrix and copies
    (SmolLM2-135M: 91 copies of a row a compiled decode step, every matmul but o's)."""
    return materialized(x, (x.shape[:-1].numel(), x.shape[-1]))


def materialized(x: torch.Tensor, shape: tuple[int, ...] | torch.Size | None = None) -> torch.Tensor:
    """x (or x reshaped to `shape`) as an explicit contiguous view (as_strided) of itself, for a traced step: inductor
    computes what an as_strided reads into a buffer first, where it would otherwise recompute an elementwise producer
    inside each iteration of the loop that reads it (a decode step's rotated queries: RoPE's cos and sin once per
    key, not once). Eagerly a view. Example: q = materialized(rope_half(q, cos, sin))"""
    x = x.contiguous()
    shape = tuple(x.shape if shape is None else shape)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return x.as_strided(shape, tuple(reversed(strides)))


def packed_split(x: torch.Tensor, pack: _Packed | Int8Packed) -> tuple[torch.Tensor, ...]:
    """(l(x) for l in the packed Linears): one matmul, split by their output sizes.
    Example: gate, up = packed_split(x, packed_linears(plan, (mlp.gate_proj, mlp.up_proj)))"""
    return packed_matmul(x, pack).split_with_sizes(pack.sizes, dim=-1)


def project(x: torch.Tensor, linears: tuple[nn.Linear, ...], session: DecodeSession | None = None
            ) -> tuple[torch.Tensor, ...]:
    """(l(x) for l in linears), as one matmul where that pays.

    Under autocast, one matmul over the concatenated weights: autocast casts a float32 input once per
    matmul, and backward casts each projection's dL/dx back and sums them: for q/k/v that is three casts
    and two adds each way, for gate/up two and one (bf16 steps measured 1-9% faster over three runs).
    Decoding (a session, a few rows, no gradients): one matmul over the packed, transposed weights.
    Otherwise the concatenation and the split's backward cost what they save, so the projections run one
    by one. The parameters stay separate Linears, as checkpoints and the lecture name them.
    Example: q, k, v = project(x, (attn.q_proj, attn.k_proj, attn.v_proj))
    """
    pack = _linears_pack(session, x, linears)
    if pack is not None:
        return packed_split(x, pack)
    if not (torch.is_autocast_enabled(x.device.type) and x.shape[:-1].numel() >= x.shape[-1]):
        return tuple(linear(x) for linear in linears)
    biases = [linear.bias for linear in linears]
    if len({bias is None for bias in biases}) != 1 or any(hasattr(lin, "effective_weight") or is_quantized(lin)
                                                           for lin in linears):
        return tuple(linear(x) for linear in linears)                    # adapters run as themselves (dropout, grads)
    weight = torch.cat([linear.weight for linear in linears], dim=0)    # (sum of outs, d)
    bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
    out = F.linear(x, weight, bias)                                      # (..., sum of outs)
    return out.split([linear.out_features for linear in linears], dim=-1)


def linear(x: torch.Tensor, module: nn.Linear, session: DecodeSession | None = None) -> torch.Tensor:
    """module(x), through the packed weights when decoding in `session` (see `project`)."""
    pack = _linears_pack(session, x, (module,))
    return module(x) if pack is None else packed_matmul(x, pack)


def head_linear(x: torch.Tensor, owner: nn.Module, weight: torch.Tensor | Int8Matrix, bias: torch.Tensor | None,
                session: DecodeSession | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for an LM head (a matrix that may be the tied embedding, not a
    Linear), through a packed transposed copy when decoding in `session`; `weight` may be int8 rows
    (nn/int8.Int8Matrix: the decode kernel's form when decoding, else the dequantized matrix)."""
    biases = [] if bias is None else [bias]
    if isinstance(weight, Int8Matrix):
        rows = weight
        pack8 = None if session is None else decode_weights(
            session, x, ("head", owner),
            lambda x, plan: plan.int8((rows,), biases) if packable(x, (owner,)) else None)
        return F.linear(x, rows.weight.to(x.dtype), bias) if pack8 is None else pack8.matmul(x)
    pack = None if session is None else decode_weights(
        session, x, ("head", owner),
        lambda x, plan: plan.packed(owner, "head", [weight], biases) if packable(x, (owner,)) else None)
    return F.linear(x, weight, bias) if pack is None else packed_matmul(x, pack)


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """The one RMSNorm formula: (y in x's dtype, xhat and 1/rms in float32) for x (..., d).
    1/rms = rsqrt(eps + |x|^2 / d), the sum in one addcmul with eps as a tensor: a decode step is a few
    rows, where every op call shows, and scalar ops (x / d, + eps) cost one more call each for wrapping
    the number. (Casts only where a dtype differs, for the same reason.)"""
    xf = x if x.dtype in _WIDE else x.float()         # float32, or float64 for gradcheck
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)                  # (..., 1)
    rstd = torch.addcmul(_eps(eps, xf.device), norm, norm, value=1.0 / xf.shape[-1]).rsqrt_()
    xhat = xf * rstd                                  # (..., d) float32
    y = xhat * (weight if weight.dtype == xf.dtype else weight.to(xf.dtype))
    return (y if y.dtype == x.dtype else y.to(x.dtype)), xhat, rstd


_EPS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _eps(eps: float, device: torch.device) -> torch.Tensor:
    """eps as a 0-d float32 tensor on `device`, made once (a 0-d tensor takes the other operands' dtype);
    a traced constant under torch.compile (which must not store a tensor it made in a global)."""
    if torch.compiler.is_compiling():
        return torch.full((), eps, dtype=torch.float32, device=device)
    key = (eps, device)
    hit = _EPS.get(key)
    if hit is None:
        with torch.inference_mode(False):             # a normal tensor, though made while decoding
            hit = _EPS[key] = torch.tensor(eps, dtype=torch.float32, device=device)
    return hit


_WIDE = (torch.float32, torch.float64)


class _RMSNorm(torch.autograd.Function):
    """y = x / rms(x) * w, computed in float32 (Zhang & Sennrich 2019)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):          # x (..., d), weight (d,) or broadcast to x (QK-norm per head)
        y, xhat, rstd = _rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(xhat, rstd, weight)     # xhat, not x: backward needs no recompute
        ctx.in_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd, weight = ctx.saved_tensors
        g, w = grad.to(xhat.dtype), weight.to(xhat.dtype)
        g_xhat = g * xhat                                               # (..., d)
        dw = None
        if ctx.needs_input_grad[1]:   # summed over what the weight was broadcast across
            dw = g_xhat.flatten(0, -2).sum(0) if w.dim() == 1 else g_xhat.sum_to_size(w.shape)
        # dx = rstd * (g w - xhat * mean(g w xhat)); mean(g w xhat) = (g xhat) @ w / d, one gemv for a (d,) weight
        gw_xhat = (g_xhat @ w).unsqueeze(-1) if w.dim() == 1 else (g_xhat * w).sum(-1, keepdim=True)
        mean = gw_xhat.div_(xhat.shape[-1])                             # (..., 1)
        dx = torch.addcmul(g * w, xhat, mean, value=-1).mul_(rstd)
        return dx.to(ctx.in_dtype), None if dw is None else dw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # (..., d) -> same
    """x / rms(x) * weight in float32, returned in x's dtype; weight (d,), or any shape that broadcasts to x
    (one weight per head: (h, 1, e) for x (b, h, t, e)). Example: y = rms_norm(x, norm.weight, 1e-5)"""
    if not torch.is_grad_enabled():                   # no backward to save for: the formula alone
        return _rms_norm_forward(x, weight, eps)[0]
    return _RMSNorm.apply(x, weight, eps)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [x2, x1] over the last dim: a permutation that is its own inverse (and adjoint)."""
    return x.roll(x.shape[-1] // 2, dims=-1)                          # one op, not two slices and a cat


def _rope_half_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The one half-layout RoPE formula: x [cos, cos] + [x2, x1] [-sin, sin]."""
    return torch.addcmul(x * cos, _swap_halves(x), sin)


class _RopeHalf(torch.autograd.Function):
    """y = x * [cos, cos] + swap(x) * [-sin, sin]: RoPE in the "half" layout. Linear in x, so the
    backward is the transposed rotation, dx = g * [cos, cos] + swap(g * [-sin, sin]); nothing of x
    is kept."""

    @staticmethod
    def forward(ctx, x, cos, sin):                    # x (b, h, t, e); cos, sin broadcast to it
        ctx.save_for_backward(cos, sin)
        return _rope_half_forward(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return torch.addcmul(_swap_halves(grad * sin), grad, cos), None, None


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate all of x's last dim; cos = [cos, cos] and sin = [-sin, sin] (RotaryEmbedding.tables).
    Example: cos, sin = rope.tables(positions, q.dtype); q = rope_half(q, cos, sin)"""
    if not torch.is_grad_enabled():
        return _rope_half_forward(x, cos, sin)
    return _RopeHalf.apply(x, cos, sin)
