"""Tasks defined where users write them: __main__ of a script, stdin, closures, lambdas."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import phalanx

_SCRIPT = textwrap.dedent("""
    import phalanx
    OFFSET = 5
    def helper(x):
        return x + OFFSET
    def make_adder(k):
        return lambda x: helper(x) * k
    def orch(o):
        add3 = make_adder(3)
        return [o.submit(r, add3, r).result() for r in o.ranks]
    if __name__ == "__main__":
        with phalanx.Worker(ranks=2) as w:
            print(w.run(orch))
""")


def test_script_main_functions(tmp_path: object) -> None:
    import pathlib

    path = pathlib.Path(str(tmp_path)) / "job.py"
    path.write_text(_SCRIPT)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[15, 18]"


def test_script_read_from_stdin() -> None:
    out = subprocess.run([sys.executable, "-"], input=_SCRIPT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[15, 18]"


def test_closure_and_lambda_in_a_test_module() -> None:
    base = 100
    with phalanx.Worker(ranks=1) as w:
        assert w.run(lambda o: o.submit(0, lambda: base + 1).result()) == 101
