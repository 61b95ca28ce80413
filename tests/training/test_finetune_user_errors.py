"""`archlab finetune` blames each bad input on what is wrong: one line naming it, exit status 2, nothing written."""
from __future__ import annotations

import json

import pytest
from finetune_runs import finetune_argv

from archlab.cli import main


def test_a_chat_template_file_that_is_not_jinja_is_named_not_the_data(chat_world, make_base, tmp_path, capsys):
    base = make_base(tmp_path / "base")
    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    out = tmp_path / "sft"
    assert main(finetune_argv(base, chat_world["data"], out, "--chat-template", str(template))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--chat-template {template}" in err and "line 2" in err and "sft.jsonl" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("method, line", [
    ("sft", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "cat"}]}),
    ("dpo", {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "cat"}],
             "rejected": [{"role": "assistant", "content": "dog"}]}),
    ("grpo", {"prompt": [{"role": "user", "content": "hi"}]}),
])
def test_messages_on_a_base_without_a_template_name_the_option_not_the_python_call(
        method, line, make_base, tmp_path, capsys):
    base = make_base(tmp_path / "base")
    (base / "tokenizer" / "chat_template.jinja").unlink()
    data = tmp_path / "lines.jsonl"
    data.write_text(json.dumps(line) + "\n")
    out = tmp_path / "run"
    extra = ["--reward", "format"] if method == "grpo" else []
    assert main(finetune_argv(base, data, out, "--method", method, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{data}:1: these lines are chat messages and {base} has no chat template" in err, err
    assert "--chat-template chatml" in err and "chat_template=" not in err and "archlab-finetune-" not in err, err
    assert not out.exists()


def test_resume_with_another_method_is_refused_before_the_run_is_touched(make_base, tmp_path, capsys):
    """DPO and reward read the same preference folder (as GRPO and PPO share prompts), so the data check passes:
    the method is checked first, and the run's config.yaml is not rewritten as the other method's."""
    base = make_base(tmp_path / "base")
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": f"{w} is", "chosen": " good", "rejected": " bad"}) + "\n"
                             for w in ("cat", "dog", "bird", "fish", "tree", "rock", "star", "moon")))
    out = tmp_path / "dpo"
    assert main(finetune_argv(base, prefs, out, "--method", "dpo", "--set", "train.warmup_steps=0", budget=2)) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(finetune_argv(base, prefs, out, "--method", "reward", "--resume", "--set", "train.warmup_steps=0",
                              budget=4)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"--resume: {out} was trained with --method dpo, this command asks for --method reward" in err, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_missing_base_is_named_as_the_base_not_as_init_from(chat_world, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(finetune_argv(tmp_path / "no-base", chat_world["data"], out)) == 2
    err = capsys.readouterr().err.strip()
    assert f"BASE {tmp_path / 'no-base'}: no such folder" in err and "--init-from" not in err, err
    assert not out.exists()


def test_a_resume_already_at_its_budget_says_so_instead_of_0_tokens_per_second(chat_world, make_base, tmp_path,
                                                                                capsys):
    base, out = make_base(tmp_path / "base"), tmp_path / "sft"
    assert main(finetune_argv(base, chat_world["data"], out, "--set", "train.warmup_steps=0", budget=2)) == 0
    capsys.readouterr()
    assert main(finetune_argv(base, chat_world["data"], out, "--resume", "--set", "train.warmup_steps=0",
                              budget=2)) == 0
    done = capsys.readouterr().out.strip().splitlines()[-1]
    assert done.startswith("done: 2 steps") and "no step left to train (its budget of 2 steps reached)" in done, done
    assert "0 tokens/s" not in done


def test_val_that_is_the_data_file_is_said_in_one_warning(chat_world, make_base, tmp_path, capsys, monkeypatch,
                                                           recwarn):
    """The same file spelled another way (relative, through ..) is still the training file: resolved paths compared.
    Scoring the training lines can be what a user wants (is it fitting them?), so a warning, not a refusal."""
    base = make_base(tmp_path / "base")
    data = chat_world["data"]
    monkeypatch.chdir(data.parent)
    out = tmp_path / "sft"
    assert main(finetune_argv(base, data, out, "--val", f"../{data.parent.name}/{data.name}")) == 0
    assert "Traceback" not in capsys.readouterr().err
    said = [str(w.message) for w in recwarn if "is the same file as --data" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0], said


@pytest.mark.parametrize("method, setting, section", [
    ("sft", "train.dpo.beta=0.2", "dpo"),
    ("sft", "train.grpo.num_generations=4", "grpo"),
    ("dpo", "train.sft.packing=false", "sft"),
    ("ppo", "train.grpo.beta=0.1", "grpo"),
    ("reward", "train.dpo_beta=0.3", "dpo"),        # an earlier flat spelling of train.dpo.beta
])
def test_another_methods_section_is_refused_naming_the_method_that_reads_it(method, setting, section, tmp_path,
                                                                             capsys):
    out = tmp_path / "run"
    assert main(["finetune", str(tmp_path / "base"), "--method", method, "--data", str(tmp_path / "d.jsonl"),
                 "--out", str(out), "--set", setting]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"--set {setting}: train.{section} is read by --method {section}, not --method {method}" in err, err
    assert not out.exists()


@pytest.mark.parametrize("sets, section, method", [
    (["train.dpo.beta=0.2"], "dpo", "pretrain"),
    (["train.method=dpo", "train.grpo.beta=0.1"], "grpo", "dpo"),
    (["train.objective=dpo", "train.sft.packing=false"], "sft", "dpo"),     # the earlier spelling of the method
    (["train.method=sft", "train.ppo.gamma=0.5"], "ppo", "sft"),
])
def test_train_refuses_another_methods_section_naming_the_method_that_reads_it(sets, section, method, tmp_path,
                                                                              capsys):
    out = tmp_path / "run"
    args = ["train", "--preset", "tiny-llama3-8b", "--data", str(tmp_path / "data"), "--out", str(out), "--set",
            "vocab_size=300"]
    assert main([*args, *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"--set {sets[-1]}: train.{section} is read by train.method={section}, not train.method={method}" in err
    assert not out.exists()


def test_train_keeps_the_sections_its_method_reads():
    """Its own section, and train.sft.packing under pretrain (how a prepared chat folder's rows are packed)."""
    from types import SimpleNamespace

    from archlab.cli.train import build_configs

    def built(*sets: str):
        args = SimpleNamespace(config=None, preset="tiny-llama3-8b", data="unused", set=["vocab_size=300", *sets])
        return build_configs(args)[1]

    assert built("train.method=dpo", "train.dpo.beta=0.2").dpo.beta == 0.2
    assert built("train.sft.packing=false").sft.packing is False


def test_python_finetune_refuses_another_methods_changed_field_before_writing(tmp_path):
    from archlab.config import ConfigError
    from archlab.training.config import DPOConfig, GRPOConfig, TrainConfig, refuse_other_methods_settings
    from archlab.training.finetune import finetune

    out = tmp_path / "sft"
    with pytest.raises(ConfigError, match=r"^train_cfg\.dpo\.beta=0\.2: train\.dpo is read by method='dpo', not "
                                          r"method='sft'"):
        finetune(tmp_path / "base", tmp_path / "d.jsonl", out, train_cfg=TrainConfig(dpo=DPOConfig(beta=0.2)))
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"train_cfg\.grpo\.num_generations=4: .* not method='ppo'"):
        refuse_other_methods_settings(TrainConfig(grpo=GRPOConfig(num_generations=4)), "ppo")
    for method in ("pretrain", "sft", "dpo", "reward", "grpo", "ppo"):      # defaults are never refused
        refuse_other_methods_settings(TrainConfig(), method)
    refuse_other_methods_settings(TrainConfig(dpo=DPOConfig(beta=0.2), method="dpo"), "dpo")
    refuse_other_methods_settings(TrainConfig(sft={"packing": False}), "pretrain")
