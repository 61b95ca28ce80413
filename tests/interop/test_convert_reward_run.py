"""`archlab convert` of a reward run: its score head is what the run learnt and neither GGUF nor an HF causal-LM
folder has a place for it, so both exports refuse in one line and write nothing; a PPO policy's value head (training
state) is left behind and the policy exports."""
import pytest

import archlab
from archlab.cli import main
from archlab.interop.convert import _write_converted_run
from archlab.nn.heads import SCORE_HEAD, VALUE_HEAD, attach_score_head

pytest.importorskip("gguf")


def _run_with_head(folder, head: str):
    model = archlab.TransformerLM(archlab.presets.tiny("llama3-8b"))
    attach_score_head(model, head)
    folder.mkdir()
    _write_converted_run(folder, model, {"test": True})
    return folder


@pytest.mark.parametrize("flag, out, target", [("--to-gguf", "rm.gguf", "GGUF"),
                                               ("--to-hf", "rm-hf", "an HF causal-LM folder")])
def test_a_reward_runs_score_head_is_not_dropped_silently(flag, out, target, tmp_path, capsys):
    run = _run_with_head(tmp_path / "rm", SCORE_HEAD)
    assert main(["convert", flag, str(run), "--out", str(tmp_path / out), "--no-check"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{run} is a reward model" in err and f"{target} has no place for a reward head" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rm"]


def test_a_ppo_policy_exports_without_its_value_head(tmp_path, capsys):
    from archlab.interop.gguf.load import load_gguf_spec, read_spec

    run = _run_with_head(tmp_path / "ppo", VALUE_HEAD)
    assert main(["convert", "--to-gguf", str(run), "--out", str(tmp_path / "p.gguf"), "--no-check"]) == 0
    model = load_gguf_spec(read_spec(tmp_path / "p.gguf"))
    assert not hasattr(model, VALUE_HEAD) and not hasattr(model, SCORE_HEAD)
