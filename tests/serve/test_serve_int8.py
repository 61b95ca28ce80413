"""An int8 run served with batching: its kernel (fbgemm) quantizes a forward's rows together, so the server warns."""
from __future__ import annotations

import pytest
from test_serve_cache_size import _folder

from archlab.cli import main
from archlab.nn.int8 import KERNELS, decode_kernel

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8serve")
    (root / "float").mkdir()
    _folder(root / "float")
    (root / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 8)
    assert main(["quantize", str(root / "float"), "--weights", "int8", "--out", str(root / "int8"),
                 "--text", str(root / "text.txt"), "--seq-len", "32"]) == 0
    return root


def _serve(root, monkeypatch, capsys, *args):
    from archlab.serve.server import Server
    monkeypatch.setattr(Server, "run", lambda self: None)
    capsys.readouterr()
    assert main(["serve", str(root), "--port", "0", *args]) == 0
    return capsys.readouterr().err


def test_an_int8_run_served_with_batching_warns_that_answers_depend_on_the_batch(runs, monkeypatch, capsys):
    if not KERNELS.get(decode_kernel()).rows_together:
        pytest.skip("this torch's int8 kernel quantizes each row alone")
    err = _serve(runs / "int8", monkeypatch, capsys)
    assert "int8 layers quantize the activations of a forward's rows with one scale" in err
    assert "--max-batch 1 --no-prefix-cache" in err
    assert "int8" in _serve(runs / "int8", monkeypatch, capsys, "--max-batch", "1")    # the prefix cache too
    assert "int8" not in _serve(runs / "int8", monkeypatch, capsys, "--max-batch", "1", "--no-prefix-cache")
    assert "int8" not in _serve(runs / "float", monkeypatch, capsys)


def test_batched_int8_answers_can_differ_from_alone_which_is_why_it_warns(runs):
    """What the warning says, shown: one fbgemm linear over a batch gives a row other values than over that row
    alone (one activation scale over the rows), where the float linear does not."""
    import torch

    from archlab.nn.int8 import is_quantized
    from archlab.runs.model_folder import load_model_and_tokenizer
    if not KERNELS.get(decode_kernel()).rows_together:
        pytest.skip("this torch's int8 kernel quantizes each row alone")
    model, _ = load_model_and_tokenizer(runs / "int8", "cpu")
    layer = next(m for m in model.modules() if is_quantized(m) and hasattr(m, "in_features"))
    x = torch.randn(2, 1, layer.in_features) * torch.tensor([1.0, 50.0]).view(2, 1, 1)   # a loud row beside a quiet one
    with torch.no_grad():
        assert not torch.equal(layer(x)[:1], layer(x[:1]))
