"""Prometheus metrics for one engine, named like vLLM's with a `tandem:` prefix.

Two sources feed them:
- per request, `RequestFinished` events from the engine's bus (TTFT, inter-token and
  end-to-end latency, queue time, token counts, finish reasons);
- per backend, a snapshot taken at scrape time (running and waiting requests, KV usage,
  prefix-cache queries and hits, prompt tokens computed, health), so the gauges are exact when they are read.

Every series is labelled by `backend`. The metrics read an engine through `MetricsSource` (its
bus, its backends' names, its snapshots), so this module knows nothing above `engine/core/`. Each `EngineMetrics` owns a `CollectorRegistry`
(never the process-global one), so several engines, apps or tests never collide.

Thread contract: the bus calls `observe()` on backend worker threads; `render()` may be called
from any thread (the HTTP loop). prometheus-client's collectors are thread-safe; the weighted
inter-token histogram guards itself with a lock.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from engine.core.events import EventBus, RequestFinished
from engine.core.request import FinishRecord, RequestStatus
from engine.core.snapshot import BackendSnapshot

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets, with a few finer ones at the bottom: small local models are fast.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# vLLM's `finished_reason` label values.
_FINISHED_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_CANCELLED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class MetricsSource(Protocol):
    """What the metrics read of an engine (`engine.engine.Engine` is one)."""

    @property
    def bus(self) -> EventBus:
        """Where `RequestFinished` events are published."""
        ...

    @property
    def backends(self) -> Mapping[str, object]:
        """The backends by name: each name's series exist from the start."""
        ...

    def snapshot(self) -> list[BackendSnapshot]:
        """Every backend's state now (called at each scrape, from the scraping thread)."""
        ...


class EngineMetrics:
    """The Prometheus view of one engine. Subscribes to its bus; `close()` unsubscribes."""

    def __init__(self, engine: MetricsSource, registry: CollectorRegistry | None = None) -> None:
        self.engine = engine
        self.registry = registry or CollectorRegistry()
        r, b = self.registry, ["backend"]
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time from submit to the first token.",
                              b, buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Time from submit to the end of a request.",
                             b, buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("tandem:request_queue_time_seconds", "Time a request waited before admission.",
                               b, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tandem:request_time_per_output_token_seconds",
                              "Mean time between output tokens, one sample per request.",
                              b, buckets=ITL_BUCKETS, registry=r)
        self.itl = _WeightedHistogram("tandem:inter_token_latency_seconds",
                                      "Time between consecutive output tokens.", ITL_BUCKETS)
        self.success = Counter("tandem:request_success", "Finished requests, by finish reason.",
                               ["backend", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of finished requests.", b, registry=r)
        self.cached_tokens = Counter("tandem:prompt_tokens_cached",
                                     "Prompt tokens of finished requests served from the prefix cache.",
                                     b, registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated.", b, registry=r)
        r.register(self.itl)
        r.register(_SnapshotCollector(engine))
        for name in engine.backends:  # every series exists from the start, at zero
            for m in (self.ttft, self.e2e, self.queue, self.tpot, self.prompt_tokens, self.cached_tokens,
                      self.generation_tokens):
                m.labels(name)
            for reason in _FINISHED_REASON.values():
                self.success.labels(name, reason)
            self.itl.prime(name)
        self._unsubscribe = engine.bus.subscribe(self._on_finished, (RequestFinished,))

    def observe(self, record: FinishRecord) -> None:
        """Count one finished request (any thread). Cache warm-ups are not requests: skipped."""
        if record.status == RequestStatus.FINISHED_STOPPED and record.output_tokens == 0:
            return  # a warm-up prefill (`Backend.warm`): stopped without sampling anything
        b = record.backend
        self.success.labels(b, _FINISHED_REASON.get(record.status, "error")).inc()
        self.prompt_tokens.labels(b).inc(record.prompt_tokens)
        self.cached_tokens.labels(b).inc(max(record.cached_tokens, 0))
        self.generation_tokens.labels(b).inc(record.output_tokens)
        self.e2e.labels(b).observe(record.e2e_s)
        self.queue.labels(b).observe(record.queue_s)
        if record.ttft_s is not None:
            self.ttft.labels(b).observe(record.ttft_s)
        if record.itl_s is not None and record.output_tokens > 1:
            self.tpot.labels(b).observe(record.itl_s)
            # The record holds the mean gap only: count it once per gap, so the sum and the
            # count are exact and the buckets hold each request's mean.
            self.itl.observe(b, record.itl_s, record.output_tokens - 1)

    def render(self) -> bytes:
        """The registry in Prometheus text format (snapshots are taken now)."""
        return generate_latest(self.registry)

    def close(self) -> None:
        self._unsubscribe()

    def _on_finished(self, event: RequestFinished) -> None:
        self.observe(event.record)


class _SnapshotCollector:
    """Per-backend gauges and cache counters, read from `Engine.snapshot()` at scrape time."""

    def __init__(self, engine: MetricsSource) -> None:
        self._engine = engine

    def describe(self) -> list[Metric]:
        return []  # nothing to describe up front: registering must not take snapshots

    def collect(self) -> list[Metric]:
        b = ["backend"]
        running = GaugeMetricFamily("tandem:num_requests_running", "Requests decoding or prefilling now.", labels=b)
        waiting = GaugeMetricFamily("tandem:num_requests_waiting", "Requests queued for admission.", labels=b)
        usage = GaugeMetricFamily("tandem:kv_cache_usage_perc",
                                  "Fraction of KV cells in use (1 = full), cached prefixes included.", labels=b)
        cells = GaugeMetricFamily("tandem:kv_cache_cells_used", "KV cells in use.", labels=b)
        cap = GaugeMetricFamily("tandem:max_num_seqs", "The backend's concurrency cap.", labels=b)
        healthy = GaugeMetricFamily("tandem:backend_healthy", "1 if the backend accepts work.", labels=b)
        queries = CounterMetricFamily("tandem:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache at admission.", labels=b)
        hits = CounterMetricFamily("tandem:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache at admission.", labels=b)
        computed = CounterMetricFamily("tandem:prompt_tokens_computed",
                                       "Prompt tokens decoded (cache hits and the shared prompt of n choices "
                                       "are not decoded again).", labels=b)
        for s in self._engine.snapshot():
            n = [s.name]
            running.add_metric(n, len(s.running))
            waiting.add_metric(n, len(s.waiting))
            usage.add_metric(n, s.kv_cells_used / s.kv_cells_total if s.kv_cells_total else 0.0)
            cells.add_metric(n, s.kv_cells_used)
            cap.add_metric(n, s.cap)
            healthy.add_metric(n, 1.0 if s.healthy else 0.0)
            queries.add_metric(n, s.cache.query_tokens)
            hits.add_metric(n, s.cache.hit_tokens)
            computed.add_metric(n, s.prompt_tokens_computed)
        return [running, waiting, usage, cells, cap, healthy, queries, hits, computed]


class _WeightedHistogram:
    """A labelled histogram that can add one value `n` times at once (a collector)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = tuple(buckets)
        self._lock = threading.Lock()
        self._series: dict[str, tuple[list[int], list[float]]] = {}  # backend -> (bucket counts, [sum])

    def prime(self, backend: str) -> None:
        with self._lock:
            self._series.setdefault(backend, ([0] * (len(self._bounds) + 1), [0.0]))

    def observe(self, backend: str, value: float, n: int = 1) -> None:
        i = bisect.bisect_left(self._bounds, value)  # first bucket with bound >= value (le)
        with self._lock:
            counts, total = self._series.setdefault(backend, ([0] * (len(self._bounds) + 1), [0.0]))
            counts[i] += n
            total[0] += value * n

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=["backend"])]

    def collect(self) -> list[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["backend"])
        with self._lock:
            series = {k: (list(c), t[0]) for k, (c, t) in self._series.items()}
        for backend, (counts, total) in series.items():
            cumulative, buckets = 0, []
            for bound, count in zip((*self._bounds, float("inf")), counts):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric([backend], buckets, total)
        return [family]
