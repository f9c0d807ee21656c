"""Restarting backends through the real HTTP server: serialised per backend (a second restart
while one runs is a 409, never a crash or a 500), and a healthy backend's queue moves to the
other backend instead of failing. The tiny synthetic model, two CPU backends; bounded waits."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
from test_server import LoopThread
from waiting import WAIT, wait_until

from app.server import create_app
from engine.backends.config import parse_backend_specs
from engine.core.errors import RestartInProgress
from engine.core.request import Request, SamplingParams
from engine.engine import Engine

MODEL = "synthetic:tiny"
SPECS = ["cpu:threads=1,cap=1,ctx=1024", "cpu:threads=1,cap=4,ctx=1024"]


@pytest.fixture
def served():
    lt = LoopThread()
    try:
        with Engine.load(MODEL, parse_backend_specs(SPECS)) as eng, lt.serving(create_app(eng)) as base:
            yield eng, base
    finally:
        lt.close()


@pytest.mark.parametrize("n", [10, 50])
def test_parallel_restarts_answer_200_or_409_without_harm(served, n):
    eng, base = served
    barrier = threading.Barrier(n, timeout=WAIT)

    def restart(_):
        with httpx.Client(base_url=base, timeout=WAIT) as http:
            barrier.wait()
            return http.post("/v1/backends/cpu0/restart")

    with ThreadPoolExecutor(n) as pool:
        replies = list(pool.map(restart, range(n)))
    codes = sorted({r.status_code for r in replies})
    assert set(codes) <= {200, 409}, [r.text for r in replies if r.status_code not in (200, 409)]
    assert 200 in codes
    conflict = next((r for r in replies if r.status_code == 409), None)
    if conflict is not None:
        assert conflict.json()["error"]["code"] == "restart_in_progress"
    with httpx.Client(base_url=base, timeout=WAIT) as http:
        assert http.get("/health").status_code == 200
        for backend in ("cpu0", "cpu1"):
            r = http.post("/v1/completions", json={"prompt": [1, 40, 41], "max_tokens": 4, "backend": backend})
            assert r.status_code == 200, r.text
    assert all(s.healthy for s in eng.snapshot())


def test_a_restart_while_one_runs_raises_restart_in_progress(served):
    eng, _ = served
    b = eng.backends["cpu0"]
    gate, held = threading.Event(), threading.Event()
    blocker = b.call(lambda _: (held.set(), gate.wait(WAIT)))  # the drain waits behind this call
    assert held.wait(WAIT)
    first = threading.Thread(target=eng.restart, args=("cpu0",), daemon=True)
    first.start()
    try:
        wait_until(lambda: not b.snapshot().healthy, what="the first restart began")
        with pytest.raises(RestartInProgress):
            eng.restart("cpu0")
    finally:
        gate.set()
        blocker.result(WAIT)
        first.join(WAIT)
    assert not first.is_alive() and b.snapshot().healthy


def test_restarting_a_healthy_backend_moves_its_queue(served):
    """cpu0 (cap 1) runs a long request with five queued behind it; restarting cpu0 hands the
    five to cpu1, where they finish; only the running one, which had produced text, ends."""
    eng, _ = served
    b = eng.backends["cpu0"]
    long = b.enqueue(Request((1, 40, 41), SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)))
    queued = [b.enqueue(Request((1, 50 + i, 60 + i), SamplingParams(temperature=0, max_tokens=8)))
              for i in range(5)]
    wait_until(lambda: any(i.running and i.generated > 0 for i in b.snapshot().items), what="cpu0 decoding",
               unless=lambda: long.done)
    eng.restart("cpu0")
    records = [h.result(WAIT) for h in queued]
    assert [r.error for r in records] == [None] * 5
    assert {r.backend for r in records} == {"cpu1"}
    assert long.result(WAIT).status.finished
    assert b.snapshot().healthy and not b.snapshot().items


def test_restarts_under_traffic_lose_no_request(served):
    """Completions keep coming while cpu0 restarts ten times: what was queued or had produced
    nothing moves to cpu1, what had produced text finishes first (bounded), and every reply is
    a 200 (such restarts used to answer dozens of requests with 503 "shut down")."""
    _eng, base = served
    stop = threading.Event()
    codes: list[int] = []

    def traffic(i):
        with httpx.Client(base_url=base, timeout=WAIT) as http:
            while not stop.is_set():
                r = http.post("/v1/completions", json={"prompt": [1, 40 + i], "max_tokens": 16})
                codes.append(r.status_code)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(traffic, i) for i in range(4)]
        try:
            with httpx.Client(base_url=base, timeout=WAIT) as http:
                wait_until(lambda: len(codes) >= 4, what="traffic flowing")
                restarts = [http.post("/v1/backends/cpu0/restart").status_code for _ in range(10)]
        finally:
            stop.set()
        for f in futures:
            f.result(WAIT)
    assert restarts == [200] * 10
    assert len(codes) > 10 and set(codes) == {200}, sorted(set(codes))


def test_requests_queued_during_a_restart_of_the_only_backend_get_503_with_retry_after():
    """One backend (cap 1) runs a long request with HTTP requests queued behind it; restarting
    it leaves them nowhere to go: each gets 503 and Retry-After (clients that retry only on
    503 or 429 retry), not a 500."""
    lt = LoopThread()
    try:
        with Engine.load(MODEL, parse_backend_specs(["cpu:threads=1,cap=1,ctx=4096"])) as eng, \
                lt.serving(create_app(eng)) as base:
            name = next(iter(eng.backends))
            b = eng.backends[name]
            long = b.enqueue(Request((1, 40, 41), SamplingParams(temperature=0, max_tokens=3500, ignore_eos=True)))
            wait_until(lambda: any(i.running and i.generated > 0 for i in b.snapshot().items), what="decoding")
            with ThreadPoolExecutor(3) as pool:
                replies = [pool.submit(httpx.post, base + "/v1/completions",
                                       json={"prompt": f"q{i}", "max_tokens": 4}, timeout=WAIT) for i in range(3)]
                wait_until(lambda: sum(not i.running for i in b.snapshot().items) == 3, what="three queued")
                eng.restart(name)
                rs = [f.result(WAIT) for f in replies]
            assert [r.status_code for r in rs] == [503] * 3, [r.text for r in rs]
            assert all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "unavailable_error"
                       for r in rs)
            long.result(WAIT)
    finally:
        lt.close()
