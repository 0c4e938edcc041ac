"""Work that crosses hosts names an importable function, ``module:qualname``.

A function object cannot cross hosts (that would mean pickles from the network), so the
head sends its name and each host imports it. Functions defined in ``__main__``, lambdas
and nested functions have no name another host can import: they are a same-host feature
(the local :class:`~phalanx.Worker` ships them), and naming one here is a clear error.

Arguments and results cross as msgpack: a dataclass or a msgspec Struct arrives as a
dict. The receiving side converts each into what the function's annotations declare
(:func:`typed_args`, :func:`typed_result`, ``msgspec.convert``), so a function that takes
a ``Lease`` gets a ``Lease`` on every host, and a value that does not fit its annotation
is an error naming the parameter rather than a surprise inside the function.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from collections.abc import Callable
from typing import Any

import msgspec

__all__ = ["function_name", "resolve", "run_on_rank", "typed_args", "typed_result"]


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


def _hints(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    """``fn``'s annotations, resolved; an error naming the one that cannot be (a value
    arriving from another host as something else than declared is never silent)."""
    try:
        return typing.get_type_hints(fn)
    except Exception as exc:  # noqa: BLE001  NameError mostly, re-raised saying where
        raise TypeError(f"{name}: its annotations cannot be resolved on this host ({exc}): "
                        f"a function called across hosts needs importable annotations "
                        f"(not only under TYPE_CHECKING), or none") from None


def _convert(value: Any, hint: Any, what: str) -> Any:
    if hint is Any:
        return value
    try:
        return msgspec.convert(value, hint)
    except msgspec.ValidationError as exc:
        raise TypeError(f"{what}: {exc}") from None
    except TypeError as exc:  # a type msgspec cannot build (a callable, a Protocol)
        raise TypeError(f"{what}: declared {hint!r}, which a value from another host "
                        f"cannot become ({exc}); declare a Struct, dataclass, builtin or "
                        f"Any") from None


def typed_args(fn: Callable[..., Any], args: list[Any], name: str) -> list[Any]:
    """``args`` converted into the types ``fn``'s parameters declare."""
    hints = _hints(fn, name)
    params = list(inspect.signature(fn).parameters.values())
    out = []
    for i, arg in enumerate(args):
        p = params[i] if i < len(params) else None
        if p is None or p.kind is p.VAR_POSITIONAL or p.name not in hints:
            out.append(arg)
            continue
        out.append(_convert(arg, hints[p.name], f"{name}: argument {p.name!r}"))
    return out


def typed_result(fn: Callable[..., Any], value: Any, name: str) -> Any:
    """``value`` converted into ``fn``'s declared return type."""
    hint = _hints(fn, name).get("return")
    return value if hint is None else _convert(value, hint, f"{name}: its result")


def _one_task(o: Any, rank: int, fn: Callable[..., Any], args: list[Any],
              timeout: float | None) -> Any:
    oo = o.options(timeout=timeout) if timeout is not None else o
    return oo.submit(rank, fn, *args).result()


def run_on_rank(worker: Any, local_rank: int, name: str, args: list[Any],
                timeout: float | None) -> Any:
    """``name(*args)`` as a task on ``local_rank`` of this host's Worker (a run of its
    own, so the task gets the run's fence and deadline like any other)."""
    fn = resolve(name)
    return worker.run(_one_task, local_rank, fn, typed_args(fn, args, name), timeout)
