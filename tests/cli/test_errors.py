"""The CLI's one error path: user errors are one line + exit 2, bugs keep their traceback."""
from __future__ import annotations

import errno

import pytest

from archlab import cli
from archlab.config import ConfigError
from archlab.errors import UserError, is_user_error, one_line, report


def test_library_errors_are_user_errors():
    from archlab.data.corpora import CorpusError
    from archlab.errors import DataError
    from archlab.runs.checkpoint import CheckpointError
    for cls in (ConfigError, CheckpointError, CorpusError, DataError):
        assert issubclass(cls, UserError)
        assert is_user_error(cls("x"))


def test_os_errors_from_the_environment_are_user_errors():
    assert is_user_error(OSError(errno.ENOSPC, "No space left on device", "/tmp/x"))
    assert is_user_error(PermissionError(errno.EACCES, "Permission denied", "/ro"))
    assert not is_user_error(OSError(errno.EIO, "I/O error"))
    assert not is_user_error(KeyError("bug"))


def test_one_line_folds_newlines_and_names_the_file():
    assert one_line(UserError("a\n  b")) == "a b"
    assert one_line(FileNotFoundError(errno.ENOENT, "No such file or directory", "x.yaml")) == \
        "x.yaml: No such file or directory"


def test_user_error_prints_one_line_and_exits_2(capsys, monkeypatch):
    monkeypatch.delenv("ARCHLAB_DEBUG", raising=False)
    assert report(ConfigError("n_layers=0 must be positive"), "archlab train") == 2
    err = capsys.readouterr().err
    assert err == "archlab train: error: n_layers=0 must be positive\n"


def test_debug_shows_the_traceback(capsys, monkeypatch):
    monkeypatch.setenv("ARCHLAB_DEBUG", "1")
    try:
        raise ConfigError("boom")
    except ConfigError as exc:
        assert report(exc) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith("archlab: error: boom")


def test_a_bug_keeps_its_traceback_and_asks_for_a_report(capsys, monkeypatch):
    def broken(args):
        raise KeyError("internal")
    monkeypatch.setattr(cli, "build_parser", _parser_with(broken))
    assert cli.main(["boom"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError" in err and "please report it" in err


def test_main_routes_user_errors_through_one_line(capsys, monkeypatch):
    def bad(args):
        raise UserError("the thing is wrong")
    monkeypatch.setattr(cli, "build_parser", _parser_with(bad))
    assert cli.main(["boom"]) == 2
    assert capsys.readouterr().err == "archlab boom: error: the thing is wrong\n"


def _parser_with(func):
    import argparse

    def build():
        parser = argparse.ArgumentParser(prog="archlab")
        sub = parser.add_subparsers(dest="command")
        sub.add_parser("boom").set_defaults(func=func)
        return parser
    return build


@pytest.mark.parametrize("argv", [["train", "--preset", "no-such-preset", "--data", "x", "--out", "y"]])
def test_cli_user_mistake_exits_2_without_traceback(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        raise SystemExit(cli.main(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---- no network: one line, exit 2 ----------------------------------------------------------------
def _network_errors():
    errors = [ConnectionError("Couldn't reach 'Rowan/hellaswag' on the Hub (OfflineModeIsEnabled)")]
    try:
        import requests
        errors.append(requests.exceptions.ConnectionError("Max retries exceeded with url: /datasets"))
    except ImportError:
        pass
    try:
        import httpx
        errors.append(httpx.ConnectError("[Errno -3] Temporary failure in name resolution"))
    except ImportError:
        pass
    return errors


@pytest.mark.parametrize("exc", _network_errors(), ids=lambda e: type(e).__module__ + "." + type(e).__name__)
def test_no_network_is_a_user_error(exc):
    assert is_user_error(exc)
    assert not is_user_error(BrokenPipeError(errno.EPIPE, "Broken pipe"))


@pytest.mark.parametrize("exc", _network_errors(), ids=lambda e: type(e).__module__ + "." + type(e).__name__)
def test_eval_tasks_offline_names_the_dataset_in_one_line(exc, capsys, monkeypatch):
    """The harness loads a hub task's dataset through `datasets`, which raises ConnectionError offline (and
    with HF_DATASETS_OFFLINE=1); simulated here, so the test never reaches the network."""
    pytest.importorskip("lm_eval")
    import archlab.eval.lmeval as lmeval
    from archlab.runs import model_folder

    def offline(*args, **kwargs):
        raise exc
    monkeypatch.delenv("ARCHLAB_DEBUG", raising=False)
    monkeypatch.setattr(lmeval, "run_tasks", offline)
    monkeypatch.setattr(model_folder, "load_model_and_tokenizer", lambda *a, **k: (None, None))
    assert cli.main(["eval", "some-run", "--tasks", "hellaswag"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("archlab eval: error: --tasks hellaswag: the task's dataset needs the network")
    assert str(exc).split()[0] in err


@pytest.mark.slow
def test_eval_hub_task_with_hf_datasets_offline_is_one_line(tmp_path):
    """The real harness and datasets with HF_DATASETS_OFFLINE=1 (no network reached), in a fresh process so
    that the offline switches are read at import."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("lm_eval")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "ARCHLAB_DEBUG": ""}
    run = Path(__file__).parents[1] / "fixtures" / "run_v1"
    proc = subprocess.run([sys.executable, "-m", "archlab.cli", "eval", str(run), "--tasks", "hellaswag",
                           "--limit", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "hellaswag" in proc.stderr and "network" in proc.stderr


# ---- a reader that leaves early (`archlab presets | head`) ----------------------------------------
@pytest.mark.parametrize("argv", [["presets"], ["tokenizer", "stats", "{tmp}/tok", "--input", "{tmp}/text.txt"]],
                         ids=["presets", "tokenizer stats"])
def test_a_closed_pipe_ends_quietly_with_141(argv, tmp_path):
    import os
    import subprocess
    import sys

    if "stats" in argv:
        (tmp_path / "text.txt").write_text("to be or not to be, that is the question. " * 50)
        assert cli.main(["tokenizer", "train", "--input", str(tmp_path / "text.txt"), "--vocab-size", "270",
                         "--no-progress", "--workers", "1", "--out", str(tmp_path / "tok")]) == 0
    read_end, write_end = os.pipe()
    os.close(read_end)                # the reader has left before the first line
    try:
        proc = subprocess.run([sys.executable, "-m", "archlab.cli", *[a.format(tmp=tmp_path) for a in argv]],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""


# ---- a write that hits a file-size limit or a full disk --------------------------------------------
def test_os_errors_of_raises_the_os_error_a_library_names_in_its_message():
    from archlab.errors import os_errors_of

    with pytest.raises(OSError) as info:
        with os_errors_of("/out/model.safetensors"):
            raise RuntimeError("Error while serializing: I/O error: File too large (os error 27)")
    assert info.value.errno == errno.EFBIG and info.value.filename == "/out/model.safetensors"
    assert is_user_error(info.value)
    assert one_line(info.value) == ("/out/model.safetensors: File too large (a file-size limit (ulimit -f) or the "
                                    "file system's largest file)")
    with pytest.raises(RuntimeError, match="a bug"):       # anything else passes through untouched
        with os_errors_of("/out/x"):
            raise RuntimeError("a bug")


def test_convert_under_a_file_size_limit_is_one_line_and_leaves_nothing(tmp_path):
    """A real RLIMIT_FSIZE (Python ignores SIGXFSZ, so the write fails with EFBIG): safetensors' error becomes
    the OSError, one line, exit 2, and the output folder is never created."""
    import os
    import resource
    import subprocess
    import sys
    from pathlib import Path

    run = Path(__file__).parents[1] / "fixtures" / "run_v1"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (16_384, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    proc = subprocess.run([sys.executable, "-m", "archlab.cli", "convert", "--to-hf", str(run), "--out",
                           str(tmp_path / "hf")], capture_output=True, text=True, preexec_fn=limit, timeout=120,
                          env={**os.environ, "ARCHLAB_DEBUG": ""})
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "File too large (a file-size limit" in proc.stderr, proc.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("argv, prog", [
    (["generate", "RUN", "--bogus"], "archlab generate"),
    (["finetune", "RUN", "--data", "d.jsonl", "--out", "o", "--text", "t.txt"], "archlab finetune"),
    (["tokenizer", "train", "--input", "x", "--out", "o", "--vocab-size", "300", "--bogus", "1"],
     "archlab tokenizer train"),
])
def test_an_unknown_option_is_named_by_the_subcommand_given(argv, prog, capsys):
    # argparse reports leftovers from the top parser: "archlab: error: ... (see archlab --help)" sent the user to
    # the list of commands instead of the command they typed
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: unrecognized arguments: ") and err.count("\n") == 1, err
    assert err.rstrip().endswith(f"(see {prog} --help)"), err
