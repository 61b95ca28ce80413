"""Run folders hold data only: no pickle runs on load, files are checksummed, damage is skipped."""
from __future__ import annotations

import ast
import json
import os
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from test_checkpoint import make_data, tiny_model

from archlab.models.decoder import TransformerLM
from archlab.runs.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_meta,
    resumable_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from archlab.runs.statefile import load_state, save_state
from archlab.training.rng import rng_state
from archlab.training.trainer import TrainConfig, read_metrics, train

SRC = Path(__file__).resolve().parents[2] / "src"


# ---- the guard: nothing under src/ can unpickle ------------------------------------------------
def _unsafe_calls(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
        if name.endswith("torch.load") and kw.get("weights_only") != "True":
            found.append(f"{name} without weights_only=True")
        if name.split(".")[-1] in ("load", "loads", "Unpickler") and name.split(".")[0] in ("pickle", "cPickle",
                                                                                             "dill", "cloudpickle"):
            found.append(name)
        if name.endswith("np.load") or name.endswith("numpy.load"):
            if kw.get("allow_pickle") == "True":
                found.append(f"{name}(allow_pickle=True)")
        if name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load") or name.endswith("yaml.load_all"):
            found.append(name)
    return found


def test_no_source_file_can_unpickle_or_run_yaml_tags():
    bad = {}
    for path in sorted(SRC.rglob("*.py")):
        calls = _unsafe_calls(ast.parse(path.read_text(), str(path)))
        if calls:
            bad[str(path.relative_to(SRC))] = calls
    assert not bad, f"unsafe loads: {bad}"


def test_the_guard_catches_each_unsafe_form():
    code = ("torch.load(f)\ntorch.load(f, weights_only=False)\npickle.load(f)\n"
            "np.load(f, allow_pickle=True)\nyaml.load(s)\ntorch.load(f, weights_only=True)\nyaml.safe_load(s)\n")
    assert len(_unsafe_calls(ast.parse(code))) == 5


# ---- the state file --------------------------------------------------------------------------
def test_trainer_state_round_trips_without_pickle(tmp_path):
    model = TransformerLM(tiny_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 257, (2, 8))).sum().backward()
    opt.step()
    state = {"optimizer": opt.state_dict(), "rng": [rng_state()], "best_val": float("nan"), "x": None,
             "pairs": {(1, 2): "tuple key"}}
    save_state(state, tmp_path / "s.safetensors")
    back = load_state(tmp_path / "s.safetensors")
    assert back["rng"][0]["python"] == state["rng"][0]["python"]
    np_a, np_b = back["rng"][0]["numpy"], state["rng"][0]["numpy"]
    assert np_a[0] == np_b[0] and np.array_equal(np_a[1], np_b[1]) and np_a[1].dtype == np_b[1].dtype
    assert torch.equal(back["rng"][0]["torch"], state["rng"][0]["torch"])
    assert back["pairs"] == {(1, 2): "tuple key"} and np.isnan(back["best_val"]) and back["x"] is None
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])   # int parameter ids and param_groups survive
    for key, s in opt.state_dict()["state"].items():
        assert torch.equal(opt2.state_dict()["state"][key]["exp_avg"], s["exp_avg"])


def test_state_with_an_object_is_refused_at_save(tmp_path):
    with pytest.raises(TypeError, match="without pickle"):
        save_state({"obj": object()}, tmp_path / "s.safetensors")


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _format_1_checkpoint(path: Path, trainer_state) -> Path:
    """A checkpoint as archlab wrote it before format 2: trainer.pt (a pickle), sizes only in meta.json."""
    model = TransformerLM(tiny_model())
    path = save_checkpoint(path, 1, model.state_dict(), {"step": 1})
    (path / "trainer.safetensors").unlink()
    torch.save(trainer_state, path / "trainer.pt")
    files = {name: (path / name).stat().st_size for name in ("model.safetensors", "trainer.pt")}
    (path / "meta.json").write_text(json.dumps({"step": 1, "files": files}))
    return path


def test_a_pickled_payload_in_an_old_checkpoint_never_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _format_1_checkpoint(tmp_path / "ckpt", {"state": _Payload()})
    with pytest.raises(CheckpointError, match="allow-list"):
        load_checkpoint(path)
    assert not (tmp_path / "PWNED").exists()


def test_an_honest_old_checkpoint_still_loads(tmp_path):
    path = _format_1_checkpoint(tmp_path / "ckpt", {"step": 7, "rng": [rng_state()]})
    _, trainer = load_checkpoint(path)
    assert trainer["step"] == 7 and isinstance(trainer["rng"][0]["numpy"][1], np.ndarray)


# ---- checksums and fallback -------------------------------------------------------------------
def test_meta_records_format_sizes_and_sha256_and_files_are_readable(tmp_path):
    model = TransformerLM(tiny_model())
    path = save_checkpoint(tmp_path, 1, model.state_dict(), {"step": 1})
    meta = read_meta(path)
    assert meta["format"] == FORMAT_VERSION
    assert set(meta["sha256"]) == set(meta["files"]) == {"model.safetensors", "trainer.safetensors"}
    umask = os.umask(0)
    os.umask(umask)
    for name in meta["files"]:
        assert stat.S_IMODE((path / name).stat().st_mode) == 0o644 & ~umask


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF                       # same size, different content: only a hash sees it
    path.write_bytes(bytes(data))


def test_a_bit_flip_is_found_by_the_hash_not_by_the_size(tmp_path):
    model = TransformerLM(tiny_model())
    path = save_checkpoint(tmp_path, 1, model.state_dict(), {"step": 1})
    _flip_a_byte(path / "model.safetensors")
    verify_checkpoint(path)                              # sizes only: passes
    with pytest.raises(CheckpointError, match="model.safetensors.*sha256"):
        verify_checkpoint(path, full=True)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_resume_skips_a_damaged_newest_checkpoint(tmp_path, damage):
    data = make_data(tmp_path / "data", n_docs=10, words=100)
    cfg = TrainConfig(batch_size=4, seq_len=16, budget=6, warmup_steps=1, eval_batches=1,
                      sample_every=-1, checkpoint_every=2, log_every=1)
    train(tiny_model(), cfg, data, tmp_path / "run", progress=False)
    losses = lambda: [m["loss"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in m]  # noqa: E731
    uninterrupted = losses()
    newest = latest_checkpoint(tmp_path / "run") / "model.safetensors"
    assert newest.parent.name == "step_0000006"
    if damage == "truncate":
        newest.write_bytes(newest.read_bytes()[:100])
    else:
        _flip_a_byte(newest)
    with pytest.warns(UserWarning, match="skipping damaged checkpoint step_0000006"):
        assert resumable_checkpoint(tmp_path / "run").name == "step_0000004"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(tiny_model(), cfg, data, tmp_path / "run", resume=True, progress=False)
    assert losses() == uninterrupted            # steps 5-6 re-run from step 4 give the same numbers
    verify_checkpoint(latest_checkpoint(tmp_path / "run"), full=True)   # and the damaged one is replaced


def test_resume_with_every_checkpoint_damaged_is_one_error(tmp_path):
    model = TransformerLM(tiny_model())
    for step in (1, 2):
        _flip_a_byte(save_checkpoint(tmp_path, step, model.state_dict(), {"step": step}) / "trainer.safetensors")
    assert len(list_checkpoints(tmp_path)) == 2
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="no checkpoint .* verifies"):
        resumable_checkpoint(tmp_path)
