"""The hand-written backward passes of nn/fused.py equal autograd through the composite formulas."""
import pytest
import torch

from archlab.nn.fused import materialized, project, rms_norm, rope_half


def _rms_norm_reference(x, w, eps):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.to(xf.dtype)).to(x.dtype)


def _rope_reference(x, cos, sin):  # (x1 cos - x2 sin, x2 cos + x1 sin), written out by halves
    h = x.shape[-1] // 2
    x1, x2, c, s = x[..., :h], x[..., h:], cos[..., :h], sin[..., h:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@pytest.mark.parametrize("x_shape, w_shape", [((3, 7, 16), (16,)),
                                              ((2, 3, 4, 8), (3, 1, 8))])   # a weight per head (Cohere QK-norm)
def test_rms_norm_values_and_gradients_match_autograd(x_shape, w_shape):
    torch.manual_seed(0)
    x = torch.randn(x_shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn(w_shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-5), (x, w))
    g = torch.randn(x_shape, dtype=torch.float64)
    rms_norm(x, w, 1e-5).backward(g)
    got = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    _rms_norm_reference(x, w, 1e-5).backward(g)
    torch.testing.assert_close(got[0], x.grad)
    torch.testing.assert_close(got[1], w.grad)


def test_rms_norm_keeps_input_dtype_and_float32_weight_grads():
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    y = rms_norm(x, w, 1e-6)
    y.sum().backward()
    assert y.dtype == x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    torch.testing.assert_close(y, _rms_norm_reference(x, w, 1e-6), rtol=0, atol=0)


def test_rms_norm_eps_constants_are_kept_per_value_and_serve_decoding_then_training():
    """eps rides as a cached 0-d tensor (one addcmul, no scalar wrapping): each eps its own, and one first
    made while decoding (inference mode) still works under autograd afterwards."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 1, 16), torch.randn(16)
    for eps in (1e-3, 0.25):                              # values no other test uses: made right here
        with torch.inference_mode():
            decoded = rms_norm(x, w, eps)
        torch.testing.assert_close(decoded, _rms_norm_reference(x, w, eps))
        xg = x.clone().requires_grad_()
        trained = rms_norm(xg, w, eps)
        trained.sum().backward()
        torch.testing.assert_close(trained.detach(), decoded, rtol=0, atol=0)   # the same formula both ways
        assert xg.grad is not None and torch.isfinite(xg.grad).all()


@pytest.mark.parametrize("contiguous", [True, False])
def test_rope_half_values_and_gradients_match_autograd(contiguous):
    torch.manual_seed(0)
    b, h, t, e = 2, 3, 5, 8
    x = torch.randn(b, t, h, e, dtype=torch.float64).transpose(1, 2)   # (b, h, t, e) as attention has it
    x = (x.contiguous() if contiguous else x).requires_grad_()
    angles = torch.randn(1, 1, t, e // 2, dtype=torch.float64)
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)
    assert torch.autograd.gradcheck(lambda a: rope_half(a, cos, sin), (x,))
    torch.testing.assert_close(rope_half(x, cos, sin), _rope_reference(x, cos, sin))
    # a rotation keeps norms: the backward (its transpose) must too
    g = torch.randn(b, h, t, e, dtype=torch.float64)
    (dx,) = torch.autograd.grad(rope_half(x, cos, sin), x, g)
    torch.testing.assert_close(dx.norm(dim=-1), g.norm(dim=-1))



class _CountLinear(torch.overrides.TorchFunctionMode):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            self.calls.append(args[1].shape)
        return func(*args, **(kwargs or {}))


def test_projection_under_autocast_is_one_matmul_equal_to_separate_linears():
    torch.manual_seed(0)
    linears = tuple(torch.nn.Linear(8, n, bias=True) for n in (8, 4, 4))
    x = torch.randn(3, 6, 8, requires_grad=True)                         # 18 tokens >= d
    params = [x] + [p for lin in linears for p in lin.parameters()]
    calls = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with _CountLinear(calls):
            fused = project(x, linears)
        separate = [lin(x) for lin in linears]
    assert len(calls) == 1                                                # one matmul for the three
    got = torch.autograd.grad(sum((o.float() ** 2).sum() for o in fused), params)
    want = torch.autograd.grad(sum((o.float() ** 2).sum() for o in separate), params)
    for a, b in zip(fused, separate):
        torch.testing.assert_close(a, b)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    plain = project(x, linears)                                           # no autocast: one by one
    assert all(torch.equal(a, lin(x)) for a, lin in zip(plain, linears))


def test_materialized_is_the_same_values_as_a_contiguous_view():
    """What a traced step computes into a buffer: eagerly the same values, contiguous, in x's shape or the one asked
    (a matmul's (n, in) rows strided (in, 1), never stride 0 on a size-1 dimension), a view where x is contiguous."""
    x = torch.randn(2, 3, 1, 4)
    y = materialized(x)
    assert torch.equal(y, x) and y.is_contiguous() and y.data_ptr() == x.data_ptr()
    rows = materialized(x[:1, :1], (1, 4))
    assert rows.shape == (1, 4) and rows.stride() == (4, 1) and torch.equal(rows, x[0, 0])
    t = torch.randn(3, 5).t()                                  # not contiguous: copied first
    assert torch.equal(materialized(t), t) and materialized(t).is_contiguous()
