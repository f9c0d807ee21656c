"""The OpenAI-compatible server on a real engine (the tiny synthetic model, two CPU backends).

A real aiohttp server runs on a loop in a background thread (127.0.0.1, a free port) and is
driven with the official `openai` client, raw HTTP (httpx) and schemathesis. One test starts
`tandem serve` itself as a subprocess. Every wait is bounded; fixtures yield, then close.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx  # the `openai` client's own HTTP library (httpx's API)
import openai
import pytest
from aiohttp import web
from waiting import wait_until

from app.server import create_app, start_server
from engine.backends.config import parse_backend_specs
from engine.core.events import StepDone
from engine.engine import Engine
from engine.llama.model import resolve_model

WAIT = 60  # seconds: the bound on any single wait
MODEL = "synthetic:tiny"
SPECS = ["cpu:threads=1,cap=4,ctx=1024", "cpu:threads=1,cap=4,ctx=1024"]
KEY = "sk-test-key"
HELLO = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


# ---- harness ----


class LoopThread:
    """An asyncio loop in a daemon thread, for servers the test thread talks to over HTTP."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = WAIT):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: web.Application) -> tuple[web.AppRunner, str]:
        return self.run(start_server(app, "127.0.0.1", 0))

    @contextlib.contextmanager
    def serving(self, app: web.Application):
        """`app` served on this loop while the block runs; yields its base URL."""
        runner, base = self.serve(app)
        try:
            yield base
        finally:
            self.run(runner.cleanup())

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(WAIT)
        self.loop.close()


class HandlerExits:
    """A middleware that records each finished handler (its `finally` has run by then)."""

    def __init__(self):
        self.paths: list[str] = []
        self._cond = threading.Condition()

    @web.middleware
    async def middleware(self, request, handler):
        try:
            return await handler(request)
        finally:
            with self._cond:
                self.paths.append(request.path)
                self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = WAIT) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.paths) >= n, timeout):
                raise TimeoutError(f"{n} handlers did not finish within {timeout} s (got {self.paths})")


def idle(engine: Engine) -> bool:
    return all(not s.items for s in engine.snapshot())


def kv_state(engine: Engine) -> dict[str, tuple[int, int]]:
    return {name: (b.kv_cells_used(), b.kv_state_bytes()) for name, b in engine.backends.items()}


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- fixtures ----


@pytest.fixture(scope="module")
def engine():
    eng = Engine.load(MODEL, parse_backend_specs(SPECS))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def exits():
    return HandlerExits()


@pytest.fixture(scope="module")
def url(engine, loop_thread, exits):
    """The open server (no API key)."""
    app = create_app(engine, model_id="tiny")
    app.middlewares.append(exits.middleware)
    runner, base = loop_thread.serve(app)
    yield base
    loop_thread.run(runner.cleanup())


@pytest.fixture(scope="module")
def keyed_url(engine, loop_thread):
    """A second server on the same engine that wants an API key."""
    runner, base = loop_thread.serve(create_app(engine, api_key=KEY, model_id="tiny"))
    yield base
    loop_thread.run(runner.cleanup())


@pytest.fixture
def client(url):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT)
    yield c
    c.close()


@pytest.fixture
def http(url):
    with httpx.Client(base_url=url, timeout=WAIT) as c:
        yield c


# ---- the happy paths ----


def test_models_lists_the_served_model(client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].owned_by == "tandem"


def test_chat_stream_text_equals_whole_text_at_temperature_0(client):
    whole = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=24, temperature=0)
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content, "the model produced no text"
    assert choice.finish_reason == "length"  # a synthetic model never picks EOS
    assert whole.usage.completion_tokens == 24
    assert whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    assert whole.object == "chat.completion"

    chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_text_equals_whole_text_at_temperature_0(client):
    whole = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0)
    assert whole.choices[0].text and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 20
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def _by_ids(client, **kw):
    return client.completions.create(model="tiny", prompt=[1, 40, 41, 42, 43], max_tokens=12, temperature=0, **kw)


def test_a_prompt_of_token_ids_is_taken_as_is(client):
    by_ids = _by_ids(client)
    assert by_ids.usage.prompt_tokens == 5 and len(by_ids.choices[0].text) > 4


def test_a_stop_string_cuts_the_reply_before_it(client):
    text = _by_ids(client).choices[0].text
    stop = text[2:4]
    cut = _by_ids(client, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]


def test_the_backend_pin_extension_routes_the_request(client, http):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=HELLO, max_tokens=4, temperature=0, extra_body={"backend": "cpu1"})
    assert raw.headers["x-tandem-backend"] == "cpu1"
    routing = http.get("/v1/routing", params={"n": 1}).json()
    assert [b["name"] for b in routing["backends"]] == ["cpu0", "cpu1"]
    (decision,) = routing["decisions"]
    assert decision["backend"] == "cpu1" and decision["pinned"]
    assert {s["name"] for s in decision["scores"]} == {"cpu0", "cpu1"}


def test_the_ignore_eos_extension_runs_to_max_tokens(client):
    reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4


def test_an_unknown_backend_pin_is_a_400_on_backend(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=HELLO, extra_body={"backend": "nope"})
    assert e.value.body["param"] == "backend"


def test_backends_show_each_live_cap_with_its_reason(http):
    backends = http.get("/v1/backends").json()["backends"]
    assert all({"cap", "cap_ceiling", "cap_adaptive", "cap_reason"} <= set(b) for b in backends)
    assert all(1 <= b["cap"] <= b["cap_ceiling"] and b["cap_reason"] for b in backends)


def test_health_says_ok(http):
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_routing_names_the_policy(http):
    routing = http.get("/v1/routing").json()
    assert routing["policy"] == routing["default_policy"] == "finish-first:pack"  # the engine's default


def test_routing_refuses_a_count_that_is_not_a_number(http):
    assert_openai_error(http.get("/v1/routing", params={"n": "many"}), 400, param="n")


def test_the_openapi_document_lists_the_routes(http):
    doc = http.get("/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics"} <= set(doc["paths"])


# ---- bad input → 4xx ----

LONG = "word " * 1500  # well over the 1024-token context
BAD_BODIES = [
    # (name, body, status, param, code)
    ("not a JSON object", [1, 2], 400, None, None),
    ("messages missing", {"max_tokens": 4}, 400, "messages", None),
    ("messages empty", {"messages": []}, 400, "messages", None),
    ("messages not a list", {"messages": "hi"}, 400, "messages", None),
    ("message without role", {"messages": [{"content": "hi"}]}, 400, "messages", None),
    ("message content a number", {"messages": [{"role": "user", "content": 3}]}, 400, "messages", None),
    ("image content", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages", None),
    ("max_tokens 0", {"messages": HELLO, "max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens negative", {"messages": HELLO, "max_tokens": -3}, 400, "max_tokens", None),
    ("max_tokens a string", {"messages": HELLO, "max_tokens": "8"}, 400, "max_tokens", None),
    ("max_tokens a boolean", {"messages": HELLO, "max_tokens": True}, 400, "max_tokens", None),
    ("max_completion_tokens 0", {"messages": HELLO, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("temperature negative", {"messages": HELLO, "temperature": -0.5}, 400, "temperature", None),
    ("temperature a string", {"messages": HELLO, "temperature": "hot"}, 400, "temperature", None),
    ("top_p 0", {"messages": HELLO, "top_p": 0}, 400, "top_p", None),
    ("top_p above 1", {"messages": HELLO, "top_p": 1.5}, 400, "top_p", None),
    ("top_k negative", {"messages": HELLO, "top_k": -1}, 400, "top_k", None),
    ("min_p above 1", {"messages": HELLO, "min_p": 2}, 400, "min_p", None),
    ("repeat_last_n huge", {"messages": HELLO, "repeat_last_n": 2**40}, 400, "repeat_last_n", None),
    ("seed negative", {"messages": HELLO, "seed": -1}, 400, "seed", None),
    ("stop empty string", {"messages": HELLO, "stop": [""]}, 400, "stop", None),
    ("stop not strings", {"messages": HELLO, "stop": [1]}, 400, "stop", None),
    ("n = 17", {"messages": HELLO, "n": 17}, 400, "n", None),
    ("stream not a boolean", {"messages": HELLO, "stream": "yes"}, 400, "stream", None),
    ("context too long", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages",
     "context_length_exceeded"),
    ("context too long, streamed", {"messages": [{"role": "user", "content": LONG}], "stream": True}, 400,
     "messages", "context_length_exceeded"),
    ("unknown model", {"model": "gpt-4o", "messages": HELLO}, 404, "model", "model_not_found"),
    ("model not a string", {"model": 4, "messages": HELLO}, 400, "model", None),
]


@pytest.mark.parametrize("name,body,status,param,code", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_chat_bodies_get_openai_4xx(http, name, body, status, param, code):
    r = http.post("/v1/chat/completions", json=body)
    assert_openai_error(r, status, param, code)
    assert r.headers["content-type"].startswith("application/json")


BAD_COMPLETIONS = [
    ("prompt missing", {"max_tokens": 4}, 400, "prompt", None),
    ("prompt empty", {"prompt": ""}, 400, "prompt", None),
    ("prompt token out of vocabulary", {"prompt": [1, 10**9]}, 400, "prompt", None),
    ("prompt tokens negative", {"prompt": [-1]}, 400, "prompt", None),
    ("too many prompts", {"prompt": ["a"] * 65}, 400, "prompt", None),
    ("context too long", {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    ("echo not a boolean", {"prompt": "hi", "echo": "yes"}, 400, "echo", None),
]


@pytest.mark.parametrize("name,body,status,param,code", BAD_COMPLETIONS, ids=[b[0] for b in BAD_COMPLETIONS])
def test_bad_completion_bodies_get_openai_4xx(http, name, body, status, param, code):
    assert_openai_error(http.post("/v1/completions", json=body), status, param, code)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                                 b"[" * 100_000])
def test_malformed_bytes_get_400(http, raw):
    r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


def test_unroutable_requests_get_openai_errors(http):
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    r = http.get("/v1/chat/completions")
    assert_openai_error(r, 405)
    assert r.headers["allow"] == "POST"
    assert_openai_error(http.post("/v1/completions", content=b"x" * (5 << 20)), 413)


def test_the_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": LONG}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert e.value.code == "model_not_found"


# ---- auth, 429, 503 ----


def test_api_key_is_required_on_v1_only(keyed_url):
    with httpx.Client(base_url=keyed_url, timeout=WAIT) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2}, headers=headers)
            assert_openai_error(r, 401, code="invalid_api_key")
        assert_openai_error(http.get("/v1/models"), 401)
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
    with openai.OpenAI(base_url=keyed_url + "/v1", api_key=KEY, max_retries=0, timeout=WAIT) as good:
        assert good.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3).usage.completion_tokens == 3
    with openai.OpenAI(base_url=keyed_url + "/v1", api_key="wrong", max_retries=0, timeout=WAIT) as bad, \
            pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.fixture
def one_slot(loop_thread):
    """A served engine whose one backend runs one request and queues one more: (engine, base URL)."""
    with Engine.load(MODEL, parse_backend_specs(["cpu:threads=1,cap=1,max_queue=1,ctx=512"])) as eng, \
            loop_thread.serving(create_app(eng)) as base:
        yield eng, base


def test_a_full_queue_is_429_with_retry_after(one_slot):
    eng, base = one_slot
    (backend,) = eng.backends.values()
    gate = threading.Event()
    try:
        # Hold the worker between steps, so the queue cannot drain: one waiting fills it.
        held = threading.Event()
        blocker = backend.call(lambda b: (held.set(), gate.wait(WAIT)))
        assert held.wait(WAIT)
        queued = eng.generate([1, 40, 41])
        with httpx.Client(base_url=base, timeout=WAIT) as http:
            r = http.post("/v1/completions", json={"prompt": [1, 40], "max_tokens": 2})
        assert_openai_error(r, 429, code="queue_full")
        wait = eng.router.recent()[-1].chosen.queue_wait_s  # the queue's expected wait, in whole seconds
        assert r.headers["retry-after"] == str(min(max(math.ceil(wait), 1), 60))
    finally:
        gate.set()
    blocker.result(WAIT)
    assert queued.result(WAIT).error is None


def test_a_stopped_backend_is_503(one_slot):
    eng, base = one_slot
    (backend,) = eng.backends.values()
    backend.stop()
    with httpx.Client(base_url=base, timeout=WAIT) as http:
        assert_openai_error(http.post("/v1/completions", json={"prompt": [1, 40], "max_tokens": 2}), 503)


# ---- disconnect, load ----


@pytest.mark.parametrize("stream,when", [(True, "mid-stream"), (True, "before the first token"),
                                         (False, "mid-generation")])
def test_a_client_that_leaves_cancels_its_request(engine, url, exits, http, stream, when):
    engine.flush(timeout=WAIT)
    wait_until(lambda: idle(engine), what="engine idle")
    baseline = kv_state(engine)
    aborts = metric(http.get("/metrics").text, "tandem:request_success_total", backend="cpu0", finished_reason="abort")

    # Freeze cpu0's worker so the request surely is where we want it when the client leaves,
    # however fast the model is: before admission (a call that waits between steps), or after
    # its 8th step (a bus subscriber runs on the worker thread).
    gate, frozen, steps = threading.Event(), threading.Event(), []

    def freeze(event):
        if event.backend == "cpu0":
            steps.append(event)
            if len(steps) == 8:
                frozen.set()
                gate.wait(WAIT)

    if when == "before the first token":
        blocker = engine.backend("cpu0").call(lambda b: (frozen.set(), gate.wait(WAIT)))
        assert frozen.wait(WAIT)

        def release():
            blocker.result(WAIT)
    else:
        release = engine.bus.subscribe(freeze, (StepDone,))
    n_exits = len(exits.paths)
    body = {"messages": HELLO, "max_tokens": 900, "temperature": 0, "stream": stream, "backend": "cpu0",
            "ignore_eos": True}
    try:
        with httpx.Client(base_url=url, timeout=WAIT) as c:
            if when == "mid-stream":
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    lines = r.iter_lines()
                    chunks = 0
                    while chunks < 2:  # the role chunk, then text
                        chunks += next(lines).startswith("data: {")
                    assert frozen.wait(WAIT)
            else:  # nothing can arrive while the worker is frozen: give up waiting
                with pytest.raises(httpx.ReadTimeout):
                    c.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(WAIT, read=0.5))
                assert frozen.is_set()
            assert not idle(engine)
        # The connection is closed: the server cancels the handler, whose `finally` cancels.
        exits.wait_for(n_exits + 1)
    finally:
        gate.set()
        release()
    wait_until(lambda: idle(engine), what="the cancelled request to leave cpu0")
    wait_until(lambda: kv_state(engine) == baseline, what="KV back to its baseline")

    def aborted() -> float:  # the count only grows: waiting for it cannot miss it
        return metric(http.get("/metrics").text, "tandem:request_success_total", backend="cpu0",
                      finished_reason="abort")

    wait_until(lambda: aborted() >= aborts + 1, what="the abort counted")
    assert aborted() == aborts + 1


def test_200_concurrent_streams_complete_as_the_metrics_show(engine, url, http):
    n = 200
    engine.flush(timeout=WAIT)
    wait_until(lambda: idle(engine), what="engine idle")
    empty = kv_state(engine)
    before = http.get("/metrics").text

    def finished(text):
        return metric(text, "tandem:request_success_total", finished_reason="length")

    def waiting(text, backend):
        return metric(text, "tandem:num_requests_waiting", backend=backend)

    # The tiny model outruns any client, so hold each backend's worker (between two steps) to
    # scrape /metrics at known points of the run: all queued, cpu0 done, everything done.
    gates = {name: threading.Event() for name in engine.backends}
    held = [threading.Event() for _ in engine.backends]
    blockers = [b.call(lambda b, gate=gates[name], h=h: (h.set(), gate.wait(WAIT)))
                for (name, b), h in zip(engine.backends.items(), held)]
    assert all(h.wait(WAIT) for h in held)

    async def one(client, i):
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Request {i % 10}: tell me more."}],
            max_tokens=12, temperature=0, stream=True)
        parts, finish = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def until(cond, what):
        deadline = time.monotonic() + WAIT
        while not cond():
            assert time.monotonic() < deadline, f"{what} not reached within {WAIT} s"
            await asyncio.sleep(0.01)

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT) as client, \
                httpx.AsyncClient(base_url=url, timeout=WAIT) as scraper:
            tasks = [asyncio.create_task(one(client, i)) for i in range(n)]
            await until(lambda: sum(len(s.items) for s in engine.snapshot()) == n, "all requests queued")
            queued = (await scraper.get("/metrics")).text
            gates["cpu0"].set()
            on_cpu0 = waiting(queued, "cpu0")
            half = queued
            deadline = time.monotonic() + WAIT
            while finished(half) - finished(before) < on_cpu0:  # cpu0's share finishes and is counted
                assert time.monotonic() < deadline, "cpu0's requests did not finish"
                await asyncio.sleep(0.01)
                half = (await scraper.get("/metrics")).text
            gates["cpu1"].set()
            results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
            return results, queued, half

    try:
        results, queued, half = asyncio.run(run())
    finally:
        for gate in gates.values():
            gate.set()
    for blocker in blockers:
        blocker.result(WAIT)

    assert len(results) == n
    assert all(text and finish == "length" for text, finish in results)
    # Same prompt, same greedy text, whichever backend and batch it ran in.
    by_prompt = {}
    for i, (text, _) in enumerate(results):
        by_prompt.setdefault(i % 10, set()).add(text)
    assert all(len(texts) == 1 for texts in by_prompt.values()), by_prompt

    # Scraped during the run: first everything waits, then cpu0's share has finished while
    # cpu1's still waits, then all are counted.
    after = http.get("/metrics").text
    assert finished(queued) == finished(before)
    assert waiting(queued, "cpu0") + waiting(queued, "cpu1") == n
    on_cpu0 = waiting(queued, "cpu0")
    assert 0 < on_cpu0 < n, "the router should have used both backends"
    assert finished(half) - finished(before) == on_cpu0
    assert waiting(half, "cpu0") == 0 and waiting(half, "cpu1") == n - on_cpu0
    assert finished(after) - finished(before) == n
    assert metric(after, "tandem:generation_tokens_total") - metric(before, "tandem:generation_tokens_total") == n * 12
    assert metric(after, "tandem:time_to_first_token_seconds_count") >= n
    assert metric(after, "tandem:prefix_cache_hits_total") > metric(before, "tandem:prefix_cache_hits_total")

    wait_until(lambda: idle(engine), what="engine idle")
    engine.flush(timeout=WAIT)
    assert kv_state(engine) == empty


# ---- fuzz ----


def test_schemathesis_finds_no_5xx(url, engine):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        examples = 25 if operation.method.upper() == "POST" else 5
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case):
                _bound_generation(case.body)
                response = case.call(base_url=url, timeout=FUZZ_WAIT)
                if response.status_code >= 500:
                    failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))
                elif response.status_code >= 400:
                    assert set(response.json()) == {"error"}, response.text

            try:
                check()
            except Unsatisfiable:
                assert mode == GenerationMode.NEGATIVE, operation.label  # nothing there to make invalid
    assert not failures, failures
    wait_until(lambda: idle(engine), what="engine idle after the fuzz run")


FUZZ_WAIT = 20
FUZZ_MAX_TOKENS = 64


def _bound_generation(body) -> None:
    """Keep fuzzed generations short: the fuzz is about input handling, not long outputs."""
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            v = body.get(name)
            if isinstance(v, int) and not isinstance(v, bool) and v > FUZZ_MAX_TOKENS:
                body[name] = FUZZ_MAX_TOKENS
        if any(k in body for k in ("response_format", "tools", "grammar")):  # their default is longer
            body.setdefault("max_tokens", FUZZ_MAX_TOKENS)


def test_a_long_request_after_a_long_cached_reply_finishes(loop_thread):
    with Engine.load(MODEL, parse_backend_specs(["cpu:threads=1,cap=4,ctx=512"])) as eng, \
            loop_thread.serving(create_app(eng)) as base, httpx.Client(base_url=base, timeout=3) as http:
        body = {"messages": HELLO, "max_tokens": 100_000, "temperature": 0}
        first = http.post("/v1/chat/completions", json=body)
        assert first.json()["choices"][0]["finish_reason"] == "length"  # ran to the context's end
        second = http.post("/v1/chat/completions", json=body)  # the same again
        assert second.status_code == 200


# ---- `tandem serve` ----


def test_tandem_serve_subprocess_serves_the_openai_client(tmp_path):
    served = resolve_model(MODEL).stem  # the id `/v1/models` lists: the GGUF file's stem
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "app", "serve", "--model", MODEL, "--port", str(port), "--api-key", KEY,
           "--backend", SPECS[0], "--backend", SPECS[1]]
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd())
    try:
        def up():
            assert proc.poll() is None, f"tandem serve exited: {log.seek(0) or log.read()}"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, what="tandem serve up")
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=WAIT) as c:
            assert c.models.list().data[0].id == served
            reply = c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0)
            assert reply.usage.completion_tokens == 5
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(WAIT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(WAIT)
        log.seek(0)
        output = log.read()
        log.close()
    assert rc == 0, output
    assert f"serving {served}" in output


# ---- a failing backend ----


@pytest.mark.restarts_module_backend
def test_a_failed_backend_is_reported_until_restarted_from_the_cli(url, http, engine, capsys):
    import json

    from app.cli import main

    name = next(iter(engine.backends))
    engine.backends[name].inject_fault("crash")
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "backend": name})
    assert r.status_code >= 500 and "injected" in r.json()["error"]["message"]
    health = http.get("/health").json()
    failed = next(b for b in health["backends"] if b["name"] == name)
    assert failed["healthy"] is False and "injected" in failed["error"]
    assert health["status"] == "degraded", "the other backend still serves"
    routing = http.get("/v1/routing").json()
    assert next(b for b in routing["backends"] if b["name"] == name)["healthy"] is False
    # Unpinned work goes to the healthy backend meanwhile.
    r = http.post("/v1/completions", json={"prompt": "y", "max_tokens": 4})
    assert r.status_code == 200 and r.headers["X-Tandem-Backend"] != name
    assert main(["backend", "restart", name, "--url", url]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {
        "backend": name, "healthy": True, "device": "cpu"}
    r = http.post("/v1/completions", json={"prompt": "z", "max_tokens": 4, "backend": name})
    assert r.status_code == 200 and r.headers["X-Tandem-Backend"] == name
    assert main(["backend", "restart", "nope", "--url", url]) == 1
