"""int8 weights: the quantization math against hand-computed cases, the decode kernel against the dequantize-matmul
reference, a quantized model decoding as its reference forward, and `archlab quantize` on the fixture run."""
from __future__ import annotations

import contextlib
import copy
import io
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import archlab
from archlab.nn import quantize as qm
from archlab.nn.fused import DecodePlan
from archlab.nn.int8 import KERNELS, QuantizedLinear, int8_pack, quantize_int8

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_v1"


def test_quantize_rows_by_hand():
    w = torch.tensor([[1.27, -0.635, 0.0], [0.0, 0.0, 0.0], [-2.54, 1.0, 0.02]])
    q, s = qm.quantize_rows(w)
    torch.testing.assert_close(s, torch.tensor([0.01, 1.0, 0.02]))          # max|row| / 127; a zero row: 1
    assert q.dtype == torch.int8
    assert q.tolist() == [[127, -64, 0], [0, 0, 0], [-127, 50, 1]]         # round half to even: -63.5 -> -64
    assert (qm.dequantize_rows(q, s) - w).abs().max() <= s.max() / 2 + 1e-7


def test_per_tensor_grid_is_coarsened_by_one_outlier_and_per_token_is_not():
    x = torch.tensor([[100.0, 0.3, -0.2], [0.3, -0.2, 0.1]])
    tensor, token = qm.fake_quant_per_tensor(x), qm.fake_quant_per_token(x)
    assert tensor[1].tolist() == [0.0, 0.0, 0.0]                 # |x| < half a step of 100/127: all lost
    assert tensor[0, 0] == pytest.approx(100.0)
    torch.testing.assert_close(token[1], x[1], atol=0.3 / 254 + 1e-7, rtol=0)


def test_outlier_split_keeps_outlier_columns_exact():
    torch.manual_seed(0)
    w, x = torch.randn(8, 6), torch.randn(4, 6)
    x[:, 2] *= 50                                                           # one outlier feature
    exact = F.linear(x, w)
    split = qm.outlier_split_linear(x, w, threshold=6.0)
    w8a8 = qm.w8a8_linear(x, w)
    assert (split - exact).abs().max() < 0.2 * (w8a8 - exact).abs().max()
    torch.testing.assert_close(qm.outlier_split_linear(x, w, threshold=0.0), exact)   # every column in float


@pytest.mark.parametrize("kernel", [k for k in KERNELS.names() if KERNELS.get(k).available()])
@pytest.mark.parametrize("rows", [1, 8])
def test_decode_kernel_equals_the_dequantize_reference(kernel, rows):
    torch.manual_seed(0)
    linears = [torch.nn.Linear(64, n, bias=True) for n in (48, 16, 16)]
    quant = tuple(quantize_int8(torch.nn.Sequential(lin))[0] for lin in linears)
    x = torch.randn(rows, 64)
    pack = int8_pack(quant, kernel=kernel)
    got = pack.matmul(x).split(pack.sizes, dim=-1)
    for module, y in zip(quant, got):
        ref = module(x)                                                     # dequantize-matmul
        # dynamic int8 activations: error <= |x| |w| / 127 per term, far below that on random data
        assert (y - ref).abs().max() <= 0.02 * ref.abs().max(), kernel


def test_pack_is_kept_by_the_plan_and_rebuilt_when_the_int8_weights_change():
    lin = quantize_int8(torch.nn.Sequential(torch.nn.Linear(8, 4)))[0]
    plan = DecodePlan()
    first = plan.int8((lin,))
    assert plan.int8((lin,)) is first
    assert DecodePlan().int8((lin,)) is not first          # per plan: another model's plan builds its own
    lin.qweight.add_(1)
    assert plan.int8((lin,)) is not first


@pytest.mark.parametrize("tie", [True, False])
def test_quantized_model_decodes_as_its_reference_forward(tie):
    torch.manual_seed(0)
    cfg = archlab.presets.tiny("llama2-7b").with_overrides({"tie_embeddings": tie})
    model = archlab.TransformerLM(cfg).eval()
    q = quantize_int8(copy.deepcopy(model)).eval()
    assert not any(type(m) is torch.nn.Linear for m in q.modules())
    assert ("embed.qweight" in q.state_dict()) == tie and ("lm_head.int8.qweight" in q.state_dict()) != tie
    ids = torch.randint(0, cfg.vocab_size, (1, 10))
    with torch.no_grad():
        ref, float_logits = q(ids), model(ids)
    assert (ref - float_logits).abs().max() < 0.05 * float_logits.abs().max()
    cached = archlab.generate(q, ids[0, :4], max_new_tokens=6, temperature=0)          # the int8 decode kernel
    uncached = archlab.generate(q, ids[0, :4], max_new_tokens=6, temperature=0, use_cache=False)   # reference
    assert torch.equal(cached, uncached)


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The command in this process (its one error path included): stdout, stderr and the exit status."""
    from archlab.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8")
    text = root / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = root / "run-int8"
    proc = _cli("quantize", str(FIXTURE), "--weights", "int8", "--out", str(out), "--text", str(text),
                "--seq-len", "32", "--max-tokens", "256")
    assert proc.returncode == 0, proc.stderr
    return out, text, proc.stdout


def test_quantize_prints_both_perplexities_and_the_run_loads_with_int8_layers(int8_run):
    from archlab.eval.perplexity import perplexity
    from archlab.runs.model_folder import load_model_and_tokenizer, load_run

    out, text, stdout = int8_run
    assert "float" in stdout and "int8" in stdout and "max |logit difference|" in stdout
    model, tok = load_model_and_tokenizer(out)
    assert isinstance(model.blocks[0].attn.q_proj, QuantizedLinear)
    base, _ = load_run(FIXTURE)
    ids = torch.tensor(tok.encode(text.read_text()))[:257]
    ppl_int8, ppl_float = perplexity(model, ids, 32), perplexity(base, ids, 32)
    assert f"{ppl_int8:.3f}" in stdout and f"{ppl_float:.3f}" in stdout        # what it printed is what it wrote
    gen = _cli("generate", str(out), "--prompt", "the quick", "--max-new-tokens", "5", "--temperature", "0")
    assert gen.returncode == 0, gen.stderr


def test_commands_that_train_or_export_refuse_a_quantized_run(int8_run, tmp_path):
    out = int8_run[0]
    for args in (["convert", "--to-hf", str(out), "--out", str(tmp_path / "hf")],
                 ["convert", "--to-gguf", str(out), "--out", str(tmp_path / "gguf")],
                 ["quantize", str(out), "--weights", "int8", "--out", str(tmp_path / "again"), "--text", "x"],
                 ["finetune", str(out), "--data", str(FIXTURE / "config.yaml"), "--out", str(tmp_path / "ft")]):
        proc = _cli(*args)
        assert proc.returncode == 2 and "int8 weights" in proc.stderr and "Traceback" not in proc.stderr, args
        assert len(proc.stderr.strip().splitlines()) == 1
    from archlab.errors import UserError
    from archlab.training.init_from import read_init_source
    with pytest.raises(UserError, match="int8 weights"):
        read_init_source(str(out))
    assert not any((tmp_path / name).exists() for name in ("hf", "gguf", "again", "ft"))


def test_quantize_refuses_an_existing_out_before_loading(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    proc = _cli("quantize", str(FIXTURE), "--weights", "int8", "--out", str(tmp_path / "taken"), "--text",
                str(FIXTURE / "config.yaml"))
    assert proc.returncode == 2 and (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    shutil.rmtree(tmp_path / "taken")


def test_quantize_refuses_an_out_that_is_its_text_even_with_overwrite(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 10)
    proc = _cli("quantize", str(FIXTURE), "--weights", "int8", "--out", str(text), "--text", str(text),
                "--overwrite")
    assert proc.returncode == 2 and "is the input" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert text.read_text().startswith("the quick brown fox")


@pytest.mark.parametrize("tie", [True, False])
def test_an_int8_model_counts_the_weights_its_rows_stand_for(tie):
    """The real-model lab recorded SmolLM2's int8 run as 35,136 parameters (its norms and biases): int8 rows are
    buffers, which a count of parameters() misses."""
    from archlab.nn.int8 import weight_count

    model = archlab.TransformerLM(archlab.presets.tiny("llama3-8b").with_overrides({"tie_embeddings": tie})).eval()
    floats = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert weight_count(model) == floats == archlab.accounting.param_count(model.config)
    assert weight_count(quantize_int8(copy.deepcopy(model))) == floats
