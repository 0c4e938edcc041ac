"""Small statistics helpers shared by the benchmarks."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank; samples need not be sorted."""
    if not samples:
        raise ValueError("percentile of no samples")
    ordered = sorted(samples)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print the result: a readable table-ish dump, and the JSON object as the last line."""
    if not as_json:
        for key, value in result.items():
            print(f"{key}: {value}")
    print(json.dumps(result, sort_keys=True))
