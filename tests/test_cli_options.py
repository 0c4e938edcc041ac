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

import errno
import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
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


# -- an unwritable --prefix-cache-disk (issue 45): one line, exit 2, before any rank ----

@pytest.fixture
def immutable_rank_dir(tmp_path: Path) -> Iterator[Path]:
    """DIR whose DIR/rank-0 no one may write: ``chattr +i`` as root (root ignores mode
    bits), mode 0500 otherwise. The defect: a 79-line traceback from rank 0's store."""
    rank0 = tmp_path / "disk" / "rank-0"
    rank0.mkdir(parents=True)
    if os.geteuid() != 0:
        rank0.chmod(0o500)
        yield rank0.parent
        rank0.chmod(0o700)
        return
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(rank0)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        yield rank0.parent
    finally:
        subprocess.run(["chattr", "-i", str(rank0)], check=True)


def _serve(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The installed command (``python -m`` adds runpy's warning line to stderr)."""
    phalanx = str(Path(sys.executable).parent / "phalanx")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "home")}
    return subprocess.run([phalanx, "serve", "--port", "0", "--tp", "2", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def _assert_one_line_naming(done: subprocess.CompletedProcess[str], path: str) -> None:
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].strip(), done.stderr
    assert path in lines[0] and "errno" in lines[0], lines[0]
    assert "--no-prefix-cache-disk" in lines[0], lines[0]


def test_serve_refuses_a_read_only_rank_dir_in_one_line(immutable_rank_dir: Path,
                                                        tmp_path: Path) -> None:
    done = _serve(tmp_path, "--prefix-cache-disk", str(immutable_rank_dir))
    _assert_one_line_naming(done, str(immutable_rank_dir / "rank-0"))


@pytest.mark.parametrize("where", ["file-as-rank-dir", "under-proc"])
def test_serve_refuses_a_disk_dir_it_cannot_create_in_one_line(where: str,
                                                               tmp_path: Path) -> None:
    if where == "under-proc":
        disk = Path("/proc/phalanx-no-such-dir")
        named = str(disk)
    else:
        disk = tmp_path / "disk"
        disk.mkdir()
        (disk / "rank-1").write_text("not a directory")
        named = str(disk / "rank-1")
    done = _serve(tmp_path, "--prefix-cache-disk", str(disk))
    _assert_one_line_naming(done, named)


def test_a_disk_error_at_engine_start_is_the_same_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The up-front check passed, then a rank's store failed to open (the directory
    changed meanwhile): the engine's OSError is the same one line, not a traceback."""
    import phalanx.serve.server as server

    lock = tmp_path / "disk" / "rank-0" / ".lock"

    def failing_start(cfg: server.ServerConfig, **_: object) -> int:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(lock))

    monkeypatch.setattr(server, "run_server", failing_start)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))  # the embedded model
    res = CliRunner().invoke(cli, ["serve", "--prefix-cache-disk", str(tmp_path / "disk")])
    assert res.exit_code == 2, (res.output, res.exception)
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and str(lock) in lines[0], res.output
    assert "errno 13, Permission denied" in lines[0], lines[0]


# -- a directory of another model: one line, exit 2; the default is one per model --------

def test_serve_refuses_another_models_directory_in_one_line(tmp_path: Path) -> None:
    """A store refuses a directory written for another model (its manifest's
    fingerprint): before, a 40-line traceback of rank 0's and the parent's."""
    from phalanx.engine.disk.identity import cache_identity
    from phalanx.engine.model.default_model import default_model_dir
    from phalanx.kvstore.manifest import check_or_create

    geometry, _ = cache_identity(default_model_dir(), 2)
    disk = tmp_path / "disk"
    for r in (0, 1):
        (disk / f"rank-{r}").mkdir(parents=True)
        check_or_create(str(disk / f"rank-{r}"), geometry, bytes(16))  # another model's
    done = _serve(tmp_path, "--prefix-cache-disk", str(disk))
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(disk) in lines[0], done.stderr
    assert "belongs to model fingerprint " + "00" * 16 in lines[0], lines[0]


def test_the_default_disk_dir_is_one_per_model_and_tp(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.serve.server import default_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a, b = tmp_path / "models" / "a", tmp_path / "models" / "b"
    dirs = {default_cache_dir(a, 2), default_cache_dir(b, 2), default_cache_dir(a, 3)}
    assert len(dirs) == 3
    assert all(d.parent == tmp_path / "phalanx" / "prefix-cache" for d in dirs)
    assert default_cache_dir(a, 2) == default_cache_dir(str(a) + "/", 2)  # the same path
    assert default_cache_dir(a, 2).name.startswith("a-tp2-")
