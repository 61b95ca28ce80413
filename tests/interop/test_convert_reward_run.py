"""`archlab convert` of a reward run: its score head is what the run learnt and neither GGUF, an HF causal-LM
folder nor a causal-LM PEFT adapter has a place for it, so the exports refuse in one line and write nothing; a PPO
policy's value head (training state) is left behind and the policy exports."""
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


def test_a_lora_reward_run_is_refused_by_to_peft_not_written_without_its_head(tmp_path, capsys):
    """A LoRA reward run's adapters alone would be a causal-LM adapter (task_type CAUSAL_LM) without the score head
    the run trained whole: refused in one line, nothing written."""
    from archlab.nn.lora import LoRAConfig, apply_lora
    from archlab.runs.checkpoint import save_checkpoint
    from archlab.runs.model_folder import write_run_config

    model = archlab.TransformerLM(archlab.presets.tiny("llama3-8b"))
    lora = LoRAConfig(r=4, targets=("q", "v"))
    apply_lora(model, lora)
    attach_score_head(model, SCORE_HEAD)
    run = tmp_path / "rm"
    run.mkdir()
    write_run_config(run, model=model.config.to_dict(), train={"method": "reward", "lora": lora.to_dict()}, data={})
    save_checkpoint(run / "checkpoints", 2, model.state_dict(), {})
    assert main(["convert", "--to-peft", str(run), "--out", str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{run} is a reward model" in err and "--to-peft's causal-LM adapter has no place for a reward head" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rm"]
