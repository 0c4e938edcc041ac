"""Every option of every ``phalanx`` command refuses a value it cannot use with one
clear error and exit code 2, before any work starts (no ranks, no server, no files).

The sweep walks the real command tree (the serve layer's commands and the
``phalanx.commands`` plugins, ``phalanx bench ...``) and gives each numeric option a
negative value and, where zero means nothing, zero; size and list options get text
that is not one. A command whose option slips through runs for real and fails some
other way (a traceback, exit 1): the issue-34 defect was ``phalanx cache maintain DIR
--tp 3 --max-age 0`` printing a rank task's traceback.
"""

from __future__ import annotations

import functools
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from phalanx.serve.cli._main import cli

# Numeric options where a negative value means something.
NEGATIVE_OK = {"--seed"}
# Numeric options where zero is a real setting (an ephemeral port, no settle time, ...).
ZERO_OK = NEGATIVE_OK | {"--port", "--node-rank", "--settle-s", "--request-interval-ms",
                         "--shutdown-timeout", "--max-waiting", "--reserve"}
# Text options that hold a size or a list: a value that is neither.
TEXT_BAD = {"--kv-cache-size": "12Q", "--prefix-cache-disk-size": "lots",
            "--large": "8by512", "--rows": "one,two", "--allreduce-bytes": "4k,x"}


@functools.cache
def _commands() -> list[tuple[list[str], click.Command]]:
    ctx = click.Context(cli)
    out: list[tuple[list[str], click.Command]] = []

    def walk(cmd: click.Command, path: list[str]) -> None:
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None
                walk(sub, [*path, name])
        else:
            out.append((path, cmd))

    walk(cli, [])
    return out


def _required(cmd: click.Command, tmp: Path) -> list[str]:
    """Values for a command's required arguments and options that let it reach the
    option under test (an existing directory, one rank, one record)."""
    args: list[str] = []
    for p in cmd.params:
        if isinstance(p, click.Argument) and p.required:
            args.append(str(tmp))
        elif isinstance(p, click.Option) and p.required:
            args += [p.opts[0], "1"]
    return args


def _cases() -> list[tuple[str, list[str], str, str]]:
    cases = []
    for path, cmd in _commands():
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.is_flag:
                continue
            opt = p.opts[-1] if p.opts[-1].startswith("--") else p.opts[0]
            name = " ".join(path)
            if isinstance(p.type, (click.types.IntParamType, click.types.FloatParamType)):
                if opt not in NEGATIVE_OK:
                    cases.append((name, path, opt, "-5"))
                if opt not in ZERO_OK:
                    cases.append((name, path, opt, "0"))
            elif opt in TEXT_BAD:
                cases.append((name, path, opt, TEXT_BAD[opt]))
    return cases


@pytest.mark.parametrize(("name", "path", "opt", "value"),
                         [pytest.param(*c, id=f"{c[0]} {c[2]}={c[3]}") for c in _cases()])
def test_a_bad_option_is_one_line_and_exit_2(name: str, path: list[str], opt: str,
                                             value: str, tmp_path: Path) -> None:
    cmd = dict((" ".join(p), c) for p, c in _commands())[name]
    args = [*path, *_required(cmd, tmp_path), f"{opt}={value}"]
    result = CliRunner().invoke(cli, args)
    text = result.output
    assert result.exit_code == 2, (f"phalanx {' '.join(args)} exited {result.exit_code}: "
                                   f"{text[-600:]!r} {result.exception!r}")
    assert "Traceback" not in text
    assert opt in text, f"the error does not name {opt}: {text!r}"
    assert list(tmp_path.iterdir()) == [], "the command wrote before it refused"


def test_the_sweep_reaches_every_command() -> None:
    names = {" ".join(p) for p, _ in _commands()}
    assert {"serve", "cache maintain", "cache synth", "model init", "doctor", "demo",
            "bench llamacpp", "bench engine"} <= names
    swept = {c[0] for c in _cases()}
    assert "cache maintain" in swept and "serve" in swept
