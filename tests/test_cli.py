"""cli: the parser has every command group, exit statuses are 0 / 1 (a RelibraError) / 2 (no command)."""

from __future__ import annotations

import pytest

from relibra_moe.cli import build_parser, main
from relibra_moe.commands import COMMAND_MODULES


def test_every_command_group_registers():
    sub = build_parser()._subparsers._group_actions[0].choices
    for name in ("demo", "trace", "plan", "score", "simulate", "compare", "calibrate"):
        assert name in sub, name
    assert len(COMMAND_MODULES) >= 6


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage: relibra" in capsys.readouterr().out


def test_bad_arguments_are_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "t.npz", "--model", "gpt-oss-20b", "--nodes", "1", "--strategy", "nope", "--out", "p.npz"])
    assert exc.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_a_relibra_error_is_exit_1_with_the_command_and_type(tmp_path, capsys):
    trace = tmp_path / "missing.npz"
    status = main(["plan", str(trace), "--model", "gpt-oss-20b", "--nodes", "1", "--strategy", "static",
                   "--out", str(tmp_path / "p.npz")])
    err = capsys.readouterr().err
    assert status == 1
    assert err.startswith("relibra plan: error: TraceError: ") and "missing.npz" in err
    assert not (tmp_path / "p.npz").exists()


def test_a_command_returns_its_status(capsys):
    assert main(["demo", "--list"]) == 0
    assert "qwen3" in capsys.readouterr().out
