"""Benchmark values and the pure functions that turn them into metrics.

vLLM's `benchmarks/serve.py` habits: every request yields a `RequestRecord` whether it
succeeded or not (a failure is data: `success=False` and its `error`), and metrics come from
pure functions over lists of records (`run_metrics`, `aggregate`, `oracle`) — no clocks, no
I/O, testable with hand-made records.

Times are seconds. `t_submit_s` is measured from the run's first submission, so a request
ends at `t_submit_s + e2e_s` and a run's makespan is the latest such end, less the time a
person paused the run's arrivals (`engine.sim.arrivals.ArrivalClock`) while none of its requests was
in flight (`idle_paused_s`; `RunMetrics.paused_s` says how much was left out).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from engine.core.decision import RoutingDecision

METRICS = ("makespan_s", "output_tok_s", "ttft_p50_s", "ttft_p95_s", "e2e_p50_s", "e2e_p95_s")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request of one benchmark run, as measured by the client."""

    workload: str
    policy: str
    run: int
    requests: int  # N of the run this request belongs to
    index: int
    request_id: str
    backend: str
    success: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int  # -1: the server did not say
    output_tokens: int
    t_submit_s: float
    queue_s: float | None
    ttft_s: float | None
    e2e_s: float | None
    itl_s: float | None  # mean gap between output tokens after the first
    error: str | None = None
    # The backend's live cap when the request was admitted, and why the limiter last moved it
    # (engine/sched/limiter.py): the run's cap over time, read beside queue_s
    cap: int | None = None
    cap_reason: str | None = None

    @property
    def t_end_s(self) -> float | None:
        return None if self.e2e_s is None else self.t_submit_s + self.e2e_s

    def to_dict(self) -> dict:
        # Every field is a scalar: a shallow read, not `asdict`'s recursive deep copy (the
        # latter took 1.5 s of a 10,000-request simulated run's report).
        return {name: getattr(self, name) for name in CSV_FIELDS}


CSV_FIELDS = tuple(f.name for f in fields(RequestRecord))


@dataclass(frozen=True, slots=True)
class RunMetrics:
    """The metrics of one run (one policy, one workload, one N)."""

    makespan_s: float
    output_tok_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    e2e_p50_s: float
    e2e_p95_s: float
    completed: int
    failed: int
    output_tokens: int
    routed: dict[str, int] = field(default_factory=dict)
    # Prompt tokens the engines computed (prompt - cached, successful requests): the cache's
    # misses. NaN when a server did not report its cached tokens.
    computed_prompt_tokens: float = math.nan
    # Seconds the run stood paused with nothing in flight, left out of `makespan_s` (and so of
    # `output_tok_s`); 0 for a run nobody paused.
    paused_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def requests(self) -> int:
        return self.completed + self.failed


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One run's metrics under the label and policy it is listed with: a row of the desktop
    app's experiments table, whether the run went through the benchmark runner (`run_metrics`)
    or was driven live by the window."""

    label: str
    policy: str
    metrics: RunMetrics

    def to_dict(self) -> dict:
        return {"label": self.label, "policy": self.policy, "requests": self.metrics.requests,
                **self.metrics.to_dict()}


# ---- pure metrics ----


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); NaN if empty."""
    xs = sorted(values)
    if not xs:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def makespan(records: Sequence[RequestRecord]) -> float:
    """From the first submission to the last successful request's end (NaN if none succeeded)."""
    ends = [r.t_end_s for r in records if r.success and r.t_end_s is not None]
    if not ends:
        return math.nan
    start = min(r.t_submit_s for r in records)
    return max(ends) - start


Span = tuple[float, float | None]  # (start, end) in seconds; end None: still open at the run's end


def idle_paused_s(pauses: Iterable[Span], busy: Iterable[Span], start: float, end: float) -> float:
    """Seconds of [start, end] that lie in some pause and in no busy span.

    `pauses` are when a person held the arrivals back; `busy` when a request of the run was in
    flight (submitted, not yet finished). Either may overlap others; an end of None runs to
    `end`. A pause while requests ran is work and stays in the makespan; only its part after
    the last of them finished (and before the next was sent) is counted here, to be left out.
    """
    paused = _union(pauses, start, end)
    if not paused:
        return 0.0
    covered = _union(busy, start, end)
    idle = 0.0
    for p0, p1 in paused:
        idle += p1 - p0
        for b0, b1 in covered:
            idle -= max(0.0, min(p1, b1) - max(p0, b0))
    return idle


def _union(spans: Iterable[Span], start: float, end: float) -> list[tuple[float, float]]:
    """`spans` clipped to [start, end] and merged where they overlap, in order."""
    clipped = sorted((max(a, start), end if b is None else min(b, end)) for a, b in spans)
    out: list[tuple[float, float]] = []
    for a, b in clipped:
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def in_flight(records: Sequence[RequestRecord]) -> list[Span]:
    """When each request of a run was in flight: submit to end. One that reached a backend but
    has no end (it timed out) counts as in flight to the run's end; one refused at submission
    (no backend) never was."""
    return [(r.t_submit_s, r.t_end_s) for r in records if r.t_end_s is not None or r.backend]


def output_throughput(records: Sequence[RequestRecord], span_s: float) -> float:
    """Output tokens of successful requests per second of `span_s`."""
    if not span_s or not math.isfinite(span_s) or span_s <= 0:
        return math.nan
    return sum(r.output_tokens for r in records if r.success) / span_s


def routed(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Requests per backend (failed ones included: they were routed too)."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.backend] = counts.get(r.backend, 0) + 1
    return counts


def run_metrics(records: Sequence[RequestRecord], pauses: Iterable[Span] = ()) -> RunMetrics:
    """The run's metrics; `pauses` (seconds on the records' clock) are when its arrivals were
    paused, and the part of them with nothing in flight is left out of the makespan."""
    ok = [r for r in records if r.success]
    span = makespan(records)
    paused = 0.0
    if math.isfinite(span):
        start = min(r.t_submit_s for r in records)
        paused = idle_paused_s(pauses, in_flight(records), start, start + span)
        span -= paused
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    return RunMetrics(
        makespan_s=span,
        output_tok_s=output_throughput(records, span),
        ttft_p50_s=percentile(ttft, 50),
        ttft_p95_s=percentile(ttft, 95),
        e2e_p50_s=percentile(e2e, 50),
        e2e_p95_s=percentile(e2e, 95),
        completed=len(ok),
        failed=len(records) - len(ok),
        output_tokens=sum(r.output_tokens for r in ok),
        routed=routed(records),
        computed_prompt_tokens=(math.nan if any(r.cached_tokens < 0 for r in ok)
                                else float(sum(r.prompt_tokens - r.cached_tokens for r in ok))),
        paused_s=paused,
    )


def spread(values: Sequence[float]) -> dict:
    """Mean and spread of one metric over runs: mean, std (sample; 0 for one run), min, max, values."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None, "values": list(values)}
    return {
        "mean": statistics.fmean(xs),
        "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
        "min": min(xs),
        "max": max(xs),
        "values": list(values),
    }


def aggregate(runs: Sequence[RunMetrics]) -> dict:
    """One summary row's numbers over several runs of the same configuration."""
    out: dict[str, Any] = {m: spread([getattr(r, m) for r in runs]) for m in METRICS}
    backends = sorted({b for r in runs for b in r.routed})
    out["computed_prompt_tokens"] = spread([r.computed_prompt_tokens for r in runs])
    out["routed"] = {b: statistics.fmean(r.routed.get(b, 0) for r in runs) for b in backends}
    out["routed_per_run"] = [dict(r.routed) for r in runs]
    out["completed"] = sum(r.completed for r in runs)
    out["failed"] = sum(r.failed for r in runs)
    out["runs"] = len(runs)
    return out


def oracle(rows: Sequence[Mapping], *, group: Sequence[str], metric: str = "makespan_s",
           single: Iterable[str] = ()) -> list[dict]:
    """Best variant in hindsight per group of rows, and every row's distance from it.

    `rows` are summary rows (with `policy`, `failed` and `metric` as a `spread` dict); rows
    sharing the values of `group` keys (e.g. workload and N) compete. Lower `metric` wins, but
    only among rows without failed requests: a run that dropped requests finished less work,
    so its makespan flatters it (seen: a peer that failed 117 of 128 requests ranked first).
    Such rows are still listed, after the others, with `failed` and `excluded: True`, and no
    gap. For each eligible row: `gap_pct` from the best; and, if `single` names the
    single-backend variants, the gap `vs_single_s` to the best of those and whether it lies
    within the run-to-run spread (`within_spread`: worse by no more than the larger of the two
    rows' std). A group whose every row failed somewhere has `best` None.
    """
    single = set(single)
    groups: dict[tuple, list[Mapping]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in group), []).append(row)
    out = []
    for key, members in groups.items():
        scored = [(m[metric]["mean"], m) for m in members if m[metric]["mean"] is not None]
        excluded = [m for m in members if m.get("failed")]
        eligible = [(v, m) for v, m in scored if not m.get("failed")]
        if not scored and not excluded:
            continue
        best_value, best = min(eligible, key=lambda x: x[0]) if eligible else (None, None)
        singles = [(v, m) for v, m in eligible if m["policy"] in single]
        best_single = min(singles, key=lambda x: x[0]) if singles else None
        entry = {**dict(zip(group, key)), "metric": metric, "best": best["policy"] if best else None,
                 "best_value": best_value, "best_single": best_single[1]["policy"] if best_single else None,
                 "policies": []}
        for value, m in sorted(eligible, key=lambda x: x[0]):
            p = {"policy": m["policy"], "value": value, "std": m[metric]["std"], "failed": 0,
                 "gap_pct": 100.0 * (value / best_value - 1) if best_value else 0.0}
            if best_single is not None:
                s_value, s_row = best_single
                p["vs_single_s"] = value - s_value
                p["within_spread"] = value - s_value <= max(m[metric]["std"] or 0.0, s_row[metric]["std"] or 0.0)
            entry["policies"].append(p)
        for m in excluded:
            entry["policies"].append({"policy": m["policy"], "value": m[metric]["mean"], "std": m[metric]["std"],
                                      "failed": m["failed"], "excluded": True})
        out.append(entry)
    return out


# ---- decisions ----


def decision_line(decision: RoutingDecision, t0: float = 0.0, **extra: Any) -> dict:
    """A `RoutingDecision` as one `decisions.jsonl` object (the router issue's format).

    `t` is seconds since `t0` (the run's first submission); rates are tokens/s, scores
    seconds. For `seed-score` the prefill/decode tokens are the backend's totals including the
    new request, so `score == prefill_tokens / prefill_rate + decode_tokens / decode_rate`.
    """
    return {
        "t": decision.time - t0,
        "request_id": decision.request_id,
        "policy": decision.policy,
        "chosen": decision.backend,
        "candidates": [
            {
                "backend": s.name,
                "cached_tokens": s.cached_tokens,
                "prefill_tokens": s.prefill_tokens,
                "decode_tokens": s.decode_tokens,
                "prefill_rate": s.rates.prefill_tok_s,
                "decode_rate": s.rates.decode_tok_s,
                "score": s.score_s if math.isfinite(s.score_s) else None,
            }
            for s in decision.scores
        ],
        **extra,
    }


def seed_formula(candidate: Mapping) -> float:
    """The study's score recomputed from one recorded candidate's terms."""
    def part(tokens: float, rate: float) -> float:
        return 0.0 if tokens <= 0 else (tokens / rate if rate > 0 else math.inf)

    return part(candidate["prefill_tokens"], candidate["prefill_rate"]) + part(
        candidate["decode_tokens"], candidate["decode_rate"])


def run_order(variants: list, run: int) -> list:
    """The variants in the order run `run` takes them: the list rotated by `run`, so each takes
    every place once in `len(variants)` runs and none always runs first, or right after the
    same one, so a variant's place in the order cannot decide a comparison."""
    k = run % len(variants) if variants else 0
    return variants[k:] + variants[:k]
