"""Peak resident memory of the calling process (run as tasks on every rank).

Linux keeps the high-water mark in ``/proc/self/status`` (VmHWM); writing 5 to
``/proc/self/clear_refs`` resets it to the current RSS, so a peak can be taken over one
phase of a long-lived process. Where either is missing, getrusage's lifetime maximum.
"""

from __future__ import annotations

import resource

__all__ = ["peak_rss", "reset_peak_rss"]


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> tuple[bool, float]:
    """Reset the peak to the current RSS: (whether it could, the RSS in MiB)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        ok = True
    except OSError:
        ok = False
    return ok, _status_mb("VmRSS") or 0.0


def peak_rss() -> float:
    """Peak RSS in MiB since the last reset (or since the process started)."""
    hwm = _status_mb("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
