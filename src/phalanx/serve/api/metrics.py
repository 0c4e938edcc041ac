"""``/metrics``: Prometheus metrics in vLLM's naming style, under ``phalanx:``.

Request metrics (outcomes, tokens, TTFT, inter-token, end-to-end and queue time) are
recorded by the HTTP layer as requests run; engine and cache state (running and
waiting requests, KV pool usage, prefix cache queries and hits per tier, records and
bytes per rank, maintenance queue, link windows, uncertain resources) is read from
the engine's ``stats()`` at scrape time by a collector, so a scrape always shows the
present and nothing is pushed on the request path. One registry per server (never the
process-global one), so two servers in one process, or a restart, never collide.

:meth:`Metrics.sample` is the one place the figures are computed: it collects every
family once into a :class:`Sample`. ``/metrics`` renders a sample as Prometheus text and
``/state`` (the web page's JSON, :mod:`phalanx.serve.api.state`) reads its figures out of
one, so the two can never disagree (issue 47).

The Grafana dashboard in ``deploy/grafana/phalanx.json`` queries these names;
``tests/test_serve_metrics.py`` checks its queries against what the server exports.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

__all__ = ["METRIC_NAMES", "Metrics", "Sample"]

# The *_created series double every counter's lines and no dashboard reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)

# name -> (kind, help) of what the engine's stats() feeds at scrape time.
_ENGINE_GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV pages in use (1 = full).",
    "ranks_alive": "Rank processes alive (the job serves only when all are).",
    "uncertain_resources": "Resources whose release failed and are still owned (the "
                           "parent's and every rank's ledger).",
    "engine_restarts": "Times the server restarted its ranks after a failure.",
}
_ENGINE_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits_memory": "Prompt tokens served from the memory tier.",
    "prefix_cache_hits_disk": "Prompt tokens served from the disk tier.",
    "prompt_tokens_computed": "Prompt tokens computed (not served from a cache tier).",
    "num_preemptions": "Requests preempted (their KV freed, recomputed later).",
}
_PER_RANK_GAUGES = {
    "rank_alive": "1 while each rank process is alive, 0 once it died.",
    "rank_weight_bytes": "Bytes of model weights each rank holds (quantized ones as held).",
    "rank_kv_cache_bytes": "Bytes of each rank's KV pool (the memory tier).",
    "rank_resident_bytes": "Each rank process's resident set when its model was loaded.",
    "rank_heap_released_bytes": "Resident bytes each rank gave back from its free heap "
                                "(once loaded, and whenever it idles after steps).",
    "cache_disk_records": "Records in each rank's disk tier.",
    "cache_disk_bytes": "Bytes in each rank's disk tier.",
    "cache_maintenance_queued": "Maintenance jobs each rank's disk tier knows of (rank 0 "
                                "decides them, the peers apply what it sends).",
}
_PER_PEER_GAUGES = {
    "replication_link_window": "Credits of rank 0's link to each peer (its window).",
    "replication_link_window_free": "Free credits in rank 0's link to each peer.",
    "replication_link_pending": "Ops waiting for credits on rank 0's link to each peer.",
}
_SCALAR_GAUGES = {
    "cache_disk_stores_pending": "Prefix-cache stores queued or running: finished "
                                 "prefills' pages on their way to disk.",
    "cache_maintenance_queue": "Maintenance jobs the disk tier still has to do (rank 0's "
                               "queue: it decides them).",
}

_REQUEST_METRICS = [
    "request_success_total", "prompt_tokens_total", "generation_tokens_total",
    "time_to_first_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "http_client_errors_total",
]

#: Every metric family name the server exports (the dashboard test checks against it).
METRIC_NAMES: frozenset[str] = frozenset(
    "phalanx:" + n for n in [*_ENGINE_GAUGES, *(f"{c}_total" for c in _ENGINE_COUNTERS),
                              *_PER_RANK_GAUGES, *_PER_PEER_GAUGES, *_SCALAR_GAUGES,
                              *_REQUEST_METRICS])


class _EngineCollector(Collector):
    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Any]:
        s = self.stats
        for name, doc in _ENGINE_GAUGES.items():
            yield GaugeMetricFamily(f"phalanx:{name}", doc, value=float(s.get(name, 0)))
        for name, doc in _SCALAR_GAUGES.items():
            yield GaugeMetricFamily(f"phalanx:{name}", doc, value=float(s.get(name, 0)))
        for name, doc in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"phalanx:{name}", doc, value=float(s.get(name, 0)))
        for name, doc in _PER_RANK_GAUGES.items():
            g = GaugeMetricFamily(f"phalanx:{name}", doc, labels=["rank"])
            for rank, value in sorted(s.get(name, {}).items()):
                g.add_metric([str(rank)], float(value))
            yield g
        for name, doc in _PER_PEER_GAUGES.items():
            g = GaugeMetricFamily(f"phalanx:{name}", doc, labels=["peer"])
            for peer, value in sorted(s.get(name, {}).items()):
                g.add_metric([str(peer)], float(value))
            yield g


class Metrics:
    """The server's registry: request metrics recorded live, engine state scraped."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine = _EngineCollector()
        self.registry.register(self._engine)
        r, m = self.registry, ["model_name"]
        self.model = model_name
        self.success = Counter("phalanx:request_success", "Finished requests by reason.",
                               [*m, "finished_reason"], registry=r)
        self.prompt_tokens = Counter("phalanx:prompt_tokens", "Prompt tokens of finished "
                                     "requests.", m, registry=r)
        self.generation_tokens = Counter("phalanx:generation_tokens", "Generated tokens.", m,
                                         registry=r)
        self._generated = self.generation_tokens.labels(self.model)
        self.client_errors = Counter("phalanx:http_client_errors", "Requests refused with a "
                                     "4xx or 503, by status.", ["status"], registry=r)
        hist = {"registry": r, "buckets": _LATENCY_BUCKETS}
        self.ttft = Histogram("phalanx:time_to_first_token_seconds", "Time to first token.",
                              m, **hist)  # type: ignore[arg-type]
        self.itl = Histogram("phalanx:inter_token_latency_seconds", "Time between tokens.",
                             m, **hist)  # type: ignore[arg-type]
        self.e2e = Histogram("phalanx:e2e_request_latency_seconds", "Request latency.",
                             m, **hist)  # type: ignore[arg-type]
        self.queue = Histogram("phalanx:request_queue_time_seconds", "Time waiting before "
                               "the first step.", m, **hist)  # type: ignore[arg-type]

    def generated(self, tokens: int) -> None:
        """Tokens a request produced in one delta: counted as they stream (as vLLM counts
        per step), so a long stream's throughput shows while it runs and an aborted
        one's tokens count too."""
        self._generated.inc(tokens)

    def client_error(self, status: int) -> None:
        self.client_errors.labels(str(status)).inc()

    def finished(self, reason: str, prompt_tokens: int, ttft: float | None,
                 itls: list[float], e2e: float, queue: float | None) -> None:
        self.success.labels(self.model, reason).inc()
        self.prompt_tokens.labels(self.model).inc(prompt_tokens)
        if ttft is not None:
            self.ttft.labels(self.model).observe(ttft)
        for x in itls:
            self.itl.labels(self.model).observe(x)
        self.e2e.labels(self.model).observe(e2e)
        if queue is not None:
            self.queue.labels(self.model).observe(queue)

    def sample(self, engine_stats: dict[str, Any]) -> Sample:
        """Every figure, collected once: the request metrics as recorded and the
        engine's ``engine_stats`` (``EngineClient.stats()``). Synchronous: two requests
        on the event loop never interleave between setting the stats and collecting."""
        self._engine.stats = engine_stats
        return Sample(tuple(self.registry.collect()), time.time())


@dataclass(frozen=True)
class Sample:
    """The metric families of one collection and when it was taken (Unix seconds)."""

    families: tuple[Metric, ...]
    taken: float

    def render(self) -> tuple[bytes, str]:
        """Prometheus' text format and its content type (what ``/metrics`` answers)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Frozen(self.families))
        return generate_latest(registry), CONTENT_TYPE_LATEST

    def total(self, name: str) -> float:
        """The sum of the samples named ``name`` (all labels): ``phalanx:x_total``."""
        return sum(s.value for f in self.families for s in f.samples if s.name == name)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``label``'s value -> the sample, for the samples named ``name``."""
        return {s.labels[label]: s.value for f in self.families for s in f.samples
                if s.name == name and label in s.labels}


class _Frozen(Collector):
    """A collection replayed: what ``generate_latest`` renders from a Sample."""

    def __init__(self, families: tuple[Metric, ...]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
