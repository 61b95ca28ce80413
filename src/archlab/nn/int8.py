"""int8 weights (one scale per output row) for a built model, and the kernels that multiply by them.

    Int8Matrix          qweight (o, i) int8 + scale (o,) float32: the stored form (nn/quantize.quantize_rows)
    QuantizedLinear     an nn.Linear's int8 form; forward = x @ dequantize(q, s)^T + b, the reference path
    QuantizedEmbedding  an nn.Embedding's int8 form (rows gathered, then scaled); a tied LM head reads its matrix
    quantize_int8(model)  every Linear and the token embedding (or an untied head) replaced in place

Decoding (a DecodeSession, a few rows, no gradients: nn/fused.py) multiplies by a kernel's prepared form of the
same int8 rows instead, packed per module group as the float path packs q/k/v and gate/up. The kernel is chosen
by measurement (benchmarks/int8_decode.py, docs/real_models_int8.md): on a 2-core AVX-512 Xeon with torch 2.13,
SmolLM2-135M's 211 linears at one row took 38.7 ms in fp32 (F.linear), 17.5 ms with fbgemm's dynamic int8 linear
(activations quantized per call, one scale for the rows of the call: per token at batch 1), 39.0 ms with
torch._int_mm after a per-token quantization, 106.7 ms with torch._weight_int8pack_mm, and torchao 0.18's
Int8WeightOnly / Int8DynamicActivationInt8Weight about 2x slower than fp32 (single-thread CPU time, torchao's in
a wall-clock run; torchao is not a dependency). So `fbgemm` is the decode kernel where torch has that engine,
`dequantize` (the reference) elsewhere.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from archlab.nn.quantize import dequantize_rows, quantize_rows
from archlab.nn.registry import Registry

__all__ = ["Int8Matrix", "QuantizedLinear", "QuantizedEmbedding", "quantize_int8", "is_quantized", "KERNELS",
           "Int8Kernel", "decode_kernel", "int8_pack", "Int8Packed", "rows_quantized_together", "weight_count"]


class Int8Matrix(nn.Module):
    """A (o, i) matrix stored as int8 rows and their float32 scales (buffers: saved, never trained)."""

    qweight: torch.Tensor                                                # (o, i) int8
    scale: torch.Tensor                                                  # (o,) float32

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))

    def set_from(self, weight: torch.Tensor) -> None:
        """Quantize `weight` (o, i) into this matrix's int8 rows and scales."""
        q, s = quantize_rows(weight)
        self.qweight.copy_(q)
        self.scale.copy_(s)

    @property
    def weight(self) -> torch.Tensor:                                    # (o, i), read-only: a fresh tensor
        """The dequantized matrix (what the reference path multiplies by)."""
        return dequantize_rows(self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row"


class QuantizedLinear(Int8Matrix):
    """y = x W^T + b with W = q * s[:, None] (int8 weights, one scale per output row)."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(out_features, in_features)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def layout_of(cls, linear: nn.Linear) -> "QuantizedLinear":
        """An empty QuantizedLinear of `linear`'s shape (weights to be loaded)."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:                  # (..., i) -> (..., o)
        return F.linear(x, dequantize_rows(self.qweight, self.scale, x.dtype),
                        None if self.bias is None else self.bias.to(x.dtype))


class QuantizedEmbedding(Int8Matrix):
    """E[ids] with E = q * s[:, None]: the token embedding as int8 rows (a tied head multiplies by the same rows)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:                # (b, t) -> (b, t, d)
        return F.embedding(ids, self.qweight).float() * self.scale[ids].unsqueeze(-1)


def is_quantized(module: nn.Module) -> bool:
    """True for an int8 module of this file (it has no float `weight` parameter to train or pack)."""
    return isinstance(module, Int8Matrix)


def weight_count(model: nn.Module) -> int:
    """The model's unique parameters, an int8 matrix's rows counted as the weights they stand for (they are
    buffers, which a count of `parameters()` misses: SmolLM2's int8 run has 35,136 float parameters).
    Example: weight_count(quantize_int8(copy.deepcopy(model))) == weight_count(model)"""
    unique = {id(p): p.numel() for p in model.parameters()}
    rows = [m.qweight for m in model.modules() if isinstance(m, Int8Matrix)]
    unique.update({id(q): q.numel() for q in rows})
    return sum(unique.values())


def quantize_int8(model: nn.Module, *, layout_only: bool = False) -> nn.Module:
    """Replace, in place, every nn.Linear of `model` by a QuantizedLinear and the token embedding by a
    QuantizedEmbedding when the LM head is tied to it (else the head's own matrix becomes `head.int8`); returns
    the model. layout_only: the int8 modules are left empty, for a quantized checkpoint to be loaded into.
    Example: model = quantize_int8(load_run("runs/smollm2")[0]); model(ids)"""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                new = QuantizedLinear.layout_of(child)
                if not layout_only:
                    new.set_from(child.weight)
                    if child.bias is not None:
                        new.bias.data.copy_(child.bias.detach())   # type: ignore[union-attr]
                setattr(parent, name, new)
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "tied"):          # not a decoder LM: its Linears only
        return model
    if head.tied:
        embed = head.tied[0]
        new_embed = QuantizedEmbedding(embed.num_embeddings, embed.embedding_dim)
        if not layout_only:
            new_embed.set_from(embed.weight)
        model.embed = new_embed
        head.tied = (new_embed,)
    elif head.weight is not None:
        matrix = Int8Matrix(*head.weight.shape)
        if not layout_only:
            matrix.set_from(head.weight)
        head.weight = None
        head.int8 = matrix
    return model


# --------------------------------------------------------------------------- decode kernels
@dataclass(frozen=True)
class Int8Kernel:
    """How a decode step multiplies by int8 rows: `prepare(q, scale, bias)` once per module group (cached while
    the weights are unchanged), `run(x, prepared)` per step; `available()` says whether this torch build has it.
    `rows_together`: the kernel quantizes the activations of a call's rows with one scale, so a row's result depends
    on the other rows of the call (a forward over k tokens is not k one-token steps)."""

    prepare: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], Any]
    run: Callable[[torch.Tensor, Any], torch.Tensor]
    available: Callable[[], bool]
    rows_together: bool = False


KERNELS: Registry[Int8Kernel] = Registry("int8 kernel")


def _dequantized(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    return dequantize_rows(q, scale).t().contiguous(), bias                 # (i, o): F.linear's reference


def _run_dequantized(x: torch.Tensor, prepared) -> torch.Tensor:
    w_t, bias = prepared
    out = x @ w_t
    return out if bias is None else out + bias


KERNELS.register("dequantize")(Int8Kernel(_dequantized, _run_dequantized, lambda: True))


def _fbgemm_prepare(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    with warnings.catch_warnings():          # torch 2.13 marks quantized tensors deprecated; the kernel is not
        warnings.simplefilter("ignore")
        zeros = torch.zeros(q.shape[0], dtype=torch.long)
        w = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
        return torch.ops.quantized.linear_prepack(w, None if bias is None else bias.float())


def _fbgemm_run(x: torch.Tensor, prepared) -> torch.Tensor:
    # activations quantized to uint8 on the fly, one scale for the call's rows; full range (reduce_range=False:
    # half the rounding error, and the AVX-512 VNNI path has no 16-bit saturation to avoid)
    out = torch.ops.quantized.linear_dynamic(x.float(), prepared, False)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


KERNELS.register("fbgemm")(Int8Kernel(_fbgemm_prepare, _fbgemm_run, _has_fbgemm, rows_together=True))

PREFERRED = ("fbgemm", "dequantize")   # fastest first, by the measurement in this module's docstring


def decode_kernel(name: str | None = None) -> str:
    """The kernel a decode step uses: `name` if given (KERNELS), else the first available of PREFERRED."""
    if name is not None:
        KERNELS.get(name)
        return name
    return next(n for n in PREFERRED if KERNELS.get(n).available())


def rows_quantized_together(model: nn.Module) -> bool:
    """True when `model` decodes through int8 layers whose kernel quantizes a call's rows together (fbgemm): its
    logits for several tokens in one forward then differ from one token at a time, so whatever relies on the two
    being equal (speculative decoding's check) cannot use it.
    Example: rows_quantized_together(quantize_int8(model)) -> True where torch has fbgemm"""
    return KERNELS.get(decode_kernel()).rows_together and any(map(is_quantized, model.modules()))


class Int8Packed:
    """Some int8 modules' rows concatenated and prepared by one kernel: one call for q/k/v (or gate/up), then
    split by `sizes` like nn/fused's float packs."""

    __slots__ = ("kernel", "prepared", "sizes", "bias", "versions", "sources")

    def __init__(self, kernel: str, modules: tuple[Int8Matrix, ...], bias: torch.Tensor | None):
        self.kernel = KERNELS.get(kernel)
        self.sources = [t for m in modules for t in (m.qweight, m.scale)]
        self.versions = [t._version for t in self.sources]
        q = torch.cat([m.qweight for m in modules])                       # (sum of outs, i)
        scale = torch.cat([m.scale for m in modules])                     # (sum of outs,)
        self.prepared = self.kernel.prepare(q, scale, bias)
        self.sizes = [m.out_features for m in modules]
        self.bias = None              # the kernel adds it

    def matmul(self, x: torch.Tensor) -> torch.Tensor:                   # (..., i) -> (..., sum of outs)
        return self.kernel.run(x, self.prepared)

    def fresh(self, modules: tuple[Int8Matrix, ...]) -> bool:
        sources = [t for m in modules for t in (m.qweight, m.scale)]
        return (len(sources) == len(self.sources) and all(a is b for a, b in zip(sources, self.sources))
                and [t._version for t in sources] == self.versions)


def int8_pack(modules: tuple[Int8Matrix, ...], bias: list[torch.Tensor] | None = None,
              kernel: str | None = None) -> Int8Packed | None:
    """The decode form of some int8 modules of the same input (None when some have a bias and some not), built
    now; a model's nn/fused.DecodePlan keeps it while their int8 tensors are unchanged (`Int8Packed.fresh`).
    Example: pack = int8_pack((attn.q_proj, attn.k_proj, attn.v_proj)); q, k, v = pack.matmul(x).split(...)"""
    biases = [b for b in (bias if bias is not None else [getattr(m, "bias", None) for m in modules]) if b is not None]
    if biases and len(biases) != len(modules):
        return None
    with torch.no_grad():
        return Int8Packed(decode_kernel(kernel), modules, torch.cat([b.detach() for b in biases]) if biases else None)
