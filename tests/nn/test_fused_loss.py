"""The chunked head + cross-entropy equals the plain logits path: values and gradients."""
import pytest
import torch
import torch.nn.functional as F

from archlab.eval.evaluate import autocast
from archlab.models.decoder import TransformerLM
from archlab.models.presets import tiny
from archlab.nn.fused_loss import linear_cross_entropy


def _plain(hidden, weight, targets, z_coef, ignore_index=-100, bias=None, softcap=None):
    logits = (hidden @ weight.t()).float()                                   # (n, v)
    if bias is not None:
        logits = logits + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ce = F.cross_entropy(logits, targets, ignore_index=ignore_index)
    valid = targets != ignore_index
    z = z_coef * torch.logsumexp(logits, -1)[valid].square().mean()
    return ce + z, ce, z


@pytest.mark.parametrize("chunk", [7, 64, 1000])       # uneven last chunk, several, one
@pytest.mark.parametrize("z_coef", [0.0, 1e-2])
@pytest.mark.parametrize("head", ["plain", "bias", "softcap", "bias+softcap"])
def test_fused_loss_and_grads_equal_plain_path(chunk, z_coef, head):
    torch.manual_seed(0)
    n, d, v = 50, 16, 97
    hidden = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, d, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, requires_grad=True) if "bias" in head else None
    softcap = 3.0 if "softcap" in head else None                             # binding: |logits| ~ 4
    targets = torch.randint(0, v, (n,))
    targets[::5] = -100                                                      # ignored rows
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    total, ce, z = linear_cross_entropy(hidden, weight, targets, z_loss=z_coef, chunk=chunk,
                                        bias=bias, softcap=softcap)
    got = torch.autograd.grad(3.0 * total, leaves)
    ref_total, ref_ce, ref_z = _plain(hidden, weight, targets, z_coef, bias=bias, softcap=softcap)
    want = torch.autograd.grad(3.0 * ref_total, leaves)
    torch.testing.assert_close(ce.double(), ref_ce.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z.double(), ref_z.double(), rtol=1e-6, atol=1e-9)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    assert not ce.requires_grad and total.requires_grad


def test_fused_loss_without_grad_and_with_all_rows_ignored():
    hidden, weight = torch.randn(8, 4), torch.randn(11, 4)
    with torch.no_grad():
        total, ce, _ = linear_cross_entropy(hidden, weight, torch.randint(0, 11, (8,)))
    ref = F.cross_entropy(hidden @ weight.t(), torch.randint(0, 11, (8,)).fill_(0))
    assert torch.isfinite(total) and ce > 0 and ref > 0
    total, ce, _ = linear_cross_entropy(hidden, weight, torch.full((8,), -100))
    assert ce.item() == 0.0                                                 # nothing to predict


def test_fused_loss_under_bf16_autocast_matches_plain_bf16_head():
    torch.manual_seed(0)
    hidden = torch.randn(40, 32, requires_grad=True)
    weight = (0.1 * torch.randn(300, 32)).requires_grad_()
    targets = torch.randint(0, 300, (40,))
    cpu = torch.device("cpu")
    with autocast(cpu, "bfloat16"):
        total, _, _ = linear_cross_entropy(hidden, weight, targets, chunk=16)
    total.backward()
    got = hidden.grad.clone(), weight.grad.clone()
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    hidden.grad = weight.grad = None
    with autocast(cpu, "bfloat16"):
        logits = F.linear(hidden, weight)                                    # bf16, as the plain head
    ref = F.cross_entropy(logits.float(), targets)
    ref.backward()
    torch.testing.assert_close(total, ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got[0], hidden.grad, rtol=0.05, atol=2e-3)
    torch.testing.assert_close(got[1], weight.grad, rtol=0.05, atol=2e-3)


@pytest.mark.parametrize("name", ["llama3-8b", "gpt2", "command-a", "gemma2-2b", "mixtral-8x7b"])
def test_model_loss_equals_loss_of_its_logits(name):
    """loss() (fused unless the head soft-caps) == cross-entropy of forward()'s logits; z-loss on."""
    cfg = tiny(name).with_overrides({"z_loss": 1e-3})
    model = TransformerLM(cfg).eval()                                        # no dropout: same draws
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model.loss(ids[:, :-1], ids[:, 1:])
    out.total.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model.loss_from_logits(model(ids[:, :-1]), ids[:, 1:])
    ref.total.backward()
    torch.testing.assert_close(out.ce, ref.ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.z_loss, ref.z_loss, rtol=1e-5, atol=1e-8)
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6)
    assert model(ids[:, :-1], targets=ids[:, 1:]).ce == out.ce              # forward(targets=) = loss()
