"""Chat and instruction data (archlab.data.chat): .jsonl conversations and prompt/completion lines become
(input_ids, labels) whose scored tokens are the ones each loss mask names, checked against transformers'
assistant mask and against the text each mask should select; the two ways of finding assistant turns
({% generation %} spans, rendered-prefix differences) agree; truncation policies; every bad line is one
line of error naming the file and line, exit status 2."""
from __future__ import annotations

import json
import re

import pytest

from archlab.data.chat import LOSS_MASKS, TRUNCATIONS, ChatDataError, load_chat_data
from archlab.data.objectives import IGNORE
from archlab.errors import EXIT_USER_ERROR, report
from archlab.tokenizer import train
from archlab.tokenizer.chat import ChatTokenizer, RenderLimits
from archlab.tokenizer.chat_builtin import install_chat_template

CORPUS = "What is two plus two? It is four. Reverse the word cat: tac. Thanks, you are welcome.\n" * 40
CONVERSATION = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is two plus two?"},
                {"role": "assistant", "content": "It is four."},
                {"role": "user", "content": "Reverse the word cat."},
                {"role": "assistant", "content": "tac"}]
PROMPT_COMPLETION = {"prompt": "Reverse the word cat: ", "completion": "tac."}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatdata")
    (root / "corpus.txt").write_text(CORPUS)
    tok = train(root / "corpus.txt", 300, ["<|endoftext|>"])
    tok.save(root / "tok")
    install_chat_template(root / "tok", "chatml")
    return root / "tok"


def _jsonl(path, *records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _scored_text(folder, example) -> str:
    """The text of the tokens the labels score (slot j scores token j + 1)."""
    tok = ChatTokenizer.of(folder).tokenizer
    return tok.decode([t for t in example.labels if t != IGNORE])


def test_assistant_labels_equal_transformers_assistant_mask_shifted(tmp_path, folder):
    transformers = pytest.importorskip("transformers")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    try:
        ref = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
            CONVERSATION, return_dict=True, return_assistant_tokens_mask=True)
    finally:
        (folder / "tokenizer_config.json").unlink()
    (example,) = load_chat_data(_jsonl(tmp_path / "d.jsonl", {"messages": CONVERSATION}), folder,
                                progress=False).examples
    ids, mask = list(ref["input_ids"]), list(ref["assistant_masks"])
    assert example.input_ids == ids
    assert example.labels == [ids[j + 1] if mask[j + 1] else IGNORE for j in range(len(ids) - 1)] + [IGNORE]
    assert _scored_text(folder, example) == "It is four.<|im_end|>tac<|im_end|>"


def test_prefix_difference_finds_the_same_turns_as_generation_spans(tmp_path, folder):
    """A template without {% generation %}: the assistant turns come from rendered prefixes and match the
    tagged template's spans plus the newline each turn ends with."""
    tagged = (folder / "chat_template.jinja").read_text()
    untagged = tagged.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    data = _jsonl(tmp_path / "d.jsonl", {"messages": CONVERSATION})
    a = load_chat_data(data, folder, progress=False).examples[0]
    b = load_chat_data(data, folder, chat_template=untagged, progress=False).examples[0]
    assert a.input_ids == b.input_ids
    assert _scored_text(folder, b) == "It is four.<|im_end|>\ntac<|im_end|>\n"
    assert [t for t in a.labels if t != IGNORE] == [t for t in b.labels if t != IGNORE and
                                                    t != ChatTokenizer.of(folder).tokenizer.encode("\n")[0]]


@pytest.mark.parametrize("mask, expected", [
    ("assistant", "It is four.<|im_end|>tac<|im_end|>"),
    ("last", "tac<|im_end|>"),
])
def test_loss_masks_on_conversations(tmp_path, folder, mask, expected):
    data = _jsonl(tmp_path / "d.jsonl", {"messages": CONVERSATION})
    (example,) = load_chat_data(data, folder, mask=mask, progress=False).examples
    assert _scored_text(folder, example) == expected


def test_mask_all_scores_every_token_but_the_first(tmp_path, folder):
    (example,) = load_chat_data(_jsonl(tmp_path / "d.jsonl", {"messages": CONVERSATION}), folder, mask="all",
                                progress=False).examples
    assert example.labels == example.input_ids[1:] + [IGNORE]


def test_plain_prompt_completion_scores_the_completion_and_end_of_text(tmp_path, folder):
    tok = ChatTokenizer.of(folder).tokenizer
    for mask in ("completion", "assistant", "last"):
        (example,) = load_chat_data(_jsonl(tmp_path / "d.jsonl", PROMPT_COMPLETION), folder, mask=mask,
                                    progress=False).examples
        assert example.input_ids == tok.encode("Reverse the word cat: tac.<|endoftext|>")
        # " tac" starts at the prompt's trailing space and overlaps the completion: a straddling token is scored
        assert _scored_text(folder, example) == " tac.<|endoftext|>"


def test_conversational_prompt_completion_scores_the_completion(tmp_path, folder):
    record = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    (example,) = load_chat_data(_jsonl(tmp_path / "d.jsonl", record), folder, mask="completion",
                                progress=False).examples
    assert _scored_text(folder, example) == "tac<|im_end|>\n"          # prompt ends at the generation prompt


def test_completion_mask_is_refused_for_messages(tmp_path, folder):
    with pytest.raises(ChatDataError, match=r"d.jsonl:1: loss mask 'completion' needs prompt/completion"):
        load_chat_data(_jsonl(tmp_path / "d.jsonl", {"messages": CONVERSATION}), folder, mask="completion",
                       progress=False)


# ---- lengths ------------------------------------------------------------------------------------------------------
def test_truncation_policies(tmp_path, folder):
    data = _jsonl(tmp_path / "d.jsonl", {"messages": CONVERSATION[:3]}, {"messages": CONVERSATION})
    full = load_chat_data(data, folder, progress=False).examples
    limit = len(full[0].input_ids)                      # the first fits, the second does not
    with pytest.raises(ChatDataError, match=rf"d.jsonl:2: {len(full[1].input_ids)} tokens, more than the limit"):
        load_chat_data(data, folder, max_tokens=limit, progress=False)
    start = load_chat_data(data, folder, max_tokens=limit, truncation="keep_start", progress=False)
    assert start.truncated == 1 and start.examples[1].input_ids == full[1].input_ids[:limit]
    assert start.examples[0] == full[0]
    end = load_chat_data(data, folder, max_tokens=limit, truncation="keep_end", progress=False)
    assert end.examples[1].input_ids == full[1].input_ids[-limit:]
    assert end.examples[1].labels[:-1] == full[1].labels[-limit:-1]        # the same targets, the same scores
    skip = load_chat_data(data, folder, max_tokens=limit, truncation="skip", progress=False)
    assert skip.skipped == 1 and [e.line for e in skip.examples] == [1]
    assert set(TRUNCATIONS) == {"refuse", "keep_start", "keep_end", "skip"}


# ---- bad input ------------------------------------------------------------------------------------------------------
BAD = {
    "not_json": ('{"messages": [', r"bad.jsonl:2: not valid JSON"),
    "neither_shape": ({"text": "hi"}, r"bad.jsonl:2 has neither 'messages' nor 'prompt' and 'completion'"),
    "no_content": ({"messages": [{"role": "user"}]}, r"bad.jsonl:2: messages\[0\] has no 'content'"),
    "no_role": ({"messages": [{"content": "hi"}]}, r"bad.jsonl:2: messages\[0\] has no 'role'"),
    "unknown_role": ({"messages": [{"role": "wizard", "content": "hi"}]}, r"bad.jsonl:2: .*unknown role 'wizard'"),
    "content_not_text": ({"messages": [{"role": "user", "content": 3}]}, r"bad.jsonl:2: .*not a string"),
    "nothing_to_learn": ({"messages": CONVERSATION[:2]}, r"bad.jsonl:2: nothing to learn from"),
    "mixed_prompt": ({"prompt": "a", "completion": [CONVERSATION[2]]}, r"bad.jsonl:2: prompt and completion must"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_line_is_one_line_naming_file_and_line(tmp_path, folder, case, capsys):
    record, pattern = BAD[case]
    data = _jsonl(tmp_path / "bad.jsonl", {"messages": CONVERSATION}, record)
    with pytest.raises(ChatDataError, match=pattern) as caught:
        load_chat_data(data, folder, progress=False)
    assert report(caught.value) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


RAISES = "{{ raise_exception('roles must alternate') }}"
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("body, line, pattern", [(RAISES, 2, "roles must alternate"), (RAISES, 4, "roles must"),
                                                 (LOOPS, 3, "ran longer than 1 s")])
def test_a_template_that_raises_or_loops_names_the_line(tmp_path, folder, body, line, pattern):
    """The conversations of a file render in one request: the error still names the line that caused it."""
    template = f"{{% if messages|length == {line + 1} %}}{body}{{% endif %}}x"     # line n has n + 1 messages
    data = _jsonl(tmp_path / "bad.jsonl", *({"messages": CONVERSATION[:n + 1]} for n in (1, 2, 3, 4)))
    with pytest.raises(ChatDataError, match=rf"bad.jsonl:{line}: the chat template.*{re.escape(pattern)}"):
        load_chat_data(data, folder, chat_template=template, mask="all", limits=RenderLimits(seconds=1.0),
                       progress=False)


def test_unknown_mask_and_policy_names_list_the_choices(tmp_path, folder):
    data = _jsonl(tmp_path / "d.jsonl", {"messages": CONVERSATION})
    with pytest.raises(Exception, match="assistant, all, last, completion"):
        load_chat_data(data, folder, mask="answers", progress=False)
    with pytest.raises(Exception, match="refuse, keep_start, keep_end, skip"):
        load_chat_data(data, folder, truncation="middle", progress=False)
    assert list(LOSS_MASKS) == ["assistant", "all", "last", "completion"]


def test_inspect_chat_prints_counts_and_marks_the_scored_text(tmp_path, folder, capsys):
    from archlab.cli import main

    data = _jsonl(tmp_path / "d.jsonl", {"messages": CONVERSATION}, PROMPT_COMPLETION)
    assert main(["data", "inspect-chat", data, "--tokenizer", str(folder), "--show", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 examples" in out and "truncated" in out
    assert "assistant\n⟦It is four.<|im_end|>⟧\n<|im_start|>user" in out
    assert "Reverse the word cat:⟦ tac.<|endoftext|>⟧" in out
    bad = _jsonl(tmp_path / "bad.jsonl", {"messages": CONVERSATION}, {"messages": [{"role": "wizard", "content": ""}]})
    assert main(["data", "inspect-chat", bad, "--tokenizer", str(folder)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert "bad.jsonl:2" in err[-1] and "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("template, message", [
    ("missing.jinja", "--chat-template missing.jinja: no such file, nor a template of"),
    ("chatml", "--chat-template chatml: no such file, nor a template of"),     # a name is not a template's text
    ("broken.jinja", "--chat-template broken.jinja: the chat template is not valid Jinja (line 1)"),
])
def test_inspect_chat_refuses_a_template_it_cannot_find_or_parse(tmp_path, folder, capsys, monkeypatch, template,
                                                                 message):
    from archlab.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.jinja").write_text("{{ messages }")
    data = _jsonl(tmp_path / "d.jsonl", {"messages": CONVERSATION})
    capsys.readouterr()
    assert main(["data", "inspect-chat", data, "--tokenizer", str(folder), "--chat-template", template]) == \
        EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "d.jsonl" not in err, err
