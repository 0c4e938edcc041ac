"""The layering of docs/architecture.md "Layers", pinned by reading every module's imports.

Every ``import`` and ``from ... import`` of every module under src/ is parsed with
``ast``, those inside functions (lazy imports) and under ``TYPE_CHECKING`` included, as
is every attribute reached, and two rules are checked:

* **No import upwards.** A module imports only its own package and the layers below it.
  kvstore and rendezvous share a level and must not import each other.
* **No private module or name of another package.** ``phalanx.runtime._context``, or
  ``_call_ranks`` reached on another layer's object, is private to ``phalanx.runtime``;
  what another layer needs is exported publicly. The one exception is
  :mod:`phalanx.errors`, whose job is to re-export every layer's ``_errors`` module. A
  third party's private module (``torch._C``) is imported only by a benchmark anchor
  (``phalanx_bench.anchors``), which says why.

Today's violations in areas other engineers are rewriting are allowed below, each with
who removes it. A new violation fails; so does an allowed one that no longer occurs
(delete its line).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# Bottom to top. Equal levels are peers that must not import each other. "surface" is
# the top-level package (``phalanx/__init__.py``) and ``phalanx.errors``: they gather the
# layers' public names, so they sit above every layer they gather and below the CLI.
LEVEL = {
    "lifecycle": 0,
    "kvstore": 1,
    "rendezvous": 1,
    "runtime": 2,
    "comm": 3,
    "hosts": 4,  # issue 16: each host runs a comm Worker; a peer of replication
    "replication": 4,
    "engine": 5,
    "surface": 6,
    "serve": 7,
    "bench": 8,
}

# Violations that exist today, each removed by the engineer named (issue 13).
ALLOWED: dict[str, str] = {}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool

    @property
    def package(self) -> str:
        return package_of(self.name)


def package_of(module: str) -> str:
    """The package that owns a module: ``phalanx.kvstore``, ``phalanx``, ``phalanx_bench``."""
    parts = module.split(".")
    if parts[0] == "phalanx" and len(parts) > 1 and parts[1] in LEVEL:
        return ".".join(parts[:2])
    return parts[0]


def _modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[0] not in ("phalanx", "phalanx_bench"):
            continue
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        name = ".".join(parts)
        found[name] = Module(name, path, is_package)
    return found


MODULES = _modules()


def _private_names_defined(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, variables, attributes, slots."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)  # __slots__ entries, getattr names
    return {name for name in out if _private(name)}


@functools.cache
def _defined_by_package() -> dict[str, set[str]]:
    defined: dict[str, set[str]] = {}
    for m in MODULES.values():
        names = _private_names_defined(ast.parse(m.path.read_text(), str(m.path)))
        defined.setdefault(m.package, set()).update(names)
    return defined


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "phalanx_bench":
        return "bench"
    if len(parts) == 1 or parts[1] == "errors":
        return "surface"
    return parts[1]


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _absolute(source: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = source.name.split(".")
    if not source.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_ours(module: str) -> bool:
    return module.split(".")[0] in ("phalanx", "phalanx_bench")


def _targets(source: Module, tree: ast.Module) -> list[tuple[str, str | None]]:
    """(module, name imported from it or None) for each import, wherever it is."""
    targets: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.extend((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(source, node)
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:  # ``from phalanx.runtime import _context``
                    targets.append((f"{base}.{a.name}", None))
                else:
                    targets.append((base, a.name))
    return targets


def _violations_of(source: Module, text: str | None = None) -> set[str]:
    text = source.path.read_text() if text is None else text
    tree = ast.parse(text, str(source.path))
    targets = _targets(source, tree)
    found: set[str] = set()
    src_layer = layer_of(source.name)
    for module, name in targets:
        if not _is_ours(module):
            # A third party's internals only in a benchmark anchor, which says why.
            private = any(_private(p) for p in module.split(".")) or (
                name is not None and _private(name))
            if private and not source.name.startswith("phalanx_bench.anchors"):
                found.add(f"{source.name} -> {module}{'.' + name if name else ''} "
                          f"(a third party's private module)")
            continue
        foreign = package_of(module) != source.package
        dst_layer = layer_of(module)
        if foreign and LEVEL[dst_layer] >= LEVEL[src_layer]:
            found.add(f"{source.name} -> {module} (upward: {src_layer} imports {dst_layer})")
        private_part = next((p for p in module.split(".") if _private(p)), None)
        errors_module = source.name == "phalanx.errors" and module.endswith("._errors")
        if foreign and private_part is not None and not errors_module:
            found.add(f"{source.name} -> {module} (private)")
        if foreign and name is not None and _private(name):
            found.add(f"{source.name} -> {module}.{name} (private)")
    # A private attribute that only other packages define (the key leaves out which,
    # so a third package defining the same name does not change it): ``self.worker._call_ranks``
    # on another layer's object, or ``self._run`` inherited from another layer's class.
    # (Private names of the standard library or third parties, such as os._exit, are
    # defined by no package here and are not this rule's business.)
    defined = _defined_by_package()
    own = defined.get(source.package, set()) | _private_names_defined(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own
                and any(node.attr in names for names in defined.values())):
            found.add(f"{source.name} -> {ast.unparse(node)} (private attribute)")
    return found


def violations() -> set[str]:
    found: set[str] = set()
    for module in MODULES.values():
        found |= _violations_of(module)
    return found


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in (SRC / "phalanx").iterdir()
                if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LEVEL), f"packages without a layer: {sorted(packages - set(LEVEL))}"
    assert len(MODULES) > 50


def test_no_new_layering_violation() -> None:
    new = sorted(violations() - set(ALLOWED))
    assert not new, (
        "layering violations (docs/architecture.md, Layers): export what is needed "
        "publicly from the lower layer, or move the code:\n  " + "\n  ".join(new))


def test_allowed_violations_still_exist() -> None:
    gone = sorted(set(ALLOWED) - violations())
    assert not gone, ("allowed violations that no longer occur: delete them from ALLOWED "
                      "in tests/test_layers.py:\n  " + "\n  ".join(gone))


def _check(name: str, text: str) -> set[str]:
    """The rules applied to a made-up module ``name`` with this source text."""
    return _violations_of(Module(name, SRC / "probe.py", is_package=False), text)


def test_the_rules_catch_what_they_must() -> None:
    """The checker itself: each kind of violation is seen, lazy imports included."""
    assert _check("phalanx.kvstore.probe", "def f():\n    import phalanx.rendezvous\n") == {
        "phalanx.kvstore.probe -> phalanx.rendezvous (upward: kvstore imports rendezvous)"}
    assert _check("phalanx.runtime.probe", "from phalanx.comm import Domain\n") == {
        "phalanx.runtime.probe -> phalanx.comm (upward: runtime imports comm)"}
    assert _check("phalanx.comm.probe", "from phalanx.runtime import _context\n") == {
        "phalanx.comm.probe -> phalanx.runtime._context (private)"}
    # (the private names probed are lifecycle.failpoints' own: they stay put)
    assert _check("phalanx.comm.probe",
                  "from phalanx.lifecycle.failpoints import _maybe_fire\n") == {
        "phalanx.comm.probe -> phalanx.lifecycle.failpoints._maybe_fire (private)"}
    assert _check("phalanx.comm.probe",
                  "from phalanx.lifecycle import failpoints\nx = failpoints._DECLARED\n") == {
        "phalanx.comm.probe -> failpoints._DECLARED (private attribute)"}
    assert _check("phalanx.comm.probe", "def f(w):\n    return w.points._maybe_fire\n") == {
        "phalanx.comm.probe -> w.points._maybe_fire (private attribute)"}
    assert _check("phalanx.kvstore.probe", "def f():\n    from torch._C import _distributed_c10d\n"
                  ) == {"phalanx.kvstore.probe -> torch._C._distributed_c10d (a third party's "
                        "private module)"}
    assert _check("phalanx_bench.anchors.probe", "import torch._C\n") == set()
    assert _check("phalanx.comm.probe", "from phalanx.runtime import current_rank\n"
                  "from ._errors import DomainError\nimport torch.nn\n") == set()
