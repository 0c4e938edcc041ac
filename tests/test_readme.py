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
    assert blocks[0].startswith("python3.11 -m venv .venv")
    assert blocks[0].endswith(".venv/bin/phalanx serve")
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


def _python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    parts = text.split("```python")[1:]
    return [p[: p.index("```")] for p in parts]


# What a README example prints, where it says so (a substring of the block -> output).
_EXPECTED = {
    "worker.run(with_domain)": "(b'hello', array([2., 2., 2., 2.]))",
    "DiskStore(d, geom": "4 True",
    "ReplicatedCache.open": "3 [0, 1, 2]",
    "LLM(tensor_parallel_size=2": "8 length",
    "MultiHostWorker(spec": "[6, 24]",
}
_LOCAL = [b for b in _python_blocks() if "127.0.0.1:8000" not in b]
# the same for the server examples beyond the first
_SERVER_EXPECTED = {"n=4, temperature=0.8": "[0, 1, 2, 3]", "response_format=Answer": "Answer",
                    'tool_choice="required"': "tool_calls get_weather {"}


@pytest.mark.parametrize("code", _LOCAL, ids=[f"example-{i}" for i in range(len(_LOCAL))])
def test_readme_python_examples_run(code: str, tmp_path: pathlib.Path) -> None:
    import os

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    for marker, expected in _EXPECTED.items():
        if marker in code:
            assert expected in out.stdout, out.stdout


def test_every_readme_example_is_covered() -> None:
    blocks = _python_blocks()
    assert len(blocks) >= 5, "the README's Python examples went missing"
    for marker in _EXPECTED:
        assert any(marker in b for b in blocks), f"no README example has {marker!r}"


def test_readme_server_examples_run(tmp_path: pathlib.Path) -> None:
    """The curl and openai examples against a real `phalanx serve` (its URL put in place
    of the README's default address)."""
    from serve_util import Server, model_env

    text = (ROOT / "README.md").read_text()
    start = text.index("```sh", text.index("## The server")) + len("```sh")
    curl = text[start:text.index("```", start)]
    client, *more = [b for b in _python_blocks() if "127.0.0.1:8000" in b]
    s = Server("--tp", "2", "--prefix-cache-disk", str(tmp_path / "disk"),
               env=model_env(tmp_path))
    try:
        out = subprocess.run(["bash", "-c", curl.replace("http://127.0.0.1:8000", s.url)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert '"text_completion"' in out.stdout and '"cached_tokens"' in out.stdout
        out = subprocess.run([sys.executable, "-"], capture_output=True, text=True,
                             input=client.replace("http://127.0.0.1:8000", s.url),
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == "0"  # nothing cached yet
        for block in more:  # the others: each runs, and prints what it says it prints
            out = subprocess.run([sys.executable, "-"], capture_output=True, text=True,
                                 input=block.replace("http://127.0.0.1:8000", s.url),
                                 timeout=120)
            assert out.returncode == 0, out.stderr
            for marker, expected in _SERVER_EXPECTED.items():
                if marker in block:
                    assert expected in out.stdout, out.stdout
    finally:
        assert s.stop() == 0
