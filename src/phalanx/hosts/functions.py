"""Work that crosses hosts names an importable function, ``module:qualname``.

A function object cannot cross hosts (that would mean pickles from the network), so the
head sends its name and each host imports it. Functions defined in ``__main__``, lambdas
and nested functions have no name another host can import: they are a same-host feature
(the local :class:`~phalanx.Worker` ships them), and naming one here is a clear error.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["function_name", "resolve", "run_on_rank"]


def function_name(fn: Callable[..., Any] | str) -> str:
    """``module:qualname`` for ``fn`` (checked to import back to it), or ``fn`` itself."""
    if isinstance(fn, str):
        module, _, qual = fn.partition(":")
        if not module or not qual:
            raise ValueError(f"{fn!r}: name work for another host as 'module:function'")
        return fn
    mod: str | None = getattr(fn, "__module__", None)
    qualname: str | None = getattr(fn, "__qualname__", None)
    if mod is None or qualname is None:
        raise TypeError(f"{fn!r} has no module and name: work for another host must be an "
                        f"importable function ('module:function')")
    module, qual = mod, qualname
    if module == "__main__":
        raise TypeError(f"{qual} is defined in __main__: other hosts cannot import it. Move "
                        f"it into a module on every host's path, or use the local Worker "
                        f"(same-host work may be any function)")
    if "<locals>" in qual or "<lambda>" in qual:
        raise TypeError(f"{module}.{qual} is a nested function or a lambda: other hosts "
                        f"cannot import it; define it at a module's top level")
    name = f"{module}:{qual}"
    if resolve(name) is not fn:
        raise TypeError(f"{name} does not import back to {fn!r} (decorated or rebound?): "
                        f"name the module-level function")
    return name


def resolve(name: str) -> Callable[..., Any]:
    """Import ``module:qualname`` (an error names what is missing)."""
    module_name, _, qual = name.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"{name}: module {module_name} cannot be imported on this host: "
                          f"{exc}") from exc
    for part in qual.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(f"{name}: {module_name} has no {qual}") from None
    if not callable(obj):
        raise TypeError(f"{name} is not callable")
    return obj  # type: ignore[no-any-return]


def _one_task(o: Any, rank: int, fn: Callable[..., Any], args: list[Any],
              timeout: float | None) -> Any:
    oo = o.options(timeout=timeout) if timeout is not None else o
    return oo.submit(rank, fn, *args).result()


def run_on_rank(worker: Any, local_rank: int, name: str, args: list[Any],
                timeout: float | None) -> Any:
    """``name(*args)`` as a task on ``local_rank`` of this host's Worker (a run of its
    own, so the task gets the run's fence and deadline like any other)."""
    fn = resolve(name)
    return worker.run(_one_task, local_rank, fn, args, timeout)
