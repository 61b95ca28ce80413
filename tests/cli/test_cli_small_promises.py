"""The CLI's small promises: a misspelt name gets the closest known one, numbers that are never negative are
not printed negative, quantized dtypes do not train, and what a command leaves out it says."""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from archlab.cli import main
from archlab.config import ConfigError
from archlab.models import accounting, presets

RUN_V1 = Path(__file__).parents[1] / "fixtures" / "run_v1"      # byte tokenizer, rope, max_seq_len 64


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


# ---- names ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["inspect", "lama2-7b"], ["train", "--preset", "lama2-7b", "--data", "{tmp}/d",
                                                              "--out", "{tmp}/run"]])
def test_an_unknown_preset_is_named_once_with_the_closest(argv, tmp_path, capsys):
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.count("'lama2-7b'") == 1, err
    assert "unknown preset 'lama2-7b' (did you mean 'llama2-7b'?); known: transformer-2017" in err
    assert not (tmp_path / "run").exists()


def test_an_unknown_config_key_suggests_the_closest_field():
    with pytest.raises(ConfigError, match=r"no field 'n_layerz'; did you mean 'n_layers'\?"):
        presets.tiny("llama2-7b").with_overrides({"n_layerz": 2})
    with pytest.raises(ConfigError, match=r"no field 'n_headz'; did you mean 'n_heads'\?"):
        presets.tiny("llama2-7b").with_overrides({"attention.n_headz": 2})
    with pytest.raises(ConfigError, match=r"no field 'zzz'\)$"):
        presets.tiny("llama2-7b").with_overrides({"zzz": 2})


def test_a_training_setting_without_its_prefix_points_to_it(tmp_path, capsys):
    assert main(["train", "--preset", "tiny:llama2-7b", "--data", str(tmp_path / "d"), "--out", str(tmp_path / "r"),
                 "--set", "lr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "'lr' is a training setting, not a model field: --set train.lr=1e-3" in err
    # a name both configs have stays the model's: seed is ModelConfig.seed (the init)
    from archlab.cli.train import parse_sets
    assert parse_sets(["seed=3"]) == ({"seed": "3"}, {})


def test_version_is_the_package_version(capsys):
    import tomllib

    import archlab

    assert _exit_code(["--version"]) == 0
    assert capsys.readouterr().out == f"archlab {archlab.__version__}\n"
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == archlab.__version__


# ---- numbers ----------------------------------------------------------------------------------------
def test_mean_kl_is_torch_kl_div_and_never_negative():
    from archlab.interop.convert import mean_kl

    gen = torch.Generator().manual_seed(0)
    p, q = torch.randn(2, 8, 50, generator=gen), torch.randn(2, 8, 50, generator=gen)
    reference = F.kl_div(q.log_softmax(-1), p.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    assert mean_kl(p, q) == pytest.approx(float(reference), rel=1e-5)
    # near-identical logits: rounding makes the unclamped sums negative (their mean -8.4e-9 here); KL never is
    gen = torch.Generator().manual_seed(0)
    b = torch.randn(2, 32, 300, generator=gen) * 5
    a = b + 1e-6 * torch.randn(2, 32, 300, generator=gen)
    log_p, log_q = b.log_softmax(-1), a.log_softmax(-1)
    naive = (log_p.exp() * (log_p - log_q)).sum(-1)
    assert float(naive.mean()) < 0 and float(naive.min()) < 0
    assert 0 <= mean_kl(b, a) < 1e-6


def test_int4_sizes_weights_and_cache_but_training_counts_bfloat16():
    from archlab.cli.presets import inspect_rows

    cfg = presets.get("llama2-7b")
    rows = {label: value for label, value, _ in inspect_rows(cfg, 4096, 1, "int4")}
    n = accounting.param_count(cfg)
    assert rows["weights (int4)"] == n * 0.5
    assert rows["KV cache / token (int4)"] == accounting.kv_bytes_per_token(cfg, "bfloat16") / 4
    bf16 = accounting.training_memory(cfg, 1, 4096, "bfloat16")
    assert rows["  grads"] == bf16["grads"] == 2 * n
    assert rows["  activations"] == bf16["activations"]
    with pytest.raises(ConfigError, match="gradients and activations are not kept in int4"):
        accounting.training_memory(cfg, 1, 4096, "int4")
    assert "weights (bfloat16)" not in {label for label, _, _ in inspect_rows(cfg, 4096, 1, "bfloat16")}


@pytest.mark.parametrize("name", ["gopher-280b", "chinchilla-70b"])
def test_deepmind_published_sizes_are_ours_plus_the_position_projection(name):
    """13*L*d^2: Transformer-XL's per-layer W_k,R (d x heads*kv) is what the published count has and ours not."""
    info, cfg = presets.info(name), presets.get(name)
    extra = cfg.n_layers * cfg.d_model * cfg.attention.n_heads * cfg.head_dim
    assert abs(accounting.param_count(cfg) / info.published_params - 1) > 0.05           # ours alone: off
    assert (accounting.param_count(cfg) + extra) / info.published_params == pytest.approx(1, abs=0.006)
    assert "W_k,R" in info.approximation


# ---- what a command leaves out, it says -------------------------------------------------------------
def test_diagnose_says_when_it_cuts_the_text(tmp_path, capsys):
    text = tmp_path / "long.txt"
    text.write_text("to be or not to be\n" * 20)                 # 380 bytes: past the model's 64 positions
    assert main(["diagnose", str(RUN_V1), "--text", str(text), "--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "is longer than 64 tokens: diagnosing its first 64 (the model's context, max_seq_len 64)" in out
    assert main(["diagnose", str(RUN_V1), "--text", str(text), "--max-tokens", "8", "--out",
                 str(tmp_path / "d2")]) == 0
    assert "diagnosing its first 8 (--max-tokens 8)" in capsys.readouterr().out
    text.write_text("to be")
    assert main(["diagnose", str(RUN_V1), "--text", str(text), "--out", str(tmp_path / "d3")]) == 0
    assert "longer than" not in capsys.readouterr().out


def test_training_past_max_seq_len_with_computed_positions_says_so(tmp_path):
    from test_checkpoint import make_data, tiny_model

    from archlab.training.trainer import TrainConfig, train

    data = make_data(tmp_path / "data", n_docs=8, words=60)
    cfg = TrainConfig(batch_size=2, seq_len=32, budget=1, warmup_steps=0, eval_batches=1, sample_every=-1)
    model = dataclasses.replace(tiny_model(position={"kind": "rope"}), max_seq_len=16)
    with pytest.warns(UserWarning, match=r"train.seq_len=32 is past max_seq_len=16: position.kind=rope trains"):
        train(model, cfg, data, tmp_path / "run", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # within the context: no warning
        train(model, dataclasses.replace(cfg, seq_len=16), data, tmp_path / "run2", progress=False)


def test_convert_to_hf_says_the_byte_tokenizer_has_no_hf_file(tmp_path, capsys):
    assert main(["convert", "--to-hf", str(RUN_V1), "--out", str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert err.startswith(f"note: {tmp_path / 'hf'} holds no tokenizer: the run's tokenizer is archlab's byte")
    assert "token id = byte value, 256 = <|endoftext|>" in err


def test_lab_workers_print_warnings_as_one_line(monkeypatch):
    """A worker process does not inherit the CLI's warning format: run_job sets it, naming the run."""
    from archlab.lab import worker

    seen = []

    def fake_train_and_measure(*args):
        seen.append(warnings.formatwarning("val split too short", UserWarning, "/x/trainer.py", 187))
        return "row"
    monkeypatch.setattr(worker, "train_and_measure", fake_train_and_measure)
    run = SimpleNamespace(variant=SimpleNamespace(name="norm=rmsnorm"), seed=1)
    job = SimpleNamespace(threads=0, suite=SimpleNamespace(runs="train"), run=run, data=None, record=None,
                          train_fn=None, measure=False)
    before = warnings.formatwarning
    assert worker.run_job(job) == "row"
    assert seen == ["archlab ablate: norm=rmsnorm/seed1: warning: val split too short\n"]
    assert warnings.formatwarning is before
