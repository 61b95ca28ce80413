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
