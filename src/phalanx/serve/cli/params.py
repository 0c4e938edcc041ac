"""Option types the commands share: a byte size (``256M``, ``4G``), a list of positive
integers (``4096,65536``) and a shape (``8x512``).

Each turns a bad value into click's own usage error (one line naming the option, exit
code 2) while the command line is parsed, before any rank or server starts.
"""

from __future__ import annotations

from typing import Any

import click

__all__ = ["BYTE_SIZE", "INT_LIST", "SHAPE", "parse_size"]

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: str) -> int:
    """``"256M"`` -> 268435456 (K, M, G, T are powers of 1024; a trailing B or iB is
    allowed); ValueError for anything that is not a positive size."""
    v = value.strip().lower().removesuffix("b").removesuffix("i")
    scale = 1
    if v and v[-1] in _UNITS:
        v, scale = v[:-1], _UNITS[v[-1]]
    n = int(float(v) * scale)
    if n <= 0:
        raise ValueError(f"{value!r} is not a positive size")
    return n


class _ByteSize(click.ParamType[int]):
    name = "SIZE"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a size: a positive number of bytes with an "
                      f"optional K, M, G or T (256M, 4G)", param, ctx)


class _IntList(click.ParamType[list[int]]):
    name = "N[,N...]"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> list[int]:
        if isinstance(value, list):
            return value
        try:
            out = [int(x) for x in str(value).split(",")]
        except ValueError:
            out = []
        if not out or min(out) <= 0:
            self.fail(f"{value!r} is not a comma-separated list of positive integers",
                      param, ctx)
        return out


class _Shape(click.ParamType[tuple[int, int] | None]):
    """``AxB`` of positive integers; the empty string is None (the option is off)."""

    name = "AxB"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> tuple[int, int] | None:
        if value is None or isinstance(value, tuple):
            return value
        if str(value).strip() == "":
            return None
        a, sep, b = str(value).lower().partition("x")
        try:
            shape = (int(a), int(b)) if sep else None
        except ValueError:
            shape = None
        if shape is None or min(shape) <= 0:
            self.fail(f"{value!r} is not AxB of positive integers (8x512), or '' for none",
                      param, ctx)
        return shape


BYTE_SIZE = _ByteSize()
INT_LIST = _IntList()
SHAPE = _Shape()
