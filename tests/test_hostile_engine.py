"""A fleet with a hostile engine: the router (an `Engine` of `RemoteBackend`s) stays up, its
memory bounded, and every client gets an answer or a clean error within the deadlines.

The engines are small aiohttp servers in this process (`FakeEngine`), each with one manner:
`good` (a proper OpenAI stream), `silent` (takes the request, never answers), `slow` (one
token, then nothing), `types` (`"text": 12345`), `endless` (ignores `max_tokens`), `huge`
(a 256 MB `/health` body), `bignum` (a 400-digit `completion_tokens`), `bigcached` (a
400-digit `cached_tokens`), `crowd` (vLLM gauges claiming 10^11 requests of others). Every
wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest
from aiohttp import web
from waiting import wait_until

from engine.backends.remote import RemoteBackend
from engine.backends.remote.config import RemoteConfig
from engine.backends.remote.probe import MAX_EXTERNAL
from engine.core.events import EventBus
from engine.core.request import Request, RequestStatus, SamplingParams
from engine.engine import Engine
from engine.routing import Router

WAIT = 30
FIRST_TOKEN_S = 1.0
TOKEN_GAP_S = 1.0
HUGE = 256 << 20


class FakeEngine:
    """An OpenAI-compatible engine with one manner (see the module docstring)."""

    def __init__(self, manner: str):
        self.manner = manner
        self.requests = 0
        self.health_bytes_sent = 0
        self.hold = asyncio.Event()  # never set: what silent engines wait on
        app = web.Application()
        app.add_routes([web.get("/health", self.health), web.get("/v1/models", self.models),
                        web.post("/v1/completions", self.complete), web.post("/v1/chat/completions", self.complete),
                        web.get("/metrics", self.metrics)])
        self.app = app

    async def health(self, request: web.Request) -> web.StreamResponse:
        if self.manner != "huge":
            return web.json_response({"status": "ok"})
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        block = b" " * (1 << 20)
        try:
            await response.write(b'{"status": "ok", "pad": "')
            for _ in range(HUGE // len(block)):
                await response.write(block)
                self.health_bytes_sent += len(block)
            await response.write(b'"}')
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    async def metrics(self, request: web.Request) -> web.Response:
        if self.manner != "crowd":
            raise web.HTTPNotFound()
        return web.Response(text="vllm:num_requests_running 1e11\nvllm:num_requests_waiting 1e11\n",
                            content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.json()
        if self.manner == "silent":
            await self.hold.wait()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def event(obj) -> None:
            await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def chunk(text, finish=None):
            return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}

        try:
            if self.manner == "types":
                await event(chunk(12345))
            elif self.manner == "slow":
                await event(chunk("one"))
                await self.hold.wait()
            elif self.manner == "endless":
                while True:  # max_tokens means nothing here
                    await event(chunk("word "))
                    await asyncio.sleep(0)
            else:
                n = body.get("max_tokens", 4)
                for i in range(n):
                    await event(chunk(f"t{i} ", "length" if i == n - 1 else None))
                usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
                if self.manner == "bignum":
                    usage["completion_tokens"] = usage["total_tokens"] = 10**400
                if self.manner == "bigcached":
                    usage["prompt_tokens_details"] = {"cached_tokens": 10**400}
                await event({"choices": [], "usage": usage})
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response


class Fakes:
    """Fake engines served on one loop thread; `url(manner)`."""

    def __init__(self, manners):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-engines", daemon=True)
        self.thread.start()
        self.engines = {m: FakeEngine(m) for m in manners}
        self.runners = {}
        self.urls = {}
        for m, e in self.engines.items():
            runner = web.AppRunner(e.app, handler_cancellation=True)
            self._run(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            self._run(site.start())
            self.runners[m] = runner
            self.urls[m] = f"http://127.0.0.1:{runner.addresses[0][1]}"

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT)

    def close(self):
        for r in self.runners.values():
            self._run(r.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT)
        self.loop.close()


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def fakes():
    f = Fakes(["good", "silent", "slow", "types", "endless", "huge", "bignum", "bigcached", "crowd"])
    yield f
    f.close()


def fleet(fakes, *manners, **config) -> Engine:
    bus = EventBus()
    cfg = dict(first_token_s=FIRST_TOKEN_S, token_gap_s=TOKEN_GAP_S, health_s=0.2, poll_s=0.2, api="openai",
               quarantine_s=60.0) | config
    backends = [RemoteBackend(RemoteConfig(url=fakes.urls[m], name=m, **cfg), bus).start() for m in manners]
    return Engine(backends, Router("round-robin"), bus)


def ask(engine: Engine, backend: str | None = None, max_tokens: int = 8, stream: bool = True, wait: float = WAIT):
    req = Request((), SamplingParams(temperature=0.0, max_tokens=max_tokens), text="hello", backend=backend,
                  stream=stream)
    t0 = time.monotonic()
    handle = engine.submit(req)
    record = handle.result(wait)
    return record, time.monotonic() - t0


def test_a_silent_engine_fails_its_pinned_request_within_the_first_token_deadline(fakes):
    eng = fleet(fakes, "good", "silent")
    try:
        record, took = ask(eng, "silent")
        assert record.status == RequestStatus.FINISHED_ERROR and "first" in record.error, record.error
        assert took < FIRST_TOKEN_S + 3, took
    finally:
        eng.close()


def test_a_silent_engine_stays_unhealthy_though_its_health_answers(fakes):
    eng = fleet(fakes, "good", "silent")
    try:
        ask(eng, "silent")
        silent = eng.backends["silent"]
        assert not silent.healthy
        probes_before = fakes.engines["silent"].requests
        time.sleep(1.0)  # five health periods: /health answers 200 every time
        assert not silent.healthy and silent.snapshot().healthy is False
        # and nothing more was sent to it meanwhile
        for _ in range(4):
            record, _ = ask(eng)
            assert record.status == RequestStatus.FINISHED_LENGTH and record.backend == "good"
        assert fakes.engines["silent"].requests == probes_before
    finally:
        eng.close()


def test_an_unpinned_request_on_a_silent_engine_is_answered_elsewhere(fakes):
    eng = fleet(fakes, "silent", "good")
    try:
        records = [ask(eng)[0] for _ in range(2)]  # round-robin: one of them lands on the silent one first
        assert all(r.status == RequestStatus.FINISHED_LENGTH and r.backend == "good" for r in records), records
    finally:
        eng.close()


def test_an_engine_that_stops_mid_stream_ends_within_the_inter_token_deadline(fakes):
    eng = fleet(fakes, "good", "slow")
    try:
        record, took = ask(eng, "slow")
        assert record.status == RequestStatus.FINISHED_ERROR, record
        assert took < FIRST_TOKEN_S + TOKEN_GAP_S + 3, took
    finally:
        eng.close()


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_reply_of_the_wrong_type_is_a_clean_error_for_that_request_alone(fakes, stream):
    eng = fleet(fakes, "good", "types")
    try:
        record, took = ask(eng, "types", stream=stream)
        assert record.status == RequestStatus.FINISHED_ERROR and record.error_kind == "server_error"
        assert "choices[].text" in record.error and took < WAIT
        assert eng.backends["types"].healthy  # the engine answered; one reply was bad
        good, _ = ask(eng, "good")
        assert good.status == RequestStatus.FINISHED_LENGTH
    finally:
        eng.close()


def test_an_engine_that_ignores_max_tokens_is_cut_at_the_request_s_bound(fakes):
    eng = fleet(fakes, "endless")
    try:
        record, took = ask(eng, "endless", max_tokens=20)
        assert record.status == RequestStatus.FINISHED_LENGTH
        assert record.output_tokens <= 20 and len(record.text) <= 20 * len("word "), len(record.text)
        assert took < 5, took
    finally:
        eng.close()


def test_a_huge_health_body_makes_the_engine_unhealthy_without_growing_memory(fakes):
    before = rss_bytes()
    eng = fleet(fakes, "good", "huge")
    try:
        huge = eng.backends["huge"]
        wait_until(lambda: fakes.engines["huge"].health_bytes_sent > 0, WAIT, "a huge /health probe")
        time.sleep(1.0)  # several probes
        assert not huge.healthy and "bytes" in (huge.error or ""), huge.error
        grown = rss_bytes() - before
        assert grown < 64 << 20, f"the router grew by {grown >> 20} MB"
        record, _ = ask(eng)
        assert record.status == RequestStatus.FINISHED_LENGTH and record.backend == "good"
    finally:
        eng.close()


# ---- counts no float holds ----

ANSWER_S = 10  # a normal request here takes milliseconds


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned"])
def test_a_400_digit_completion_count_still_gets_the_request_answered(fakes, pinned):
    eng = fleet(fakes, "bignum")
    try:
        for stream in (True, False):
            record, took = ask(eng, "bignum" if pinned else None, max_tokens=8, stream=stream, wait=ANSWER_S)
            assert record.status == RequestStatus.FINISHED_LENGTH and record.error is None, record
            assert record.output_tokens == 8 and record.text == "t0 t1 t2 t3 t4 t5 t6 t7 "
            assert took < ANSWER_S
        assert eng.backends["bignum"].healthy
        assert float(eng.snapshot()[0].rates.decode_tok_s) > 0  # the online rates stayed finite
    finally:
        eng.close()


def test_a_400_digit_cached_count_is_clamped_below_the_prompt(fakes, caplog):
    from engine.core.metrics import EngineMetrics

    eng = fleet(fakes, "bigcached")
    metrics = EngineMetrics(eng)
    try:
        with caplog.at_level(logging.WARNING):
            record, _ = ask(eng, wait=ANSWER_S)
        assert record.status == RequestStatus.FINISHED_LENGTH and record.prompt_tokens == 3
        assert record.cached_tokens == 3  # at most the prompt the engine said it had
        assert b'tandem:prompt_tokens_total{backend="bigcached"} 3.0' in metrics.render()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    finally:
        metrics.close()
        eng.close()


def test_an_engine_claiming_a_vast_load_is_priced_within_a_bound(fakes):
    eng = fleet(fakes, "crowd", api="vllm")
    crowd = eng.backends["crowd"]
    try:
        wait_until(lambda: any(i.request_id.startswith("external:") for i in crowd.snapshot().items), WAIT,
                   "the engine's claimed load in the snapshot")
        t0 = time.monotonic()
        items = crowd.snapshot().items
        assert len(items) <= 2 * MAX_EXTERNAL and time.monotonic() - t0 < 1.0
        record, _ = ask(eng, "crowd", wait=ANSWER_S)  # it still serves
        assert record.status == RequestStatus.FINISHED_LENGTH
    finally:
        eng.close()


def test_a_finish_that_fails_still_ends_the_request_with_an_error(fakes, monkeypatch):
    """A bug while finishing (here: the online rates raising) ends the request, never hangs it."""
    from engine.backends.remote.online import OnlineRates

    def broken(self, record, batch):
        raise ZeroDivisionError("a bug while finishing")

    monkeypatch.setattr(OnlineRates, "observe", broken)
    eng = fleet(fakes, "good")
    try:
        record, took = ask(eng, "good", wait=ANSWER_S)
        assert record.status == RequestStatus.FINISHED_ERROR and record.error_kind == "server_error"
        assert "ZeroDivisionError" in record.error and took < ANSWER_S
        monkeypatch.undo()
        again, _ = ask(eng, "good", wait=ANSWER_S)  # the backend goes on serving
        assert again.status == RequestStatus.FINISHED_LENGTH
    finally:
        eng.close()


def test_a_failed_hand_over_still_ends_the_requests(fakes):
    """The engine's `on_unhealthy` raising (a bug there) ends the silent engine's requests with
    its error instead of leaving them hanging."""
    backend = RemoteBackend(RemoteConfig(url=fakes.urls["silent"], name="silent", first_token_s=FIRST_TOKEN_S,
                                         token_gap_s=TOKEN_GAP_S, health_s=0.2, poll_s=0.2, api="openai")).start()

    def broken(failed, moved):
        raise RuntimeError("a bug while re-routing")

    backend.on_unhealthy = broken
    try:
        handles = [backend.enqueue(Request((), SamplingParams(max_tokens=4), text="hi")) for _ in range(2)]
        records = [h.result(ANSWER_S) for h in handles]
        assert all(r.status == RequestStatus.FINISHED_ERROR and "silent" in r.error for r in records), records
    finally:
        backend.stop()
