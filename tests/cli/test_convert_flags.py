"""`archlab convert`: an option that belongs to another direction is refused in one line, not silently ignored
(`--from-gguf F --type q8_0` wrote a float32 run; `--to-gguf RUN --dtype bfloat16` an f16 file)."""
from __future__ import annotations

import pytest

from archlab.cli import main


@pytest.mark.parametrize("direction, extra, needle", [
    (["--from-gguf", "model.gguf"], ["--type", "q8_0"], "--type is for --to-gguf"),
    (["--to-gguf", "run"], ["--dtype", "bfloat16"], "--dtype is for --from-hf and --from-gguf"),
    (["--to-gguf", "run"], ["--family", "mistral"], "--family is for --to-hf and --to-peft"),
    (["--from-gguf", "model.gguf"], ["--family", "mistral"], "--family is for --to-hf and --to-peft"),
    (["--to-hf", "run"], ["--type", "f16"], "--type is for --to-gguf"),
])
def test_an_option_of_another_direction_is_refused(tmp_path, capsys, direction, extra, needle):
    out = tmp_path / "out"
    argv = ["convert", direction[0], str(tmp_path / direction[1]), "--out", str(out), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


def test_the_default_type_is_still_f16(tmp_path, capsys):
    assert main(["convert", "--to-gguf", str(tmp_path / "missing"), "--out", str(tmp_path / "x.gguf")]) == 2
    assert "--type" not in capsys.readouterr().err
