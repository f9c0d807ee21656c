"""Statistics of live requests that the views draw, kept Qt-free so they test without a screen.

`LatencyStore` collects finished requests per backend; `step_histogram` bins them into fixed,
log-spaced edges (one set per metric, never re-binned, so histograms stay comparable while a
run grows); `RingSeries` is a bounded time series for "per second over time" plots;
`summarize` turns a live run's records into the engine's `benchmark.RunSummary` (an
experiment row), its makespan less the time the run stood paused with nothing in flight. How
the figures are written is `ui.model.formatting`; plot axes are `ui.model.axes`.
Plain data: whoever owns one (a view, on the GUI thread) is the only one touching it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from engine.sim import benchmark

# Fixed bin edges (seconds), log-spaced so a 5 ms inter-token gap and a 60 s end-to-end time
# both land in readable bins.
EDGES = {
    "ttft": np.logspace(-3, 2, 51),  # 1 ms .. 100 s
    "e2e": np.logspace(-2, 2.5, 46),  # 10 ms .. 316 s
    "itl": np.logspace(-4, 0.5, 46),  # 0.1 ms .. 3.2 s
}
METRIC_TITLES = {"ttft": "Time to first token", "e2e": "End-to-end latency", "itl": "Inter-token latency"}


def step_histogram(values, edges) -> np.ndarray:
    """Counts of `values` in `edges` (values outside fall into the first/last bin)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return np.zeros(len(edges) - 1)
    v = np.clip(v, edges[0], np.nextafter(edges[-1], 0))
    counts, _ = np.histogram(v, bins=edges)
    return counts.astype(float)


def percentile(values, q: float) -> float:
    """The benchmark's percentile over the finite values (missing ones are skipped); NaN when empty."""
    return benchmark.percentile([v for v in values if v is not None and math.isfinite(v)], q)


class LatencyStore:
    """Per-backend TTFT, end-to-end and inter-token latencies of finished requests.

    Only requests that produced tokens count (cancelled and failed ones are tallied apart).
    `version` grows on every change so a view redraws only when something is new.
    """

    def __init__(self, backends: list[str], limit: int = 20000):
        self.backends = list(backends)
        self.limit = limit
        self._data: dict[str, dict[str, list[float]]] = {b: {m: [] for m in EDGES} for b in self.backends}
        self.finished = {b: 0 for b in self.backends}
        self.failed = {b: 0 for b in self.backends}  # errors and cancelled requests
        self.version = 0

    def add(self, record) -> None:
        """Record one `FinishRecord`."""
        b = record.backend
        if b not in self._data:
            self.backends.append(b)
            self._data[b] = {m: [] for m in EDGES}
            self.finished[b] = self.failed[b] = 0
        if record.error is None and record.output_tokens == 0 and record.finish_reason == "stop":
            return  # a prefix warm-up: prefill only, nothing to time
        self.version += 1
        if record.error or record.ttft_s is None or record.finish_reason == "cancelled":
            self.failed[b] += 1
            return
        self.finished[b] += 1
        d = self._data[b]
        d["ttft"].append(record.ttft_s)
        d["e2e"].append(record.e2e_s)
        if record.itl_s is not None:
            d["itl"].append(record.itl_s)
        for m in d:
            if len(d[m]) > self.limit:
                del d[m][: len(d[m]) - self.limit]

    def values(self, metric: str, backend: str) -> np.ndarray:
        return np.asarray(self._data.get(backend, {}).get(metric, ()), dtype=float)

    def histogram(self, metric: str, backend: str) -> np.ndarray:
        return step_histogram(self.values(metric, backend), EDGES[metric])

    def percentiles(self, metric: str, backend: str) -> tuple[float, float]:
        v = self.values(metric, backend)
        return percentile(v, 50), percentile(v, 95)

    def clear(self) -> None:
        for b in self._data:
            for m in self._data[b]:
                self._data[b][m].clear()
            self.finished[b] = self.failed[b] = 0
        self.version += 1


class RingSeries:
    """A fixed-size (x, y...) series: append shifts the window once full (no reallocation)."""

    def __init__(self, size: int, n_y: int):
        self.x = np.full(size, np.nan)
        self.y = np.full((n_y, size), np.nan)
        self.n = 0

    def append(self, x: float, ys) -> None:
        size = self.x.size
        if self.n < size:
            i = self.n
            self.n += 1
        else:
            self.x[:-1] = self.x[1:]
            self.y[:, :-1] = self.y[:, 1:]
            i = size - 1
        self.x[i] = x
        self.y[:, i] = ys

    def view(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[: self.n], self.y[k, : self.n]


def summarize(label: str, policy: str, records, t_start: float, t_end: float, *,
              submitted: Mapping[str, float] | None = None, pauses=()) -> benchmark.RunSummary:
    """The benchmark's metrics of a live run (its `FinishRecord`s), whose requests were submitted
    from `t_start` and all ended by `t_end` (monotonic seconds).

    `pauses` are the run's arrival clock's (`ArrivalClock.pauses()`), `submitted` each request's
    submit time by id: a request is in flight from then for its `e2e_s` (one without a record,
    to `t_end`). Paused time with none in flight is left out of the makespan (`paused_s`)."""
    ok = [r for r in records if not r.error and r.ttft_s is not None]
    ends = {r.request_id: r.e2e_s for r in records}
    busy = [(t, None if ends.get(rid) is None else t + ends[rid]) for rid, t in (submitted or {}).items()]
    paused = benchmark.idle_paused_s(pauses, busy, t_start, t_end)
    makespan = max(t_end - t_start - paused, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    metrics = benchmark.RunMetrics(
        makespan_s=makespan,
        output_tok_s=output_tokens / makespan,
        ttft_p50_s=percentile([r.ttft_s for r in ok], 50),
        ttft_p95_s=percentile([r.ttft_s for r in ok], 95),
        e2e_p50_s=percentile([r.e2e_s for r in ok], 50),
        e2e_p95_s=percentile([r.e2e_s for r in ok], 95),
        completed=len(ok),
        failed=len(records) - len(ok),
        output_tokens=output_tokens,
        routed=dict(sorted(benchmark.routed(records).items())),
        paused_s=paused,
    )
    return benchmark.RunSummary(label, policy, metrics)
