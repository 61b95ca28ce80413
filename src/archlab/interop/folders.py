"""The JSON files that name what an HF model folder or a PEFT adapter folder holds, read as data."""
from __future__ import annotations

from pathlib import Path

from archlab.config import ConfigError
from archlab.errors import read_json_object as json_object


def read_json_object(folder: str | Path, name: str, meant: str) -> dict:
    """The JSON object in `folder`/`name` (config.json, adapter_config.json). A ConfigError names the file when
    it is absent (`meant`: the kind of folder that holds it), not JSON, or not an object."""
    path = Path(folder) / name
    if not path.is_file():
        raise ConfigError(f"{folder}: no {name} (is this a {meant}?)")
    return json_object(path, ConfigError)
