"""`archlab quantize` checks its inputs before it loads the model (seconds on a real run): a run without a data
folder and no --text is refused in one line at once, nothing written."""
from __future__ import annotations

import archlab
from archlab.cli import main
from archlab.interop.convert import _write_converted_run


def test_a_run_without_a_data_folder_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import archlab.runs.model_folder as model_folder

    run = tmp_path / "run"
    run.mkdir()
    _write_converted_run(run, archlab.TransformerLM(archlab.presets.tiny("llama3-8b")), {"test": True})

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")

    monkeypatch.setattr(model_folder, "load_run", no_load)
    out = tmp_path / "q"
    assert main(["quantize", str(run), "--weights", "int8", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{run} names no data folder with a validation split: pass --text FILE" in err, err
    assert not out.exists()
