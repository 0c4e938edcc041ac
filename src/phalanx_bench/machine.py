"""What the benchmark ran on: the CPU's model and the extensions that change the answer.

A table in BENCHMARKS.md is only comparable with another made on the same CPU, and an
anchor's speed (or whether it runs at all: llama.cpp's AMX backend, issue 43) depends on
the CPU's extensions, so the benchmarks record both beside their numbers. Linux names
the CPU in ``/proc/cpuinfo``; elsewhere ``platform.processor()`` says what it can.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

__all__ = ["cpu", "cpu_flags", "cpu_model", "has_amx"]

CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo_field(names: tuple[str, ...], cpuinfo: Path) -> str | None:
    """The first processor's value of the first of ``names`` it lists."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in names and value.strip():
            return value.strip()
    return None


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name (``AMD EPYC 7B13``, ``Intel(R) Xeon(R) Platinum 8481C``), else
    ``platform.processor()``, else the architecture."""
    return (_cpuinfo_field(("model name",), cpuinfo) or platform.processor()
            or platform.machine() or "unknown")


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str] | None:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); None where unknown."""
    line = _cpuinfo_field(("flags", "features"), cpuinfo)
    return None if line is None else frozenset(line.split())


def has_amx(cpuinfo: Path = CPUINFO) -> bool | None:
    """Whether the CPU has Intel AMX (``amx_tile``); None where the flags are unknown."""
    flags = cpu_flags(cpuinfo)
    return None if flags is None else "amx_tile" in flags


def cpu(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """``{"model": ..., "amx": ...}`` for a benchmark's JSON."""
    return {"model": cpu_model(cpuinfo), "amx": has_amx(cpuinfo)}
