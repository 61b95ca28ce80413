"""`archlab chat` over piped stdin: each answer is exactly `archlab generate` on the conversation rendered through
the folder's chat template (greedy), cut at the template's end-of-turn token; /reset forgets; a history past
the context drops its oldest turns (said once); bad input is one line and exit 2."""
from __future__ import annotations

import io

import pytest
from chat_run import END, FIRST, make_chat_run, render

from archlab.cli import main

N = "12"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    return make_chat_run(tmp_path_factory.mktemp("chat"))


def generated(root, prompt: str, capsys, max_new: str = N) -> tuple[str, str]:
    """(`archlab generate --prompt PROMPT` cut at the end-of-turn token, its whole continuation)."""
    capsys.readouterr()
    assert main(["generate", str(root), "--prompt", prompt, "--max-new-tokens", max_new]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt) and out.endswith("\n")
    whole = out[len(prompt):-1]
    return whole.split(END)[0], whole


def chat(root, lines: list[str], capsys, monkeypatch, *flags: str) -> tuple[int, str, str]:
    """(exit status, stdout: each answer and a newline, stderr) of a piped session."""
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    capsys.readouterr()
    rc = main(["chat", str(root), "--max-new-tokens", N, *flags])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def printed(answers: list[str]) -> str:
    return "".join(answer + "\n" for answer in answers)


def test_each_answer_equals_generate_on_the_rendered_history(chat_run, capsys, monkeypatch):
    root, _, _ = chat_run
    users = [FIRST, "and then?", "one more"]
    rc, out, err = chat(root, users, capsys, monkeypatch)
    assert rc == 0 and err == ""
    history, answers, cut = [], [], 0
    for user in users:
        history.append({"role": "user", "content": user})
        answer, whole = generated(root, render(root, history), capsys)
        cut += END in whole
        answers.append(answer)
        history.append({"role": "assistant", "content": answer})
    assert out == printed(answers)
    assert cut >= 1          # at least one answer stopped at <|im_end|> before the token limit


def test_a_system_message_heads_every_prompt(chat_run, capsys, monkeypatch):
    root, _, _ = chat_run
    rc, out, _ = chat(root, [FIRST], capsys, monkeypatch, "--system", "Be brief.")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": FIRST}]
    assert rc == 0 and out == printed([generated(root, render(root, messages), capsys)[0]])


def test_reset_forgets_the_conversation(chat_run, capsys, monkeypatch):
    root, _, _ = chat_run
    first = generated(root, render(root, [{"role": "user", "content": FIRST}]), capsys)[0]
    fresh = generated(root, render(root, [{"role": "user", "content": "and then?"}]), capsys)[0]
    rc, out, err = chat(root, [FIRST, "/reset", "and then?", "/exit", "never read"], capsys, monkeypatch)
    assert rc == 0 and "conversation cleared" in err
    assert out == printed([first, fresh])


def test_a_history_past_the_context_drops_its_oldest_turns_once(tmp_path, capsys, monkeypatch):
    """A 64-token context with 8 tokens kept for the answer: the third turn on drops the oldest turns, each answer
    still equal to generate on what was kept (recomputed here: whole user/assistant pairs, oldest first)."""
    root, _, tok = make_chat_run(tmp_path, max_seq_len=64)
    users = ["first question", "second question", "third question", "fourth question"]
    rc, out, err = chat(root, users, capsys, monkeypatch, "--max-new-tokens", "8")
    assert rc == 0 and err.count("dropping the oldest turns") == 1 and err.count("\n") == 1
    history: list[dict] = []
    answers = []
    for user in users:
        history.append({"role": "user", "content": user})
        while len(tok.encode(render(root, history))) > 64 - 8:
            history = history[2:]
        answers.append(generated(root, render(root, history), capsys, "8")[0])
        history.append({"role": "assistant", "content": answers[-1]})
    assert out == printed(answers)
    assert history[0]["content"] != users[0]


def test_the_kept_cache_grows_between_turns_not_inside_them(tmp_path, capsys, monkeypatch):
    """Five turns of ~120 tokens cross the kept cache's 256 and 512 slots: each growth happens after an answer
    (PrefixCache.ahead), none when a turn opens the cache, and every answer equals generate on the rendered history."""
    from archlab.generation import PrefixCache

    root, _, _ = make_chat_run(tmp_path, max_seq_len=1024)
    opened, real_open = [], PrefixCache.open

    def open_(self, *args, **kwargs):           # (slots before the turn, slots once its cache is open)
        before = None if self.cache is None else self.cache.max_len
        cache = real_open(self, *args, **kwargs)
        opened.append((before, cache.max_len))
        return cache

    monkeypatch.setattr(PrefixCache, "open", open_)
    users = [f"question {i}: " + "tell me more about the weather in the hills " * 2 for i in range(5)]
    rc, out, err = chat(root, users, capsys, monkeypatch)
    monkeypatch.setattr(PrefixCache, "open", real_open)
    assert rc == 0 and err == ""
    assert [after for _, after in opened] == [256, 512, 512, 1024, 1024] and all(
        before == after for before, after in opened[1:]), opened
    history, answers = [], []
    for user in users:
        history.append({"role": "user", "content": user})
        answers.append(generated(root, render(root, history), capsys)[0])
        history.append({"role": "assistant", "content": answers[-1]})
    assert out == printed(answers)


def test_a_message_that_cannot_fit_is_refused_and_the_chat_goes_on(tmp_path, capsys, monkeypatch):
    root, _, _ = make_chat_run(tmp_path, max_seq_len=64)
    first = generated(root, render(root, [{"role": "user", "content": FIRST}]), capsys, "8")[0]
    rc, out, err = chat(root, [FIRST, "x" * 80, "/reset", FIRST], capsys, monkeypatch, "--max-new-tokens", "8")
    assert rc == 2 and out == printed([first, first])
    assert err.count("\n") == 2 and "does not fit the model's context of 64" in err


def test_a_folder_without_a_template_names_the_command_that_adds_one(tmp_path, capsys, monkeypatch):
    root, _, _ = make_chat_run(tmp_path)
    (root / "tokenizer" / "chat_template.jinja").unlink()
    rc, out, err = chat(root, [FIRST], capsys, monkeypatch)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert f"archlab tokenizer chat-template {root / 'tokenizer'} --format plain" in err


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "nan"], "--temperature nan must be"),
    (["--max-new-tokens", "256"], "--max-new-tokens 256 leaves no room for a prompt"),
    (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
])
def test_bad_flags_are_one_line_and_exit_2(chat_run, capsys, monkeypatch, flags, message):
    root, _, _ = chat_run
    rc, out, err = chat(root, [FIRST], capsys, monkeypatch, *flags)
    assert rc == 2 and out == "" and message in err and err.count("\n") == 1


def test_help_shows_an_example(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    out = capsys.readouterr().out
    assert "archlab chat runs/sft" in out and "/reset" in out


def plain_run(root):
    """A run trained without chat tokens: a byte tokenizer with <|endoftext|> and a 257-row vocabulary."""
    import archlab
    from archlab.runs.checkpoint import save_checkpoint
    from archlab.runs.model_folder import write_run_config
    from archlab.tokenizer import Tokenizer

    cfg = archlab.presets.tiny("llama2-7b").with_overrides({"vocab_size": 257, "max_seq_len": 128})
    write_run_config(root, cfg.to_dict(), {}, {})
    save_checkpoint(root / "checkpoints", 1, archlab.TransformerLM(cfg).state_dict(), {})
    Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(root / "tokenizer")
    return root


def test_the_hinted_plain_template_makes_a_trained_run_chat(tmp_path, capsys, monkeypatch):
    """The no-template error's command adds no token the model lacks; then each answer is generate's."""
    root = plain_run(tmp_path)
    rc, _, err = chat(root, [FIRST], capsys, monkeypatch)
    hint = err.split("`")[1].split()
    assert rc == 2 and hint[:3] == ["archlab", "tokenizer", "chat-template"]
    assert main(hint[1:]) == 0
    rc, out, err = chat(root, [FIRST, "and?"], capsys, monkeypatch)
    first = generated(root, render(root, [{"role": "user", "content": FIRST}]), capsys)[0]
    second = generated(root, render(root, [{"role": "user", "content": FIRST}, {"role": "assistant", "content": first},
                                           {"role": "user", "content": "and?"}]), capsys)[0]
    assert rc == 0 and err == "" and out == printed([first, second])


def _files(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_template_whose_tokens_the_model_lacks_is_one_line(tmp_path, capsys, monkeypatch):
    """`archlab tokenizer chat-template --format chatml` on a trained run's tokenizer would add ids past the
    model's vocabulary (the run could no longer chat or generate): refused before anything is written, naming
    the run and finetune, which grows the embedding. A tokenizer grown another way meets chat's own check, which
    names the numbers instead of failing inside the embedding."""
    from archlab.tokenizer.chat_builtin import install_chat_template

    plain_run(tmp_path)
    before = _files(tmp_path)
    capsys.readouterr()
    assert main(["tokenizer", "chat-template", str(tmp_path / "tokenizer"), "--format", "chatml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (f"{tmp_path / 'tokenizer'} is the tokenizer of the run {tmp_path}, made for 257 "
                                     "ids: --format chatml would add special tokens 257..258 past them") in err, err
    assert f"archlab finetune {tmp_path} --chat-template chatml" in err and _files(tmp_path) == before
    install_chat_template(tmp_path / "tokenizer", "chatml")
    rc, out, err = chat(tmp_path, [FIRST], capsys, monkeypatch)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "the tokenizer has 259 tokens but the model's vocabulary has 257" in err


def test_a_template_the_bound_vocabulary_has_room_for_is_written(tmp_path, capsys):
    """A run whose model has rows past its tokenizer (a padded vocabulary) takes the new tokens; a prepared data
    folder's tokenizer does not (its token files and meta.json were made for the vocabulary as it was)."""
    import archlab
    from archlab.data.prepare import prepare
    from archlab.runs.model_folder import write_run_config
    from archlab.tokenizer import Tokenizer

    cfg = archlab.presets.tiny("llama2-7b").with_overrides({"vocab_size": 264})
    (tmp_path / "run").mkdir()
    write_run_config(tmp_path / "run", cfg.to_dict(), {}, {})
    Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(tmp_path / "run" / "tokenizer")
    assert main(["tokenizer", "chat-template", str(tmp_path / "run" / "tokenizer"), "--format", "chatml"]) == 0
    Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"]).save(tmp_path / "tok")
    prepare(["some text to prepare"] * 4, str(tmp_path / "tok"), tmp_path / "data", num_workers=0, progress=False)
    before = _files(tmp_path / "data")
    capsys.readouterr()
    assert main(["tokenizer", "chat-template", str(tmp_path / "data" / "tokenizer"), "--format", "chatml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is the tokenizer of the data folder" in err and "made for 257 ids" in err, err
    assert _files(tmp_path / "data") == before


def test_chat_on_the_hf_export_equals_transformers(chat_run, tmp_path, capsys, monkeypatch):
    """The run exported as an HF folder (its template carried along): each answer equals transformers' greedy
    generate on AutoTokenizer.apply_chat_template of the same history, stopped at <|im_end|> / end-of-text."""
    transformers = pytest.importorskip("transformers")
    import torch

    root, _, _ = chat_run
    assert main(["convert", "--to-hf", str(root), "--out", str(tmp_path / "hf")]) == 0
    users = [FIRST, "and then?", "one more"]
    rc, out, _ = chat(tmp_path / "hf", users, capsys, monkeypatch)
    assert rc == 0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ends = [tok.convert_tokens_to_ids(END), tok.convert_tokens_to_ids("<|endoftext|>")]
    history, answers = [], []
    for user in users:
        history.append({"role": "user", "content": user})
        ids = tok.apply_chat_template(history, add_generation_prompt=True, return_dict=True,
                                      return_tensors="pt")["input_ids"]                   # (1, t)
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=int(N), do_sample=False, eos_token_id=ends,
                                 pad_token_id=ends[1])[0, ids.shape[1]:].tolist()
        answers.append(tok.decode([t for t in new if t not in ends]))
        history.append({"role": "assistant", "content": answers[-1]})
    assert out == printed(answers)
