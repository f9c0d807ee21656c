"""Prometheus metrics of a real engine (tiny synthetic model, two CPU backends).

Counters and histograms are fed by the engine's `RequestFinished` events; gauges and cache
counters are read from snapshots at scrape time. Every wait is bounded.
"""

from __future__ import annotations

import threading

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_until

from engine.backends.config import parse_backend_specs
from engine.core.metrics import ITL_BUCKETS, EngineMetrics, _WeightedHistogram
from engine.core.request import FinishRecord, RequestStatus, SamplingParams
from engine.engine import Engine

WAIT = 60
SPECS = ["cpu:threads=1,cap=4,ctx=1024", "cpu:threads=1,cap=4,ctx=1024"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def engine():
    eng = Engine.load("synthetic:tiny", parse_backend_specs(SPECS))
    yield eng
    eng.close()


@pytest.fixture
def metrics(engine):
    engine.flush(timeout=WAIT)
    m = EngineMetrics(engine)
    yield m
    m.close()


def value(m: EngineMetrics, name: str, **labels) -> float:
    v = m.registry.get_sample_value(name, labels)
    assert v is not None, f"no sample {name}{labels}"
    return v


def run(engine, prompts, backend=None, sampling=GREEDY):
    handles = [engine.generate(p, sampling, backend=backend) for p in prompts]
    return [h.result(WAIT) for h in handles]


def test_every_backend_has_every_series_from_the_start(engine, metrics):
    for b in engine.backends:
        for reason in ("stop", "length", "abort", "error"):
            assert value(metrics, "tandem:request_success_total", backend=b, finished_reason=reason) == 0
        assert value(metrics, "tandem:time_to_first_token_seconds_count", backend=b) == 0
        assert value(metrics, "tandem:inter_token_latency_seconds_count", backend=b) == 0
        assert value(metrics, "tandem:num_requests_running", backend=b) == 0
        assert value(metrics, "tandem:kv_cache_usage_perc", backend=b) == 0
        assert value(metrics, "tandem:backend_healthy", backend=b) == 1
    families = {f.name for f in text_string_to_metric_families(metrics.render().decode())}
    assert {"tandem:time_to_first_token_seconds", "tandem:inter_token_latency_seconds",
            "tandem:e2e_request_latency_seconds", "tandem:num_requests_running", "tandem:num_requests_waiting",
            "tandem:kv_cache_usage_perc", "tandem:prefix_cache_queries", "tandem:prefix_cache_hits",
            "tandem:request_success"} <= families


def test_registries_are_per_engine_not_global(engine, metrics):
    other = EngineMetrics(engine)
    try:
        assert other.registry is not metrics.registry
        assert REGISTRY.get_sample_value("tandem:request_success_total",
                                         {"backend": "cpu0", "finished_reason": "length"}) is None
    finally:
        other.close()


def test_finished_requests_update_the_request_metrics(engine, metrics):
    records = run(engine, ["alpha beta", "gamma delta", "alpha beta gamma"], backend="cpu0")
    assert all(r.finish_reason == "length" and r.output_tokens == 10 for r in records)
    wait_until(lambda: value(metrics, "tandem:e2e_request_latency_seconds_count", backend="cpu0") == 3,
               what="three finishes counted")
    assert value(metrics, "tandem:request_success_total", backend="cpu0", finished_reason="length") == 3
    assert value(metrics, "tandem:request_success_total", backend="cpu1", finished_reason="length") == 0
    assert value(metrics, "tandem:generation_tokens_total", backend="cpu0") == 30
    assert value(metrics, "tandem:prompt_tokens_total", backend="cpu0") == sum(r.prompt_tokens for r in records)
    assert value(metrics, "tandem:time_to_first_token_seconds_count", backend="cpu0") == 3
    assert value(metrics, "tandem:time_to_first_token_seconds_sum", backend="cpu0") == pytest.approx(
        sum(r.ttft_s for r in records))
    assert value(metrics, "tandem:request_time_per_output_token_seconds_count", backend="cpu0") == 3
    # Inter-token latency: one sample per gap, summing to the records' total gap time.
    assert value(metrics, "tandem:inter_token_latency_seconds_count", backend="cpu0") == 27
    assert value(metrics, "tandem:inter_token_latency_seconds_sum", backend="cpu0") == pytest.approx(
        sum(r.itl_s * 9 for r in records))
    assert value(metrics, "tandem:inter_token_latency_seconds_bucket", backend="cpu0", le="+Inf") == 27


def test_cache_metrics_come_from_snapshots(engine, metrics):
    q0 = value(metrics, "tandem:prefix_cache_queries_total", backend="cpu1")
    h0 = value(metrics, "tandem:prefix_cache_hits_total", backend="cpu1")
    (first,) = run(engine, ["the same long prompt, twice over"], backend="cpu1")
    (second,) = run(engine, ["the same long prompt, twice over"], backend="cpu1")
    snap = engine.backend("cpu1").snapshot()
    assert value(metrics, "tandem:prefix_cache_queries_total", backend="cpu1") - q0 == 2 * first.prompt_tokens
    assert value(metrics, "tandem:prefix_cache_hits_total", backend="cpu1") - h0 == first.prompt_tokens - 1
    assert second.cached_tokens == first.prompt_tokens - 1
    assert value(metrics, "tandem:prompt_tokens_cached_total", backend="cpu1") == second.cached_tokens
    assert value(metrics, "tandem:kv_cache_cells_used", backend="cpu1") == snap.kv_cells_used > 0
    assert value(metrics, "tandem:kv_cache_usage_perc", backend="cpu1") == pytest.approx(
        snap.kv_cells_used / snap.kv_cells_total)
    engine.flush(timeout=WAIT)
    assert value(metrics, "tandem:kv_cache_usage_perc", backend="cpu1") == 0


def test_queue_gauges_are_read_at_scrape_time(engine, metrics):
    backend = engine.backend("cpu0")
    gate, held = threading.Event(), threading.Event()
    blocker = backend.call(lambda b: (held.set(), gate.wait(WAIT)))  # the worker waits between steps
    try:
        assert held.wait(WAIT)
        handles = [engine.generate(f"prompt {i}", GREEDY, backend="cpu0") for i in range(6)]
        assert value(metrics, "tandem:num_requests_waiting", backend="cpu0") == 6
        assert value(metrics, "tandem:num_requests_running", backend="cpu0") == 0
        assert value(metrics, "tandem:max_num_seqs", backend="cpu0") == 4
    finally:
        gate.set()
    blocker.result(WAIT)
    for h in handles:
        h.result(WAIT)
    wait_until(lambda: value(metrics, "tandem:num_requests_waiting", backend="cpu0") == 0)
    assert value(metrics, "tandem:num_requests_running", backend="cpu0") == 0


def _finished(metrics, backend: str) -> float:
    return sum(value(metrics, "tandem:request_success_total", backend=backend, finished_reason=r)
               for r in ("stop", "length", "abort", "error"))


def test_a_cancelled_request_counts_as_abort(engine, metrics):
    backend = engine.backend("cpu1")
    gate, held = threading.Event(), threading.Event()
    blocker = backend.call(lambda b: (held.set(), gate.wait(WAIT)))
    try:
        assert held.wait(WAIT)
        h = engine.generate("cancelled early", GREEDY, backend="cpu1")
        h.cancel()
    finally:
        gate.set()
    blocker.result(WAIT)
    cancelled = h.result(WAIT)
    assert cancelled.status == RequestStatus.FINISHED_CANCELLED
    wait_until(lambda: value(metrics, "tandem:request_success_total", backend="cpu1", finished_reason="abort") == 1)
    assert _finished(metrics, "cpu1") == 1
    # (The cancel may land after the first step: then the request did have a first token.)
    assert value(metrics, "tandem:time_to_first_token_seconds_count", backend="cpu1") == (
        cancelled.ttft_s is not None)


def test_a_warm_up_is_not_a_request(engine, metrics):
    engine.warm(engine.model.tokenize("a warm prefix"), backend="cpu1", timeout=WAIT)
    run(engine, ["after the warm-up"], backend="cpu1")  # counted after whatever the warm-up published
    wait_until(lambda: value(metrics, "tandem:request_success_total", backend="cpu1", finished_reason="length") == 1)
    assert _finished(metrics, "cpu1") == 1, "the warm-up is not a request"


def _record(status, output_tokens=3, backend="cpu0", itl=0.01):
    return FinishRecord(request_id="r", backend=backend, status=status, text="", prompt_tokens=5,
                        cached_tokens=-1, output_tokens=output_tokens, queue_s=0.001,
                        ttft_s=0.02 if output_tokens else None, e2e_s=0.05,
                        itl_s=itl if output_tokens > 1 else None)


@pytest.mark.parametrize("status,output_tokens,reason", [
    (RequestStatus.FINISHED_STOPPED, 3, "stop"),
    (RequestStatus.FINISHED_LENGTH, 3, "length"),
    (RequestStatus.FINISHED_CANCELLED, 0, "abort"),
    (RequestStatus.FINISHED_CANCELLED, 2, "abort"),
    (RequestStatus.FINISHED_ERROR, 0, "error"),
    (RequestStatus.FINISHED_STOPPED, 0, None),  # a warm-up: not counted
])
def test_finish_status_maps_to_vllm_finished_reason(engine, metrics, status, output_tokens, reason):
    metrics.observe(_record(status, output_tokens))
    counts = {r: value(metrics, "tandem:request_success_total", backend="cpu0", finished_reason=r)
              for r in ("stop", "length", "abort", "error")}
    assert counts == {r: float(r == reason) for r in counts}
    assert value(metrics, "tandem:prompt_tokens_cached_total", backend="cpu0") == 0  # -1 (unknown) adds nothing


def test_weighted_histogram_buckets_are_cumulative():
    # The module's own histogram type (one observation weighs n samples): tested as the pure helper it is.
    h = _WeightedHistogram("x_seconds", "test", ITL_BUCKETS)
    h.observe("b", 0.003, 5)
    h.observe("b", 0.2, 2)
    h.observe("b", 1000.0)
    (family,) = h.collect()
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("x_seconds_bucket", "0.0025")] == 0
    assert samples[("x_seconds_bucket", "0.005")] == 5
    assert samples[("x_seconds_bucket", "0.2")] == 7
    assert samples[("x_seconds_bucket", "80.0")] == 7
    assert samples[("x_seconds_bucket", "+Inf")] == 8
    assert samples[("x_seconds_count", None)] == 8
    assert samples[("x_seconds_sum", None)] == pytest.approx(0.015 + 0.4 + 1000.0)


def test_close_unsubscribes(engine):
    m = EngineMetrics(engine)
    m.close()
    run(engine, ["after close"], backend="cpu0")
    assert value(m, "tandem:request_success_total", backend="cpu0", finished_reason="length") == 0
