"""LM head + cross-entropy (+ z-loss) in row chunks, never holding the (b*t, v) logits.

The plain path materializes float32 logits, their log-softmax and, in backward, a gradient of the
same size: three (b*t) x v buffers (67 MB each for 2,048 tokens and a 8,192 vocabulary), each a fresh
allocation the allocator maps and faults in again on every step. Here each chunk of rows gets its
logits, its loss terms and at once its gradient (softmax - one_hot, scaled), which goes straight
into dL/dh and dL/dW; backward only scales those by the incoming gradient. The same idea as the
"fused linear cross-entropy" of Liger-Kernel (Hsu et al. 2024, arXiv 2410.10989), written with
torch ops.

Under autocast the two matmuls run in the autocast dtype, like the unfused head; the softmax, the
loss and the gradient accumulation of W are float32.
"""
from __future__ import annotations

import torch

__all__ = ["linear_cross_entropy"]

CPU_CHUNK_BYTES = 8 << 20    # float32 logits per chunk: 256 rows of an 8,192 vocabulary, measured
                             # fastest of 128-1,024 rows on CPU; a small vocabulary gets one chunk
GPU_CHUNK_BYTES = 256 << 20  # on GPU, fewer and larger chunks keep the kernels busy


def chunk_rows(device_type: str, vocab: int) -> int:
    budget = CPU_CHUNK_BYTES if device_type == "cpu" else GPU_CHUNK_BYTES
    return max(64, budget // (4 * vocab))


def _compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index: int, z_coef: float,
                softcap: float | None, chunk: int):
        # hidden (n, d), weight (v, d), bias (v,) | None, targets (n,) -> (total, ce, z) over the
        # rows with a target
        n = hidden.shape[0]
        dtype = _compute_dtype(hidden.dtype, hidden.device)
        h, w = hidden.to(dtype), weight.to(dtype)
        acc = torch.promote_types(dtype, torch.float32)              # softmax dtype: float32 (or 64)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        valid = targets != ignore_index
        count = valid.sum()
        scale = 1.0 / count.clamp(min=1).to(acc)                    # mean over valid rows
        ce_sum = torch.zeros((), dtype=acc, device=hidden.device)
        z_sum = torch.zeros((), dtype=acc, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            hc, tgt, ok = h[rows], targets[rows].clamp(min=0)[:, None], valid[rows]
            logits = (hc @ w.t()).to(acc)                           # (c, v)
            if bias is not None:
                logits += bias.to(acc)
            if softcap is not None:                                 # Gemma 2: cap * tanh(z / cap)
                tanh = logits.div_(softcap).tanh_()
                logits = tanh * softcap
            logp = torch.log_softmax(logits, dim=-1)                # (c, v): one fused kernel per row
            logp_t = logp.gather(1, tgt)[:, 0]                      # (c,) log p(target)
            ce_sum -= torch.where(ok, logp_t, 0.0).sum()
            lse = logits.gather(1, tgt)[:, 0] - logp_t if z_coef else None   # (c,) log Z
            del logits
            if lse is not None:
                z_sum += torch.where(ok, lse.square(), 0.0).sum()
            if not (need_h or need_w or need_b):
                continue
            # d/dlogits of (ce + z lse^2) for row i: a_i softmax_i - b_i one_hot(target_i), with
            # a_i = (1 + 2 z lse_i) / count, b_i = 1 / count (0 on ignored rows)
            b = torch.where(ok, scale, 0.0)[:, None]                # (c, 1)
            a = b * (1.0 + 2.0 * z_coef * lse[:, None]) if lse is not None else b
            probs = logp.exp_()                                     # (c, v) softmax, in place
            if softcap is None and bias is None:
                # the row scales go on the (c, d) sides of the two matmuls, never over (c, v)
                probs = probs.to(dtype)
                if grad_h is not None:                              # (c, d) = (c, v) @ (v, d)
                    grad_h[rows] = ((probs @ w).to(acc) * a - w[tgt[:, 0]].to(acc) * b).to(grad_h.dtype)
                if grad_w is not None:                              # (v, d) += (v, c) @ (c, d)
                    _add_matmul(grad_w, probs.t(), (hc.to(acc) * a).to(dtype))
                    grad_w.index_add_(0, tgt[:, 0], hc.to(acc) * -b)
                continue
            # soft-cap or bias: the (c, v) gradient itself, through d(cap tanh(z / cap))/dz = 1 - tanh^2
            grad = probs.mul_(a).scatter_add_(1, tgt, -b)           # (c, v) dL/dlogits
            if softcap is not None:
                grad.mul_(1.0 - tanh.square_())
            if grad_b is not None:
                grad_b += grad.sum(0)
            grad = grad.to(dtype)
            if grad_h is not None:
                grad_h[rows] = (grad @ w).to(grad_h.dtype)
            if grad_w is not None:
                _add_matmul(grad_w, grad.t(), hc)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = weight.dtype, None if bias is None else bias.dtype
        ce, z = ce_sum * scale, z_coef * z_sum * scale
        ctx.mark_non_differentiable(ce, z)   # the chunks computed d(ce + z): only the sum has a gradient
        return ce + z, ce, z

    @staticmethod
    def backward(ctx, grad_total, _grad_ce, _grad_z):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        g = grad_total                                              # d(outer loss)/d(total), a scalar
        dh = None if grad_h is None else grad_h * g.to(grad_h.dtype)
        dw = None if grad_w is None else (grad_w * g).to(ctx.dtypes[0])
        db = None if grad_b is None else (grad_b * g).to(ctx.dtypes[1])
        return dh, dw, db, None, None, None, None, None


def _add_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b; a bf16 matmul is summed in out's float32."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out += a @ b


def linear_cross_entropy(
    hidden: torch.Tensor,        # (n, d)
    weight: torch.Tensor,        # (v, d), the LM head
    targets: torch.Tensor,       # (n,) int; ignore_index rows count nowhere
    ignore_index: int = -100,
    z_loss: float = 0.0,
    chunk: int | None = None,    # rows per chunk; None: chunk_rows(device type, vocab)
    *,
    bias: torch.Tensor | None = None,     # (v,) logit bias
    softcap: float | None = None,         # logits = softcap * tanh(logits / softcap) (Gemma 2)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total, ce, z): ce = mean cross-entropy of softmax(hidden @ weight.T + bias), soft-capped,
    against targets over the rows whose target is not ignore_index, z = z_loss * mean(log Z)^2 over
    the same rows (PaLM), total = ce + z. Only `total` carries a gradient (ce and z are for logging).

    Example: total, ce, _ = linear_cross_entropy(h.flatten(0, 1), model.lm_head.matrix, y.flatten());
    total.backward()   # what TransformerLM.loss_from_hidden does, with the head's bias and soft-cap
    """
    chunk = chunk or chunk_rows(hidden.device.type, weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, ignore_index, float(z_loss),
                                     softcap, chunk)
