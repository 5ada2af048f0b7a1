"""The ``llm-serving`` command registers its subcommands (generate, serve, bench, profile, simulate, tune, ...)."""

from __future__ import annotations

import pytest

from llm_serving.cli.main import main


def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("generate", "serve", "bench", "profile", "simulate", "tune"):
        assert name in out


def test_bench_subcommand_takes_the_contest_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("-X", "-P", "-O", "-T", "--endpoint"):
        assert flag in out
