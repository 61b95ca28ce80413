"""`archlab finetune` blames each bad input on what is wrong: one line naming it, exit status 2, nothing written."""
from __future__ import annotations

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
