"""train.dtype "auto": bf16 autocast where the hardware has bf16 matmul units, float32 where it would
be emulated; a warning that names the cost when bf16 is asked for on such hardware."""
from __future__ import annotations

import json
import os
import random
import warnings

import pytest
import torch
import yaml

from archlab.config import ConfigError, ModelConfig
from archlab.data.prepare import prepare
from archlab.models.decoder import TransformerLM
from archlab.training import precision
from archlab.training.precision import autocast, bf16_warning, has_native_bf16, resolve_dtype
from archlab.training.trainer import TrainConfig, train

CPU = torch.device("cpu")


@pytest.fixture
def native(monkeypatch):
    """Pretend the CPU does (True: bf16 units, bf16 matmuls measured 2x float32) or does not (False) have
    bf16 matmul units."""
    def set_native(value: bool) -> None:
        monkeypatch.setattr(precision, "has_native_bf16", lambda device: value)
        monkeypatch.setattr(precision, "measured_bf16_speedup", lambda: 2.0 if value else 0.02)
    return set_native


def test_cpu_probe_agrees_with_the_cpu_flags_and_meta_has_none():
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else None
    if flags is not None:
        assert has_native_bf16(CPU) == ("avx512_bf16" in flags or "amx_bf16" in flags)
    assert has_native_bf16("meta") is False


@pytest.mark.parametrize("has_bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_picks_bf16_only_where_native(native, has_bf16, expected):
    native(has_bf16)
    assert resolve_dtype("auto", CPU) == expected
    assert resolve_dtype("float32", CPU) == "float32"       # explicit choices are kept either way
    assert resolve_dtype("bfloat16", CPU) == "bfloat16"


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16", CPU)
    with pytest.raises(ConfigError, match="train.dtype='float16'"):
        TrainConfig(dtype="float16")
    assert TrainConfig(dtype="auto").dtype == "auto"


def test_warning_only_for_explicit_bf16_on_emulating_hardware(native):
    native(False)
    message = bf16_warning("bfloat16", CPU)
    assert message and "train.dtype=bfloat16" in message and "emulated" in message
    assert bf16_warning("auto", CPU) is None and bf16_warning("float32", CPU) is None
    native(True)
    assert bf16_warning("bfloat16", CPU) is None


@pytest.mark.parametrize("has_bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_autocast_auto_runs_matmuls_in_the_resolved_type(native, has_bf16, expected):
    native(has_bf16)
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with autocast(CPU, "auto"):
        assert (a @ b).dtype == expected
    with autocast(CPU, "float32"):
        assert (a @ b).dtype == torch.float32


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    rng = random.Random(0)
    docs = [" ".join(rng.choice(["to", "be", "or", "not", "that", "is"]) for _ in range(150)) for _ in range(20)]
    path = tmp_path_factory.mktemp("data") / "d"
    prepare(docs, "bytes", path, num_workers=0, progress=False)
    return path


def _tiny() -> ModelConfig:
    return ModelConfig(vocab_size=257, d_model=32, n_layers=1, max_seq_len=32, attention={"n_heads": 2})


def _train(data_dir, out, dtype, progress=False):
    cfg = TrainConfig(batch_size=2, seq_len=16, warmup_steps=1, eval_batches=1, sample_every=-1, budget=2,
                      eval_every=2, checkpoint_every=2, dtype=dtype)
    return train(_tiny(), cfg, data_dir, out, progress=progress)


@pytest.mark.parametrize("has_bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_train_with_auto_runs_the_resolved_type_and_keeps_auto_in_the_run_config(
        native, data_dir, tmp_path, capsys, has_bf16, expected):
    native(has_bf16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)      # auto never warns
        _train(data_dir, tmp_path / "run", "auto", progress=True)
    assert f"device cpu {expected};" in capsys.readouterr().err   # the plan printed before training
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"]["dtype"] == "auto"              # resolved again where the run resumes


def test_train_in_bf16_on_emulating_hardware_warns_and_still_trains(native, data_dir, tmp_path):
    native(False)
    with pytest.warns(UserWarning, match="without bf16 matrix units"):
        result = _train(data_dir, tmp_path / "run", "bfloat16")
    assert result.steps == 2


def test_auto_under_native_bf16_runs_the_model_in_bf16(native):
    """The step's matmuls run in bf16 when auto resolves to it (checked on the model's logits dtype)."""
    native(True)
    model = TransformerLM(_tiny())
    x = torch.randint(0, 257, (1, 8))
    with autocast(CPU, resolve_dtype("auto", CPU)):
        assert model(x).dtype == torch.bfloat16


@pytest.mark.parametrize("speedup, expected", [(2.4, "bfloat16"), (0.52, "float32")])
def test_auto_on_a_bf16_cpu_follows_the_measured_matmul_not_the_flags(monkeypatch, speedup, expected):
    """An EPYC with AVX512-BF16 ran bf16 2.4x faster; a Xeon with the same flag at 0.52x: flags alone mislead."""
    monkeypatch.setattr(precision, "has_native_bf16", lambda device: True)
    monkeypatch.setattr(precision, "measured_bf16_speedup", lambda: speedup)
    dtype, reason = precision.auto_dtype(CPU)
    assert dtype == expected and f"{speedup:.2f}x" in reason


def test_the_measurement_is_cached_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("ARCHLAB_CACHE", str(tmp_path))
    calls = []

    def fake_seconds(dtype, size, seconds):
        calls.append(dtype)
        return 1.0 if dtype == torch.float32 else 0.5
    monkeypatch.setattr(precision, "_matmul_seconds", fake_seconds)
    assert precision.measured_bf16_speedup() == 2.0
    assert precision.measured_bf16_speedup() == 2.0
    assert len(calls) == 2                                   # measured once (fp32 + bf16), then read
    cached = json.loads((tmp_path / "precision.json").read_text())
    (key, value), = cached.items()
    assert value == 2.0 and torch.__version__ in key and precision.cpu_model() in key


def test_a_resume_keeps_the_dtype_the_run_began_with(native, data_dir, tmp_path):
    native(True)
    cfg = TrainConfig(batch_size=2, seq_len=16, warmup_steps=1, eval_batches=1, sample_every=-1, budget=2,
                      eval_every=2, checkpoint_every=2, dtype="auto")
    train(_tiny(), cfg, data_dir, tmp_path / "run", progress=False)
    recorded = json.loads((tmp_path / "run" / "precision.json").read_text())
    assert recorded["requested"] == "auto" and recorded["dtype"] == "bfloat16" and "2.00x" in recorded["reason"]
    native(False)                                            # the measurement would now say float32
    train(_tiny(), cfg.with_overrides({"budget": 3}), data_dir, tmp_path / "run", resume=True, progress=False)
    assert json.loads((tmp_path / "run" / "precision.json").read_text())["dtype"] == "bfloat16"
