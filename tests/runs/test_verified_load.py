"""What generate, serve and convert --to-hf load from a run folder is verified first: the weights file's sha256
against meta.json, no file a link out of its checkpoint folder, no name in meta.json outside it, and a stray
`step_*` folder without meta.json is not the newest checkpoint. (The CLI rows for generate and convert --to-hf
are in tests/cli/test_bad_input.py.)"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_checkpoint import make_data, tiny_model

from archlab.cli import main
from archlab.runs.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
    verified_weights,
)
from archlab.runs.model_folder import load_run
from archlab.training.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("verified")
    data = make_data(root / "data", n_docs=8, words=80)
    cfg = TrainConfig(batch_size=2, seq_len=16, budget=2, warmup_steps=1, eval_batches=1, sample_every=-1)
    train(tiny_model(), cfg, data, root / "run", progress=False)
    return root / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _weights(folder: Path) -> Path:
    return latest_checkpoint(folder) / "model.safetensors"


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-9] ^= 0x40
    path.write_bytes(bytes(data))


def _link_out(path: Path, target: Path) -> None:
    shutil.move(path, target)
    path.symlink_to(target)


def test_a_flipped_byte_is_refused_naming_the_file(run, tmp_path):
    folder = _copy(run, tmp_path)
    before, _ = load_run(folder)
    _flip(_weights(folder))
    with pytest.raises(CheckpointError, match="model.safetensors is corrupt or was replaced: its sha256") as err:
        load_run(folder)
    assert "\n" not in str(err.value)
    _flip(_weights(folder))                                   # the byte back: it loads the same weights
    after, _ = load_run(folder)
    assert all(torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))


@pytest.mark.parametrize("where", ["the weights file", "the checkpoint folder"])
def test_a_link_out_of_the_folder_is_refused_even_to_the_same_bytes(run, tmp_path, where):
    folder = _copy(run, tmp_path)
    if where == "the weights file":
        _link_out(_weights(folder), tmp_path / "elsewhere.safetensors")
    else:
        ckpt = latest_checkpoint(folder)
        _link_out(ckpt, tmp_path / ckpt.name)
    with pytest.raises(CheckpointError, match="is a link to .*outside"):
        load_run(folder)


def test_meta_json_naming_a_file_outside_its_folder_is_refused(run, tmp_path):
    folder = _copy(run, tmp_path)
    ckpt = latest_checkpoint(folder)
    for name in ("../../config.yaml", str((folder / "config.yaml").resolve())):
        meta = json.loads((ckpt / "meta.json").read_text())
        meta["files"] = {name: 10, **meta["files"]}
        (ckpt / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match="not a file inside"):
            verified_weights(ckpt)
        meta["files"].pop(name)
        (ckpt / "meta.json").write_text(json.dumps(meta))


def test_a_stray_step_folder_without_meta_is_not_the_newest(run, tmp_path, capsys):
    folder = _copy(run, tmp_path)
    real = latest_checkpoint(folder)
    stray = folder / "checkpoints" / "step_9999999"
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(b"not weights")
    assert latest_checkpoint(folder) == real
    assert list_checkpoints(folder)[-1] == stray              # `archlab check` still lists it (as damaged)
    assert main(["generate", str(folder), "--prompt", "to be", "--max-new-tokens", "3"]) == 0
    assert main(["check", str(folder), "--quick"]) == 1
    assert "step_9999999  DAMAGED" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["flipped byte", "foreign link"])
def test_serve_refuses_what_it_would_load_with_one_line(run, tmp_path, capsys, monkeypatch, damage):
    pytest.importorskip("uvicorn")
    from archlab.serve.server import Server

    def never(*args, **kwargs):
        raise AssertionError("the server started on damaged weights")

    monkeypatch.setattr(Server, "run", never)
    monkeypatch.delenv("ARCHLAB_DEBUG", raising=False)
    folder = _copy(run, tmp_path)
    if damage == "flipped byte":
        _flip(_weights(folder))
    else:
        _link_out(_weights(folder), tmp_path / "elsewhere.safetensors")
    capsys.readouterr()
    assert main(["serve", str(folder), "--port", "0"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.safetensors" in lines[0] and "Traceback" not in lines[0], lines


def test_a_checkpoint_without_sha256_still_loads_by_size(run, tmp_path):
    """meta.json of format 1 records sizes only: the weights load (check and resume say what they verified)."""
    folder = _copy(run, tmp_path)
    ckpt = latest_checkpoint(folder)
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["sha256"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    model, _ = load_run(folder)
    state = verified_weights(ckpt)
    assert set(state) == set(model.state_dict())


def test_save_then_verified_load_round_trips(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3)}
    ckpt = save_checkpoint(tmp_path / "checkpoints", 1, state, {})
    assert torch.equal(verified_weights(ckpt, tmp_path)["w"], state["w"])
