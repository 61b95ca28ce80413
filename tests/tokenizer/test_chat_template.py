"""Chat templates (archlab.tokenizer.chat): the same text, ids and assistant mask as transformers'
apply_chat_template on the same tokenizer folder (archlab-trained BPE with the built-in formats, templates that
read bos/eos from tokenizer_config.json, the list-of-named-templates form, a `tokenizers`-library Unigram), and
a hostile template stopped with one line of error (raising, looping without output, flooding output, allocating)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from archlab.errors import EXIT_USER_ERROR, report
from archlab.tokenizer import train
from archlab.tokenizer.chat import (
    ChatTemplateError,
    ChatTokenizer,
    RenderLimits,
    apply_chat_template,
    read_chat_templates,
    read_special_tokens,
    render_chat,
)
from archlab.tokenizer.chat_builtin import CHAT_FORMATS, add_chat_tokens, install_chat_template

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CORPUS = ("Hello there, how are you? I am fine, thanks. What is two plus two? It is four.\n"
          "Reverse the word cat: tac. Système, café, naïve 🙂 and 12345.\n") * 40
CHAT = [{"role": "system", "content": "You answer briefly. Café ✓"},
        {"role": "user", "content": "What is two plus two? 🙂"},
        {"role": "assistant", "content": "It is four."},
        {"role": "user", "content": "And reversed cat?"},
        {"role": "assistant", "content": " tac 🙂"}]

# templates written the way published ones are (Zephyr-like, with roles checked and eos from the config)
ZEPHYR = ("{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
          "{{ '<|' + message['role'] + '|>\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
          "{{ message['content'] + eos_token }}{% endgeneration %}{% else %}{{ message['content'] + eos_token }}"
          "{% endif %}{{ '\n' }}{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
          "{% endfor %}")
NAMESPACE = ("{% set ns = namespace(n=0) %}{{ bos_token }}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
             "[{{ ns.n }}] {{ m.role | upper }}: {{ m.content | tojson }}\n{% endfor %}"
             "{% if add_generation_prompt %}[{{ ns.n + 1 }}] ASSISTANT:{% endif %}")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    (root / "corpus.txt").write_text(CORPUS)
    return train(root / "corpus.txt", 320, ["<|endoftext|>"])


def _config(folder: Path, **extra) -> None:
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              **extra}))


def _folder(root: Path, bpe, case: str) -> Path:
    """A tokenizer folder for one case, readable by AutoTokenizer (a tokenizer_config.json beside tokenizer.json)."""
    folder = root / case
    folder.mkdir()
    bpe.save(folder)
    if case in CHAT_FORMATS:
        install_chat_template(folder, case)
        _config(folder, eos_token="<|endoftext|>")
    elif case == "zephyr_in_config":
        _config(folder, chat_template=ZEPHYR, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    elif case == "named_templates":
        _config(folder, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                chat_template=[{"name": "default", "template": NAMESPACE}, {"name": "zephyr", "template": ZEPHYR}])
    elif case == "jinja_files":                # chat_template.jinja and additional_chat_templates/tool_use.jinja
        _config(folder, eos_token="<|endoftext|>", bos_token="<|endoftext|>", chat_template=ZEPHYR)
        (folder / "chat_template.jinja").write_text(NAMESPACE)
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "tool_use.jinja").write_text(
            "{{ tools | tojson(indent=2) }}\n" + ZEPHYR)
    elif case == "legacy_special_map":          # the eos role comes from special_tokens_map.json
        _config(folder, chat_template=ZEPHYR)
        (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    elif case == "unigram_chatml":             # loads as an HFTokenizer: the `tokenizers` library's offsets
        from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
        tok = tokenizers.Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        tok.train_from_iterator(CORPUS.splitlines(), trainers.UnigramTrainer(
            vocab_size=150, special_tokens=["<unk>", "</s>"], unk_token="<unk>", show_progress=False))
        tok.save(str(folder / "tokenizer.json"))
        _config(folder, eos_token="</s>", unk_token="<unk>")
        install_chat_template(folder, "chatml")
    return folder


CASES = [*CHAT_FORMATS, "zephyr_in_config", "named_templates", "jinja_files", "legacy_special_map", "unigram_chatml"]
TOOLS = [{"type": "function", "function": {"name": "reverse", "description": "Reverse a word <b>&</b>",
                                           "parameters": {"type": "object", "properties": {"w": {"type": "string"}}}}}]


@pytest.mark.parametrize("case", CASES)
def test_text_ids_and_assistant_mask_equal_transformers(tmp_path, bpe, case):
    folder = _folder(tmp_path, bpe, case)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for prompt in (False, True):
        kw = {"add_generation_prompt": prompt}
        text = apply_chat_template(folder, CHAT, tokenize=False, **kw)
        assert text == theirs.apply_chat_template(CHAT, tokenize=False, **kw)
        assert apply_chat_template(folder, CHAT, **kw) == theirs.apply_chat_template(CHAT, return_dict=False, **kw)
        ours = apply_chat_template(folder, CHAT, return_dict=True, return_assistant_tokens_mask=True, **kw)
        ref = theirs.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True, **kw)
        assert ours["input_ids"] == list(ref["input_ids"])
        assert ours["attention_mask"] == list(ref["attention_mask"])
        assert ours["assistant_masks"] == list(ref["assistant_masks"])
        if "{% generation %}" in (read_chat_templates(folder) if case in CHAT_FORMATS else ""):
            assert 0 < sum(ours["assistant_masks"]) < len(ours["input_ids"])     # the mask marks something
    if case == "named_templates":           # a template chosen by name, as transformers does
        assert (apply_chat_template(folder, CHAT, chat_template="zephyr", tokenize=False)
                == theirs.apply_chat_template(CHAT, chat_template="zephyr", tokenize=False))
    if case == "jinja_files":               # tools given: the tool_use template, tools as plain JSON
        text = apply_chat_template(folder, CHAT, tools=TOOLS, tokenize=False)
        assert text == theirs.apply_chat_template(CHAT, tools=TOOLS, tokenize=False)
        assert text.startswith("[\n  {") and "<b>&</b>" in text


def test_a_batch_of_conversations_equals_transformers(tmp_path, bpe):
    folder = _folder(tmp_path, bpe, "chatml")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    batch = [CHAT[:3], CHAT]
    ours = apply_chat_template(folder, batch, return_dict=True, return_assistant_tokens_mask=True)
    ref = theirs.apply_chat_template(batch, return_dict=True, return_assistant_tokens_mask=True)
    assert ours["input_ids"] == [list(x) for x in ref["input_ids"]]
    assert ours["assistant_masks"] == [list(x) for x in ref["assistant_masks"]]


def test_continue_final_message_equals_transformers(tmp_path, bpe):
    folder = _folder(tmp_path, bpe, "chatml")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    prefill = CHAT[:2] + [{"role": "assistant", "content": "It is"}]
    assert (apply_chat_template(folder, prefill, continue_final_message=True, tokenize=False)
            == theirs.apply_chat_template(prefill, continue_final_message=True, tokenize=False))


def test_special_tokens_and_templates_are_read_like_transformers(tmp_path, bpe):
    folder = _folder(tmp_path, bpe, "legacy_special_map")
    assert read_special_tokens(folder) == {"eos_token": "<|endoftext|>"}
    assert read_chat_templates(folder) == ZEPHYR
    (folder / "chat_template.jinja").write_text(NAMESPACE)         # the file wins over tokenizer_config.json
    assert read_chat_templates(folder) == NAMESPACE
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert apply_chat_template(folder, CHAT, tokenize=False) == theirs.apply_chat_template(CHAT, tokenize=False)


# ---- built-in formats -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CHAT_FORMATS))
def test_adding_a_format_appends_its_tokens_and_keeps_every_old_id(bpe, name):
    grown, new_ids = add_chat_tokens(bpe, name)
    fmt = CHAT_FORMATS[name]
    assert new_ids == list(range(bpe.vocab_size, bpe.vocab_size + len(fmt.tokens)))
    assert [grown.token_to_id(t) for t in fmt.tokens] == new_ids
    assert grown.vocab_size == bpe.vocab_size + len(new_ids)
    assert grown.encode(CORPUS[:200]) == bpe.encode(CORPUS[:200])           # old text, old ids
    assert add_chat_tokens(grown, name) == (grown, [])                       # adding twice adds nothing
    assert bpe.vocab_size == 320 + 0 and "<|im_start|>" not in bpe.special_to_id   # the given one is unchanged


def test_plain_adds_an_end_of_text_token_only_where_there_is_none(tmp_path):
    (tmp_path / "c.txt").write_text(CORPUS)
    bare = train(tmp_path / "c.txt", 300, [])
    grown, new_ids = add_chat_tokens(bare, "plain")
    assert new_ids == [bare.vocab_size] and grown.token_to_id("<|endoftext|>") == bare.vocab_size


def test_installing_a_format_refuses_to_replace_a_template(tmp_path, bpe):
    folder = _folder(tmp_path, bpe, "chatml")
    before = (folder / "tokenizer.json").read_bytes()
    with pytest.raises(Exception, match="overwrite"):
        install_chat_template(folder, "llama3")
    assert (folder / "tokenizer.json").read_bytes() == before
    assert install_chat_template(folder, "llama3", overwrite=True) == list(range(322, 326))
    with pytest.raises(Exception, match="unknown chat template 'vicuna'"):
        install_chat_template(folder, "vicuna", overwrite=True)


# ---- hostile templates ----------------------------------------------------------------------------------------
HOSTILE = {
    "raises": ("{{ raise_exception('Conversation roles must alternate') }}", "roles must alternate"),
    "syntax": ("{% for m in messages %}{{ m.content }}", "Unexpected end of template"),
    "loops_silently": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                       "ran longer than 1 s"),
    "floods_output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "passed 4,000,000 characters"),
    "allocates": ("{{ ('a' * 10**10) | length }}", "more memory"),
    "recurses": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed"),
    "mutates": ("{{ messages.append(1) }}", "unsafe"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_template_is_one_line_of_error_and_the_next_render_works(case, capsys):
    source, expected = HOSTILE[case]
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=expected) as caught:
        render_chat(source, CHAT, limits=RenderLimits(seconds=1.0))
    assert time.monotonic() - started < 20
    assert report(caught.value) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert render_chat("{{ messages[0].content }}", CHAT).text == CHAT[0]["content"]


def test_the_sandbox_hides_python_internals():
    leaks = "{{ messages.__class__ }}|{{ ''.__class__.__mro__ }}|{{ raise_exception.__globals__ }}|{{ cycler }}"
    try:
        text = render_chat(leaks, CHAT).text
    except ChatTemplateError as exc:     # the sandbox refuses outright, or the names render as undefined
        assert "unsafe" in str(exc) or "not" in str(exc)
    else:
        assert "class" not in text and "module" not in text and "function" not in text
    with pytest.raises(ChatTemplateError, match="underscore|cannot set"):
        render_chat("{% set ns = namespace() %}{% set ns.__dict__ = 1 %}", CHAT)


def test_a_folder_with_tokenizer_json_alone_reads_the_roles_its_export_names(tmp_path, bpe):
    bpe.save(tmp_path)
    assert read_special_tokens(tmp_path) == {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                                             "pad_token": "<|endoftext|>"}
    assert apply_chat_template(tmp_path, CHAT[:2], chat_template=ZEPHYR, tokenize=False).count("<|endoftext|>") == 2
    assert ChatTokenizer.of(bpe).special == read_special_tokens(tmp_path)      # the object reads as its folder


def test_a_folder_without_a_template_says_how_to_get_one(tmp_path, bpe):
    bpe.save(tmp_path)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        apply_chat_template(tmp_path, CHAT)
    with pytest.raises(ChatTemplateError, match="return_dict=True"):
        apply_chat_template(tmp_path, CHAT, chat_template=ZEPHYR, return_assistant_tokens_mask=True)


def test_a_run_folder_renders_through_its_tokenizer_folder(tmp_path, bpe):
    """A run folder keeps its tokenizer in tokenizer/: passing the run folder renders the same ids."""
    from archlab.tokenizer.chat_builtin import install_chat_template

    bpe.save(tmp_path / "run" / "tokenizer")
    install_chat_template(tmp_path / "run" / "tokenizer", "chatml")
    assert apply_chat_template(tmp_path / "run", CHAT) == apply_chat_template(tmp_path / "run" / "tokenizer", CHAT)
    with pytest.raises(ChatTemplateError, match="not a tokenizer folder"):
        apply_chat_template(tmp_path, CHAT)


def test_a_worker_that_died_between_renders_is_replaced():
    from archlab.tokenizer import chat_render

    render_chat("x", CHAT)
    for worker in chat_render._WORKERS.values():      # the worker this test's renders started
        worker.proc.kill()
        worker.proc.wait()
    assert render_chat("{{ 1 + 1 }}", CHAT).text == "2"


def test_the_chat_template_command_adds_a_format_and_refuses_mistakes(tmp_path, bpe, capsys):
    from archlab.cli import main

    bpe.save(tmp_path / "tok")
    assert main(["tokenizer", "chat-template", str(tmp_path / "tok"), "--format", "chatml"]) == 0
    assert "ids 320..321" in capsys.readouterr().out
    assert read_chat_templates(tmp_path / "tok") == CHAT_FORMATS["chatml"].source("<|endoftext|>")
    before = (tmp_path / "tok" / "chat_template.jinja").read_text()
    for argv, message in ((["--format", "llama3"], "has a chat template already"),
                          (["--format", "vicuna", "--overwrite"], "unknown chat template 'vicuna'")):
        assert main(["tokenizer", "chat-template", str(tmp_path / "tok"), *argv]) == EXIT_USER_ERROR
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert (tmp_path / "tok" / "chat_template.jinja").read_text() == before


def test_the_vectorized_overlap_equals_transformers_one_pass():
    """token_mask's numpy overlap test against the pass transformers runs (zero-length spans and tokens that
    straddle span edges included)."""
    import numpy as np

    from archlab.tokenizer.chat import _overlaps, _overlaps_in_order

    rng = np.random.default_rng(0)
    for _ in range(300):
        lengths = rng.integers(1, 5, size=int(rng.integers(0, 40)))
        ends = np.cumsum(lengths)
        cuts = np.sort(rng.integers(0, int(ends[-1]) + 2 if len(ends) else 2, size=2 * int(rng.integers(0, 5))))
        spans = [(int(a), int(b)) for a, b in cuts.reshape(-1, 2)]
        assert _overlaps(ends - lengths, ends, spans) == _overlaps_in_order((ends - lengths).tolist(),
                                                                            ends.tolist(), spans)


def test_a_render_worker_ends_when_its_parent_is_killed_mid_render(tmp_path):
    """A process killed while its template loops leaves no worker spinning behind it (an orphan would run the
    loop for ever: nothing closes its stdin)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = ("import threading, time\n"
            "from archlab.tokenizer import chat_render as r\n"
            "loop = '{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}'\n"
            "threading.Thread(target=lambda: r.render_chat(loop, [{'role': 'user', 'content': 'x'}],\n"
            "                 limits=r.RenderLimits(seconds=120)), daemon=True).start()\n"
            "while not r._WORKERS: time.sleep(0.05)\n"
            "time.sleep(1.0)\n"
            "print(next(iter(r._WORKERS.values())).proc.pid, flush=True)\n"
            "time.sleep(120)\n")
    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("archlab").__file__)))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": src})
    try:
        worker = int(parent.stdout.readline())
        os.kill(worker, 0)                                   # rendering the loop now
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                break
            try:                                             # reap it if it became our child's zombie
                os.waitpid(worker, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.2)
        else:
            os.kill(worker, signal.SIGKILL)
            raise AssertionError("the render worker outlived its killed parent")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_the_syntax_check_parses_and_renders_nothing():
    """A template that would loop for ever parses: the check blames only syntax, so a looping template is still
    blamed where it runs, on the data line that ran it (rendering it here stalled for the whole time limit)."""
    from archlab.tokenizer.chat_render import ChatTemplateSyntaxError, RenderLimits, check_template_syntax

    looping = "{% for i in range(10**12) %}{{ i }}{% endfor %}"
    check_template_syntax(looping, RenderLimits(seconds=2))
    with pytest.raises(ChatTemplateSyntaxError, match="line 2"):
        check_template_syntax("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
