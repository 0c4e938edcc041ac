"""The engine's own layers (docs/design.md, "The engine's layers"), pinned by reading
every engine module's imports with ``ast``: lazy ones and those under ``TYPE_CHECKING``
included.

Bottom to top: ``_errors``; ``model/`` (config, weights, layers, tokenizers); ``core/``
(scheduler, KV pages, sequences, the step plan, sampling parameters, outputs, the
engine loop and the executor protocol it drives); ``disk/`` (the disk tier: the
scheduler's side, rank 0's functions, each rank's staging); ``worker/`` (the runner,
TP communicators, devices, the rank-side entry points, the one-host executor);
``multihost/`` (the several-hosts executor, host domains, the hosts' disk cache); and
the top: ``Engine`` (which composes them), ``LLM`` and the package's exports.

Three rules:

* **No import upwards** within the engine: ``core/`` imports neither ``worker/`` nor
  ``disk/``, ``model/`` imports nothing above it.
* **No import cycles** among the engine's modules.
* **Imports at the top.** An import inside a function is there only to keep torch
  lazy: what it imports is torch or a module that imports torch when it loads.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ENGINE = SRC / "phalanx" / "engine"

LEVEL = {"_errors": 0, "model": 1, "core": 2, "disk": 3, "worker": 4, "multihost": 5,
         "top": 6}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))
           if p.relative_to(SRC).parts[0] == "phalanx"}
ENGINE_MODULES = {n: p for n, p in MODULES.items() if n.startswith("phalanx.engine")}


def sublayer(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 3:
        return "top"
    return parts[2] if parts[2] in LEVEL else "top"


def _absolute(name: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _resolve(module: str) -> str:
    """The module a dotted import target lives in (``a.b.C`` -> ``a.b``)."""
    while module and module not in MODULES and "." in module:
        module = module.rpartition(".")[0]
    return module


TOP, LAZY, TYPING = "top", "lazy", "typing"


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(name: str, path: Path, text: str | None = None) -> list[tuple[str, str]]:
    """(module imported, where: TOP, LAZY inside a function, TYPING under
    ``TYPE_CHECKING``) for every import of the module."""
    tree = ast.parse(path.read_text() if text is None else text, str(path))
    out: list[tuple[str, str]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) and where == TOP:
                inner = LAZY
            elif _is_type_checking(child):
                inner = TYPING
            if isinstance(child, ast.Import):
                out.extend((a.name, where) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _absolute(name, path, child)
                for a in child.names:
                    full = f"{base}.{a.name}"
                    out.append((full if full in MODULES else base, where))
            visit(child, inner)

    visit(tree, TOP)
    return out


def _top_level_imports(name: str) -> set[str]:
    return {_resolve(m) for m, where in _imports(name, MODULES[name]) if where == TOP}


@functools.cache
def loads_torch(module: str) -> bool:
    """Whether importing ``module`` imports torch (through its top-level imports)."""
    if module == "torch" or module.startswith("torch."):
        return True
    if module not in MODULES:
        return False
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for dep in _top_level_imports(m):
            if dep == "torch" or dep.startswith("torch."):
                return True
            if dep in MODULES:
                todo.append(dep)
                # a package's __init__ runs before any of its modules
                parent = dep.rpartition(".")[0]
                while parent in MODULES:
                    todo.append(parent)
                    parent = parent.rpartition(".")[0]
    return False


def upward(name: str, path: Path, text: str | None = None) -> set[str]:
    found = set()
    src = sublayer(name)
    for module, _ in _imports(name, path, text):
        module = _resolve(module)
        if not module.startswith("phalanx.engine") or module == "phalanx.engine":
            continue
        dst = sublayer(module)
        if LEVEL[dst] > LEVEL[src]:
            found.add(f"{name} -> {module} ({src} imports {dst})")
    return found


def lazy_without_torch(name: str, path: Path, text: str | None = None) -> set[str]:
    found = set()
    for module, where in _imports(name, path, text):
        if where == LAZY and not loads_torch(_resolve(module)):
            found.add(f"{name}: imports {module} inside a function (it does not load "
                      f"torch: import it at the top)")
    return found


def test_the_engine_has_its_layers() -> None:
    subpackages = {p.name for p in ENGINE.iterdir() if (p / "__init__.py").exists()}
    assert subpackages == {"model", "core", "disk", "worker", "multihost"}
    # no flat module beside the layers but the composition, LLM and the errors
    flat = {p.stem for p in ENGINE.glob("*.py")}
    assert flat == {"__init__", "_errors", "engine", "llm"}, flat


def test_no_engine_module_imports_upwards() -> None:
    found = set().union(*(upward(n, p) for n, p in ENGINE_MODULES.items()))
    assert not found, "\n".join(sorted(found))


def test_core_imports_neither_worker_nor_disk() -> None:
    core = {n: p for n, p in ENGINE_MODULES.items() if sublayer(n) == "core"}
    assert len(core) >= 8
    for name, path in core.items():
        for module, _ in _imports(name, path):
            assert not module.startswith(("phalanx.engine.worker", "phalanx.engine.disk",
                                          "phalanx.engine.multihost")), (name, module)


def test_no_import_cycles_in_the_engine() -> None:
    # what runs: imports under TYPE_CHECKING never do
    graph = {n: {_resolve(m) for m, where in _imports(n, p) if where != TYPING}
             & set(ENGINE_MODULES) for n, p in ENGINE_MODULES.items()}
    # a package's __init__ re-exporting its modules is not a cycle with them
    for n in graph:
        graph[n] = {m for m in graph[n] if not n.startswith(m + ".") and m != n}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def walk(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append([*stack[stack.index(m):], m])
            elif m not in state:
                walk(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            walk(n)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_function_local_imports_only_keep_torch_lazy() -> None:
    found = set().union(*(lazy_without_torch(n, p) for n, p in ENGINE_MODULES.items()))
    assert not found, "\n".join(sorted(found))


def test_the_engine_imports_without_torch() -> None:
    """The package and its parent-side modules load without torch (docs/architecture.md)."""
    for name in ("phalanx.engine", "phalanx.engine.engine", "phalanx.engine.llm",
                 "phalanx.engine.core.loop", "phalanx.engine.worker.local",
                 "phalanx.engine.worker.rank", "phalanx.engine.multihost.executor",
                 "phalanx.engine.disk.tier", "phalanx.engine.disk.staging",
                 # what the parent reads a model's config, tokenizer and digest with
                 "phalanx.engine.model.config", "phalanx.engine.model.gguf_model",
                 "phalanx.engine.model.tokenizer", "phalanx.engine.model.fingerprint"):
        assert not loads_torch(name), name


def test_the_rules_catch_what_they_must() -> None:
    probe = ENGINE / "core" / "probe.py"
    assert upward("phalanx.engine.core.probe", probe,
                  "def f():\n    from ..worker.runner import Runner\n") == {
        "phalanx.engine.core.probe -> phalanx.engine.worker.runner (core imports worker)"}
    assert upward("phalanx.engine.core.probe", probe,
                  "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                  "    from ..disk.tier import DiskTier\n") == {
        "phalanx.engine.core.probe -> phalanx.engine.disk.tier (core imports disk)"}
    assert upward("phalanx.engine.core.probe", probe, "from ..model.config import x\n") == set()
    assert lazy_without_torch("phalanx.engine.core.probe", probe,
                              "def f():\n    import json\n") != set()
    assert lazy_without_torch("phalanx.engine.core.probe", probe,
                              "def f():\n    import torch\n"
                              "    from ..model.transformer import CausalLM\n") == set()
    assert loads_torch("phalanx.engine.model.transformer")
    assert not loads_torch("phalanx.engine.core.scheduler")
