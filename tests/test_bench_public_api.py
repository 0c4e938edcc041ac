"""The benchmarks use only phalanx's public API (issue 13 item 8), read from their source.

Public means a name in a package's ``__all__``, imported from the package itself
(``from phalanx.kvstore import DiskStore``), never from one of its modules
(``phalanx.kvstore.buffers``), however public that module's name looks: the modules
are free to move. tests/test_layers.py already refuses private modules, names and
attributes; this adds the ``__all__`` rule for the layer that sits above all others.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from click.testing import CliRunner

BENCH = Path(__file__).resolve().parent.parent / "src" / "phalanx_bench"


def _imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of every phalanx import, lazy ones included."""
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names
                    if a.name.split(".")[0] == "phalanx"]
        elif (isinstance(node, ast.ImportFrom) and not node.level and node.module
              and node.module.split(".")[0] == "phalanx"):
            out += [(node.lineno, node.module, a.name) for a in node.names]
    return out


def _not_public(path: Path) -> list[str]:
    bad = []
    for line, module, name in _imports(path):
        where = f"{path.name}:{line}"
        if name is None:
            bad.append(f"{where}: import {module} (import names from a package instead)")
            continue
        pkg = importlib.import_module(module)
        public = getattr(pkg, "__all__", None)
        if not hasattr(pkg, "__path__") or public is None:
            bad.append(f"{where}: from {module} import {name} ({module} is a module, not "
                       "a package with __all__)")
        elif name not in public:
            bad.append(f"{where}: from {module} import {name} (not in {module}.__all__)")
    return bad


def test_benchmarks_import_only_names_in_a_package_all() -> None:
    files = sorted(BENCH.rglob("*.py"))
    assert len(files) >= 8
    bad = [b for f in files for b in _not_public(f)]
    assert not bad, "benchmarks reaching past phalanx's public API:\n  " + "\n  ".join(bad)


def test_the_rule_catches_a_module_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from phalanx.kvstore.buffers import aligned_empty\n"
                     "from phalanx.kvstore import DiskStore\n"
                     "from phalanx.runtime import Worker, _context\n"
                     "import phalanx.replication.leader\n")
    bad = _not_public(probe)
    assert len(bad) == 3, bad
    assert "kvstore.buffers is a module" in bad[0]
    assert "not in phalanx.runtime.__all__" in bad[1]
    assert "import phalanx.replication.leader" in bad[2]


def test_the_lmcache_anchor_needs_no_phalanx() -> None:
    """It runs as a script in LMCache's venv, where phalanx is not installed."""
    anchor = BENCH / "anchors" / "lmcache_disk.py"
    tree = ast.parse(anchor.read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in mods if m.split(".")[0] in ("phalanx", "phalanx_bench")}


def test_every_benchmark_is_a_command() -> None:
    from phalanx_bench.cli import bench

    result = CliRunner().invoke(bench, ["--help"])
    assert result.exit_code == 0, result.output
    for name in ("worker", "rendezvous", "domains", "cache-disk", "replication"):
        assert name in result.output
        sub = CliRunner().invoke(bench, [name, "--help"])
        assert sub.exit_code == 0, (name, sub.output)
        assert "--json" in sub.output
