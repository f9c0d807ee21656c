"""Latency and throughput figures the views draw, kept Qt-free so they test without a screen.

`LatencyStore` collects finished requests per backend; `step_histogram` bins them into fixed,
log-spaced edges (one set per metric, never re-binned, so histograms stay comparable while a
run grows); `RingSeries` is a bounded time series for "per second over time" plots;
`summarize` turns a live run's records into the engine's `benchmark.RunSummary` (an
experiment row).
"""

from __future__ import annotations

import math
import numpy as np

from engine import benchmark

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
        self._data = {b: {m: [] for m in EDGES} for b in self.backends}
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


def summarize(label: str, policy: str, records, t_start: float, t_end: float) -> benchmark.RunSummary:
    """The benchmark's metrics of a live run (its `FinishRecord`s), whose requests were submitted
    from `t_start` and all ended by `t_end`."""
    ok = [r for r in records if not r.error and r.ttft_s is not None]
    makespan = max(t_end - t_start, 1e-9)
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
    )
    return benchmark.RunSummary(label, policy, metrics)


def fmt_seconds(s: float | None) -> str:
    """0.0123 -> '12.3 ms', 3.2 -> '3.20 s'; None/NaN -> '–'."""
    if s is None or not math.isfinite(s):
        return "–"
    if s < 1.0:
        return f"{s * 1000:.1f} ms"
    return f"{s:.2f} s"


def fmt_rate(tok_s: float | None) -> str:
    """76.2413 -> '76.2 tok/s', 2551.0 -> '2,551 tok/s', 0/None/NaN -> '–'."""
    if tok_s is None or not math.isfinite(tok_s) or tok_s <= 0:
        return "–"
    return f"{tok_s:,.0f} tok/s" if tok_s >= 100 else f"{tok_s:.1f} tok/s"


RATE_SOURCES = {
    "calibrated": "calibrated: measured on this machine by `tandem calibrate`",
    "online": "online: measured from the requests this backend has served",
    "override": "override: set by hand (--rates or the Controls panel)",
    "default": "default: a placeholder guess, not measured; the router's scores are rough until "
               "this backend has served a request or is calibrated",
    "article": "article: the study's rates (Apple M2, Qwen2.5-0.5B)",
}


def rates_source_text(source: str) -> str:
    """What a `Rates.source` means, in a sentence."""
    return RATE_SOURCES.get(source, source)


def model_title(info) -> str:
    """The name to show for a model: its file name (what the user picked, e.g.
    'SmolLM2-135M-Instruct.Q4_1'), since GGUF `general.name` is often a training-run label
    ('Smollm2 135M 8k Lc100K Mix1 Ep2'); `general.name` when the file name says nothing."""
    from pathlib import Path

    stem = Path(info.path).stem if info.path else ""
    if not stem or stem.lower() in ("model", "ggml-model", "ggml-model-f16", "ggml-model-q4_0"):
        return info.name
    return stem


def count_axis_top(top: float) -> tuple[float, int]:
    """(axis maximum, tick step) for a count axis (requests): whole-number ticks, ~4 of them,
    a little headroom; 0..2 when empty."""
    top = max(float(top), 1.0)
    raw = top / 4
    step = 1
    for s in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000):
        step = s
        if s >= raw:
            break
    return math.ceil(top * 1.1 / step) * step, step


def occupied_log_range(histograms, edges) -> tuple[float, float] | None:
    """log10(seconds) span of the bins any histogram uses, one bin of margin each side; None
    when every histogram is empty."""
    used = np.zeros(len(edges) - 1, dtype=bool)
    for h in histograms:
        used |= np.asarray(h) > 0
    idx = np.flatnonzero(used)
    if idx.size == 0:
        return None
    lo = max(int(idx[0]) - 1, 0)
    hi = min(int(idx[-1]) + 2, len(edges) - 1)
    return math.log10(edges[lo]), math.log10(edges[hi])


def log_ticks(lo: float, hi: float) -> list[tuple[float, str]]:
    """Ticks for a log10(seconds) axis from `lo` to `hi`: 1-2-5 steps, labelled '20 ms', '1 s'
    (pyqtgraph's own log ticks crowd '2·10 3·10 …' when the range is under a decade)."""
    out = []
    for exp in range(math.floor(lo) - 1, math.ceil(hi) + 1):
        for m in (1, 2, 5):
            v = m * 10.0 ** exp
            x = math.log10(v)
            if lo - 1e-9 <= x <= hi + 1e-9:
                out.append((x, fmt_seconds_short(v)))
    if len(out) > 7:  # a wide range: decades only
        out = [(x, t) for x, t in out if abs(x - round(x)) < 1e-9]
    return out


def fmt_seconds_short(s: float) -> str:
    """0.02 -> '20 ms', 0.0005 -> '0.5 ms', 2 -> '2 s', 120 -> '120 s'."""
    if s < 1e-3:
        return f"{s * 1000:g} ms"
    if s < 1.0:
        return f"{s * 1000:.0f} ms"
    return f"{s:g} s"
