"""`hf:ORG/NAME[@REVISION]` wherever a model folder goes, through huggingface_hub's cache: tested on a local
folder laid out as the hub cache, offline, so nothing leaves this machine."""
from __future__ import annotations

import shutil

import pytest
import torch

from archlab.cli import main
from archlab.runs.hub import HubError, parse_model_id, resolve_model

pytest.importorskip("huggingface_hub")
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An exported tiny model placed in a hub cache as models--org--tiny, revision main -> SHA."""
    from test_export import _chain_run
    run, _, _ = _chain_run(tmp_path)
    exported = tmp_path / "exported"
    assert main(["convert", "--to-hf", str(run), "--out", str(exported)]) == 0
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(exported, repo / "snapshots" / SHA)
    (repo / "snapshots" / SHA / "modeling_evil.py").write_text("raise SystemExit('remote code ran')")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return exported


def test_ids_parse_and_malformed_ones_are_one_line():
    assert parse_model_id("hf:org/name") == ("org/name", None)
    assert parse_model_id("hf:org/name@v1.0") == ("org/name", "v1.0")
    for bad in ("hf:", "hf:a/b/c", "hf:org/name@"):
        with pytest.raises(HubError, match="expected hf:ORG/NAME"):
            parse_model_id(bad)


def test_a_hub_id_resolves_to_its_cached_snapshot(hub):
    folder = resolve_model("hf:org/tiny")
    assert folder.name == SHA and (folder / "model.safetensors").is_file()
    assert resolve_model("hf:org/tiny@main") == folder


def test_generate_and_convert_take_a_hub_id(hub, tmp_path, capsys):
    assert main(["generate", "hf:org/tiny", "--prompt", "a", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip() == "abc"                   # a -> b -> c -> end of text
    assert main(["convert", "--from-hf", "hf:org/tiny", "--out", str(tmp_path / "run2")]) == 0
    import yaml
    cfg = yaml.safe_load((tmp_path / "run2" / "config.yaml").read_text())
    assert cfg["data"]["converted_from"]["hub_id"] == "hf:org/tiny"


def test_an_id_not_in_the_cache_offline_is_one_line_naming_it(hub, capsys):
    assert main(["generate", "hf:org/missing", "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hf:org/missing" in err and "HF_HUB_OFFLINE" in err


def test_the_serve_engine_takes_a_hub_id(hub):
    pytest.importorskip("fastapi")
    from archlab.serve import CompletionRequest, Engine
    engine = Engine.from_folder("hf:org/tiny")
    text = "".join(d.text for d in engine.complete(CompletionRequest("a", max_tokens=5, temperature=0)))
    assert text == "bc" and engine.name == "tiny"
    assert torch.is_tensor(next(engine.model.parameters()))
