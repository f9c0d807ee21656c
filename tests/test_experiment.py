"""The experiment runner (`engine.experiment`) that `tandem bench seed|grid` and the app's
Experiments panel share, on the tiny synthetic model: two CPU backends, no Qt."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from waiting import WAIT, wait_until

from engine.backends.config import parse_backend_specs
from engine.core.events import RequestFinished
from engine.engine import Engine
from engine.experiment import EngineRunner, Variant, experiment_runner
from engine.sim.arrivals import ArrivalClock
from engine.sim.benchmark import makespan, run_metrics
from engine.sim.workload import TOKEN_HIGH, build_workload, seed_workload

SPEC = seed_workload(3, prefix_tokens=32, suffix_tokens=4, gen_tokens=4, interval_s=0.01)


@pytest.fixture(scope="module")
def engine(tiny_path):
    eng = Engine.load(tiny_path, parse_backend_specs(["cpu:threads=1,cap=2,ctx=1024,name=a",
                                                      "cpu:threads=1,cap=2,ctx=1024,name=b"]))
    yield eng
    eng.close()


def workload(eng):
    return build_workload(replace(SPEC, vocab_size=min(eng.model.n_vocab, TOKEN_HIGH)), 0)


def test_an_experiment_records_every_request_of_its_workload(engine):
    summary = experiment_runner(engine)(SPEC, "round-robin", 0, on_done=None)
    assert (summary.policy, summary.metrics.completed, summary.metrics.failed) == ("round-robin", 3, 0)


def test_on_done_is_called_once_per_request(engine):
    done = []
    experiment_runner(engine)(SPEC, "round-robin", 0, on_done=lambda: done.append(1))
    assert len(done) == 3


def test_a_closed_clock_submits_nothing(engine):
    clock = ArrivalClock()
    clock.close()
    summary = experiment_runner(engine)(SPEC, "round-robin", 0, on_done=None, clock=clock)
    assert summary.metrics.requests == 0


def test_a_run_after_a_capped_variant_restores_the_loaded_cap(engine):
    runner = EngineRunner(engine, sweep_backend="a", budget="raw", online=False, timeout=60.0)
    try:
        wl = workload(engine)
        runner.run(wl, Variant(label="a@cap=1", policy="only:a", cap=1))
        assert engine.backends["a"].cap == 1
        runner.run(wl, Variant(label="a", policy="only:a"))
        assert engine.backends["a"].cap == 2
    finally:
        runner.close()


def test_every_request_of_a_single_backend_variant_runs_there(engine):
    runner = EngineRunner(engine, sweep_backend=None, budget="raw", online=False, timeout=60.0)
    try:
        got = runner.run(workload(engine), Variant(label="only b", policy="only:b"))
    finally:
        runner.close()
    assert {r.backend for r in got.records} == {"b"}


def test_a_pause_with_nothing_in_flight_is_left_out_of_the_makespan(engine):
    clock = ArrivalClock()
    clock.pause()  # before the runner's fresh state: the first arrival waits for a step
    clock.step()
    runner = EngineRunner(engine, sweep_backend=None, budget="raw", online=False, timeout=60.0)
    ended = []  # generated requests that finished (a prefix warm-up generates nothing)
    unsubscribe = engine.bus.subscribe(lambda e: e.record.output_tokens and ended.append(e), (RequestFinished,))
    got = []
    t = threading.Thread(target=lambda: got.append(runner.run(workload(engine), Variant("rr", "round-robin"),
                                                              clock=clock)))
    try:
        t.start()
        wait_until(lambda: len(ended) == 1, what="the stepped request's end")
        time.sleep(1.0)  # paused, nothing in flight
        clock.resume()
        t.join(WAIT)
    finally:
        clock.close()
        unsubscribe()
        runner.close()
    (collected,) = got
    (pause,) = collected.pauses
    first_end = min(r.t_end_s for r in collected.records)
    m = run_metrics(collected.records, collected.pauses)
    # idle from the stepped request's end until the resume, as the clock recorded it
    assert m.paused_s == pytest.approx(pause[1] - first_end)
    assert m.paused_s >= 1.0
    assert m.makespan_s == pytest.approx(makespan(collected.records) - m.paused_s)
