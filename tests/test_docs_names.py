"""The module names the README, docs/ and the code's docstrings and comments give exist: a dotted
`archlab.ROOM.module[.attribute]`, a path `src/archlab/...`, `ROOM/file.py`, `ROOM/module` or `ROOM/module.attribute`,
a bare `file.py` in a module's text (which means a file beside it: in its folder, or its room, or a leaf such as
config.py), and in the README and docs/ a `Class.attribute` of a class archlab defines.
Renamed or removed modules leave such names behind; a reader then looks for a file that is not there."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_hygiene import _module_names as module_names

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "archlab"
ROOMS = sorted(p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(SRC.rglob("*.py")),
         *sorted((ROOT / "benchmarks").glob("*.py"))]
# Files of other projects that docstrings cite by name.
EXTERNAL = {"denoising_dataset.py", "create_pretraining_data.py", "encoder.py"}   # fairseq, BERT, openai/gpt-2
# Folders users make that share a room's name (runs/demo, data/mine): a path there is not a module path.
USER_FOLDERS = {"runs", "data"}
ROOM = "|".join(ROOMS)
DOTTED = re.compile(rf"\barchlab\.(?:{ROOM})(?:\.\w+)*")
PATH = re.compile(rf"(?<![\w./-])((?:src/)?archlab/)?((?:{ROOM})/[\w/.]*\w)")
BARE = re.compile(r"(?<![\w/.-])([a-z_0-9]+\.py)\b")


MODULES = module_names()      # {"archlab.nn.fused": path, ...}


def stale_dotted(text: str) -> list[str]:
    """Dotted names whose module does not exist, or whose first attribute the module never names."""
    bad = []
    for m in DOTTED.finditer(text):
        parts = m.group(0).split(".")
        known = max(k for k in range(1, len(parts) + 1) if ".".join(parts[:k]) in MODULES or k == 1)
        if known < 2:
            bad.append(m.group(0))
        elif known < len(parts):
            attribute = parts[known]
            source = MODULES[".".join(parts[:known])].read_text(encoding="utf-8")
            if not re.search(rf"\b{re.escape(attribute)}\b", source):
                bad.append(m.group(0))
    return bad


def stale_paths(text: str, here: Path | None = None) -> list[str]:
    """`ROOM/...` and `src/archlab/...` paths that are neither a module nor a folder; with `here` (a module's own
    file), bare `name.py` that is not beside it."""
    bad = []
    for m in PATH.finditer(text):
        rooted, path = m.group(1), m.group(2)
        suffix = Path(path).suffix
        if "NAME" in path:                                                  # a placeholder
            continue
        if suffix not in ("", ".py"):       # `ROOM/module.attribute` names an attribute; anything else, a data file
            module = SRC / (path.removesuffix(suffix) + ".py")
            if module.is_file() and not re.search(rf"\b{re.escape(suffix[1:])}\b", module.read_text(encoding="utf-8")):
                bad.append(m.group(0))
            continue
        if path.split("/")[0] in USER_FOLDERS and not rooted and not path.endswith(".py"):
            continue
        if not any((SRC / p).exists() for p in (path, path + ".py")):
            bad.append(m.group(0))
    if here is not None:
        room = SRC / here.relative_to(SRC).parts[0] if here.parent != SRC else SRC
        for m in BARE.finditer(text):
            name = m.group(1)
            beside = [here.parent / name, *room.rglob(name), SRC / name]
            cited = re.search(r"[\w-]+/[\w.-]+\s", text[max(0, m.start() - 80):m.start()])   # "xai-org/grok-1 run.py"
            if name in EXTERNAL or name.startswith(("modeling_", "configuration_")) or cited:
                continue                                       # another project's file (transformers' modeling_*)
            if not any(p.is_file() for p in beside):
                bad.append(name)
    return bad


CLASSES: dict[str, list[Path]] = {}      # class name -> the modules that define a class of that name
for _path in SRC.rglob("*.py"):
    for _name in re.findall(r"^class (\w+)", _path.read_text(encoding="utf-8"), re.M):
        CLASSES.setdefault(_name, []).append(_path)


def stale_class_attributes(text: str) -> list[str]:
    """`Class.attribute` in backticks, for a class archlab defines, whose module never names the attribute (a
    field renamed: `TrainConfig.dpo_loss` once it became train.dpo.loss)."""
    bad = []
    for m in re.finditer(r"`([A-Z]\w+)\.([a-z_]\w*)", text):
        name, attribute = m.groups()
        if name in CLASSES and not any(re.search(rf"\b{attribute}\b", p.read_text(encoding="utf-8"))
                                       for p in CLASSES[name]):
            bad.append(f"{name}.{attribute}")
    return bad


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_a_text_names_exists(path):
    text = path.read_text(encoding="utf-8")
    here = path if path.is_relative_to(SRC) else None
    bad = stale_dotted(text) + stale_paths(text, here) + (stale_class_attributes(text) if here is None else [])
    assert not bad, f"{path.relative_to(ROOT)} names modules that do not exist: {sorted(set(bad))}"


def test_the_checks_catch_stale_names_and_spare_real_ones():
    assert stale_dotted("archlab.nn.calls and archlab.nn.fused.no_such_thing") == [
        "archlab.nn.calls", "archlab.nn.fused.no_such_thing"]
    assert stale_dotted("archlab.nn.fused.decode_session, archlab.training.trainer") == []
    assert stale_paths("see nn/calls.py and src/archlab/training/train_config.py") == [
        "nn/calls.py", "src/archlab/training/train_config.py"]
    assert stale_paths("nn/fused.py, interop/families/, runs/demo, data/mine") == []
    assert stale_paths("`generation/drafts.Draft`, `nn/fused.no_such_thing`, `runs/demo/loss.png`") == [
        "nn/fused.no_such_thing"]
    assert stale_class_attributes("`TrainConfig.dpo_loss`, `TrainConfig.lora`, `Nobody.knows`") == [
        "TrainConfig.dpo_loss"]
    trainer = SRC / "training" / "trainer.py"
    assert stale_paths("TrainConfig (train_config.py), optim.py, checkpoints (checkpoint.py)", trainer) == [
        "train_config.py", "checkpoint.py"]                 # checkpoint.py is in runs/, not beside the trainer
    assert stale_paths("a run folder's tokenizer/chat_template.jinja") == []
    assert stale_paths("parallelism from outside (train.py)", SRC / "models" / "decoder.py") == ["train.py"]
    assert stale_paths("source: xai-org/grok-1 run.py and model.py; modeling_phi3_small.py", trainer) == []
