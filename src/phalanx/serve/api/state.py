"""``GET /state``: the server's state as one JSON document, for the web page (issue 47).

Every figure is read out of a :class:`~phalanx.serve.api.metrics.Sample`, the same
collection ``/metrics`` renders as Prometheus text: the two cannot disagree, and nothing
here asks the engine for a figure of its own. What is added is only what a scrape does
not hold: the server's shape (TP size, hosts, the disk tier's capacity, whether a key is
required), its health, and rates over the last seconds (:class:`RateWindow`), which
Prometheus computes at query time (``rate()``) and a page has no server to ask.

Nothing secret is shown: no key, no token, no path (as ``/metrics``, which is as open).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from .engine_client import Health
from .metrics import Sample

__all__ = ["RateWindow", "ServerInfo", "state_document"]

_P = "phalanx:"


@dataclass(frozen=True)
class ServerInfo:
    """The server's shape, as ``phalanx serve`` was started."""

    tensor_parallel_size: int = 1
    nnodes: int = 1                    # hosts the ranks span (tp / nnodes each)
    disk_capacity_bytes: int = 0       # per rank; 0: no disk tier


@dataclass(frozen=True)
class _Point:
    at: float          # monotonic seconds
    generated: float   # phalanx:generation_tokens_total
    queries: float     # prompt tokens looked up
    memory: float      # of them, served from the memory tier
    disk: float        # ... from the disk tier


class RateWindow:
    """Rates over the last ``window_s`` seconds of the samples ``/state`` took.

    Invariant: ``_points`` is in time order, spans at most ``window_s`` after its first
    point (one older point is kept as the base), and holds no counter that went
    backwards (a restarted engine counts its cache from 0: the window starts again).
    Bounded by ``maxlen`` whatever the polling rate.
    """

    def __init__(self, window_s: float = 10.0, maxlen: int = 512) -> None:
        self.window_s = window_s
        self._points: deque[_Point] = deque(maxlen=maxlen)

    def add(self, now: float, sample: Sample) -> dict[str, float | None]:
        p = _Point(now, sample.total(_P + "generation_tokens_total"),
                   sample.total(_P + "prefix_cache_queries_total"),
                   sample.total(_P + "prefix_cache_hits_memory_total"),
                   sample.total(_P + "prefix_cache_hits_disk_total"))
        last = self._points[-1] if self._points else None
        if last is not None and (p.generated < last.generated or p.queries < last.queries):
            self._points.clear()
        self._points.append(p)
        while len(self._points) > 2 and self._points[1].at <= now - self.window_s:
            self._points.popleft()
        base = self._points[0]
        span = now - base.at
        queries = p.queries - base.queries
        return {
            "window_s": round(span, 3),
            "tokens_per_s": (p.generated - base.generated) / span if span > 0 else None,
            "hit_rate_memory": (p.memory - base.memory) / queries if queries > 0 else None,
            "hit_rate_disk": (p.disk - base.disk) / queries if queries > 0 else None,
        }


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _per_rank(sample: Sample, name: str) -> dict[int, float]:
    return {int(k): v for k, v in sample.by_label(_P + name, "rank").items()}


def state_document(sample: Sample, rates: dict[str, float | None], info: ServerInfo,
                   model: str, health: Health, api_key_required: bool) -> dict[str, Any]:
    """The state the page shows; every figure out of ``sample`` (see the module doc)."""
    tp = info.tensor_parallel_size
    per_node = max(1, tp // max(1, info.nnodes))
    alive = _per_rank(sample, "rank_alive")
    columns = {"weight_bytes": "rank_weight_bytes", "kv_cache_bytes": "rank_kv_cache_bytes",
               "resident_bytes": "rank_resident_bytes", "disk_records": "cache_disk_records",
               "disk_bytes": "cache_disk_bytes"}
    figures = {key: _per_rank(sample, name) for key, name in columns.items()}
    ranks = [{"rank": r, "host": r // per_node, "alive": alive.get(r, 0) > 0,
              **{key: _int(values.get(r)) for key, values in figures.items()}}
             for r in range(tp)]
    queries = sample.total(_P + "prefix_cache_queries_total")
    hits_memory = sample.total(_P + "prefix_cache_hits_memory_total")
    hits_disk = sample.total(_P + "prefix_cache_hits_disk_total")
    return {
        "model": model,
        "tensor_parallel_size": tp,
        "hosts": info.nnodes,
        "api_key_required": api_key_required,
        "health": {"ok": health.ok, "reason": health.reason},
        "ranks": ranks,
        "ranks_alive": _int(sample.total(_P + "ranks_alive")),
        "memory_tier": {
            "usage": sample.total(_P + "kv_cache_usage_perc"),
            "hit_tokens": _int(hits_memory),
            "hit_rate": _ratio(hits_memory, queries),
        },
        "disk_tier": {
            "enabled": info.disk_capacity_bytes > 0,
            "capacity_bytes_per_rank": info.disk_capacity_bytes,
            # every rank holds the same records (its own shard of each): the largest
            "records_per_rank": _int(max(figures["disk_records"].values(), default=0)),
            "bytes_per_rank": _int(max(figures["disk_bytes"].values(), default=0)),
            "hit_tokens": _int(hits_disk),
            "hit_rate": _ratio(hits_disk, queries),
            "stores_pending": _int(sample.total(_P + "cache_disk_stores_pending")),
            "maintenance_queue": _int(sample.total(_P + "cache_maintenance_queue")),
        },
        "prompt_tokens_looked_up": _int(queries),
        "requests": {
            "running": _int(sample.total(_P + "num_requests_running")),
            "waiting": _int(sample.total(_P + "num_requests_waiting")),
            "finished": _int(sample.total(_P + "request_success_total")),
            "preemptions": _int(sample.total(_P + "num_preemptions_total")),
        },
        "generation_tokens": _int(sample.total(_P + "generation_tokens_total")),
        "rates": rates,
        "restarts": _int(sample.total(_P + "engine_restarts")),
        "uncertain_resources": _int(sample.total(_P + "uncertain_resources")),
        "time": sample.taken,
    }


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)
