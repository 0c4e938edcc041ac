"""The README's set-up commands are the ones CI runs, and the CLI answers."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _code_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    parts = text.split("```")
    return [parts[i].strip() for i in range(1, len(parts), 2)]


def test_readme_starts_with_the_two_setup_commands() -> None:
    blocks = _code_blocks()
    assert blocks[0].startswith("python3.11 -m venv .venv") and "phalanx" in blocks[0]
    assert blocks[1].startswith("python3.11 -m venv .venv") and "pytest" in blocks[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert _code_blocks()[1] in ci


def test_cli_help_and_version() -> None:
    exe = [sys.executable, "-m", "phalanx.serve.cli._main"]
    out = subprocess.run([*exe, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "0.1.0" in out.stdout
    out = subprocess.run([*exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "demo" in out.stdout


def test_demo_runs() -> None:
    exe = [sys.executable, "-m", "phalanx.serve.cli._main", "demo", "--ranks", "2"]
    out = subprocess.run(exe, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rank 1" in out.stdout and "closed" in out.stdout


@pytest.mark.parametrize(("section", "expected"), [
    ("## Python API", "(b'hello', array([2., 2., 2., 2.]))"),
    ("## Prefix cache on one rank", "4 True"),
])
def test_readme_python_examples_run(section: str, expected: str) -> None:
    text = (ROOT / "README.md").read_text()
    start = text.index("```python", text.index(section)) + len("```python")
    code = text[start:text.index("```", start)]
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout
