"""Remote engines as backends (engine/backends/remote/): two real `tandem serve` processes on the tiny
synthetic model, driven through an in-process `Engine` of two `RemoteBackend`s.

The engines are subprocesses (module fixture, killed at teardown); every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
from waiting import wait_until

from engine.backends import registry
from engine.backends.config import parse_backend_spec
from engine.backends.remote import RemoteBackend
from engine.backends.remote.config import RemoteConfig
from engine.core.errors import InvalidRequest
from engine.core.events import EventBus
from engine.core.handle import RequestHandle
from engine.core.request import Request, RequestStatus, SamplingParams
from engine.engine import Engine
from engine.routing import Router

UP_S = 60  # an engine process loads the tiny model and answers /health within this
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
LONG = SamplingParams(temperature=0.0, max_tokens=3500, ignore_eos=True)  # runs for seconds


def http(url: str, body: dict | None = None, timeout: float = 60):
    """GET (or POST `body` as JSON): the open response; the caller closes it."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engines:
    """Two `tandem serve` processes; `kill(i)` and `start(i)` (again, on the same port)."""

    def __init__(self, tmp):
        self.ports = [free_port(), free_port()]
        self.procs: list[subprocess.Popen | None] = [None, None]
        self.tmp = tmp

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def start(self, i: int) -> None:
        cmd = [sys.executable, "-m", "app", "serve", "--model", "synthetic:tiny", "--port", str(self.ports[i]),
               "--backend", "cpu:threads=1,cap=4,ctx=4096"]
        log = (self.tmp / f"engine{i}.log").open("a")
        self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd(),
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_up(self, i: int) -> None:
        def up():
            assert self.procs[i].poll() is None, (self.tmp / f"engine{i}.log").read_text()
            try:
                with http(self.url(i) + "/health", timeout=1) as r:
                    return r.status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_until(up, UP_S, f"engine {i} up")

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(30)

    def aborted(self, i: int) -> float:
        """Requests the engine counts as cancelled (`tandem:request_success{finished_reason="abort"}`)."""
        with http(self.url(i) + "/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tandem:request_success_total{") and 'finished_reason="abort"' in line)

    def routing_items(self, i: int) -> list[dict]:
        with http(self.url(i) + "/v1/routing?n=0", timeout=5) as r:
            body = json.load(r)
        return [item for b in body["backends"] for item in b["items"]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    e = Engines(tmp_path_factory.mktemp("engines"))
    try:
        e.start(0)
        e.start(1)
        e.wait_up(0)
        e.wait_up(1)
        yield e
    finally:
        e.kill(0)
        e.kill(1)


@pytest.fixture
def fleet(engines):
    """An Engine over both engines: backends `a` and `b`, polled fast."""
    bus = EventBus()  # one bus for the engine and its backends, as `Engine.load` makes
    ctx = registry.BuildContext(model_path=None, registry=None, bus=bus, calibrated=None, rates={})
    backends = [registry.build(RemoteConfig(url=engines.url(i), name=n, poll_s=0.25, health_s=0.5), ctx)
                for i, n in enumerate("ab")]
    eng = Engine(backends, Router("round-robin"), bus)
    yield eng
    eng.close()


def direct(engines, i: int, path: str, body: dict) -> str:
    with http(engines.url(i) + path, body) as r:
        choice = json.load(r)["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


# ---- spec ----


def test_a_remote_spec_parses_into_its_config():
    c = parse_backend_spec("remote:url=http://10.0.0.5:8000/v1,name=big,api=vllm,key=s3,cap=32")
    assert c == RemoteConfig(url="http://10.0.0.5:8000", name="big", api="vllm", key="s3", cap=32)
    assert parse_backend_spec("remote:url=http://h:1").name == "remote"


@pytest.mark.parametrize("bad", ["remote:url=h:1", "remote:url=http://h:1,api=nope", "remote:url=http://h:1,cap=0",
                                 "remote:url=http://h:1,color=red"])
def test_a_remote_spec_with_a_bad_value_is_refused(bad):
    with pytest.raises(InvalidRequest):
        parse_backend_spec(bad)


# ---- continuing a broken stream (pure) ----


def test_a_continued_chat_goes_on_in_the_assistants_turn():
    req = Request((), SamplingParams(max_tokens=100, temperature=0.0), messages=({"role": "user", "content": "Hi"},))
    more = req.continued("Hello the", 2).continued("re!", 1)
    assert more.id == req.id and more.sampling.max_tokens == 97 and more.continue_final
    assert more.messages == ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"})


def test_a_continued_token_prompt_appends_the_text_tokenized():
    req = Request((1, 2, 3), SamplingParams(max_tokens=10), stop_after=6)
    more = req.continued("ab", 2, tokenize=lambda text: [ord(c) for c in text])
    assert more.prompt_tokens == (1, 2, 3, 97, 98) and more.sampling.max_tokens == 8 and more.stop_after == 4


def test_a_token_prompt_without_a_tokenizer_cannot_be_continued():
    with pytest.raises(InvalidRequest, match="tokenizer"):
        Request((1, 2, 3)).continued("ab", 2)


def test_a_grammar_constrained_answer_cannot_be_continued():
    with pytest.raises(InvalidRequest, match="grammar"):
        Request((), SamplingParams(grammar='root ::= "a"'), text="x").continued("a", 1)


# ---- requests ----


def test_streamed_text_matches_a_direct_greedy_call(engines, fleet):
    a = fleet.backends["a"]
    assert a.api == "tandem" and a.models and a.healthy
    sampling = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)  # long enough to stream
    want = direct(engines, 0, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 256,
                                                  "ignore_eos": True, "temperature": 0})
    handle = fleet.submit(Request((), sampling, text="Once upon a time", backend="a"))
    deltas = list(handle)
    record = handle.result(10)
    assert record.error is None and record.backend == "a"
    assert "".join(deltas) == record.text == want
    assert len(deltas) > 1  # streamed, not delivered whole
    assert record.output_tokens == 256 and record.prompt_tokens > 0
    assert record.ttft_s is not None and record.e2e_s > record.ttft_s
    snap = a.snapshot()
    assert snap.device == "remote" and snap.url == engines.url(0) and snap.model == a.models[0]


def test_chat_messages_go_to_chat_completions(engines, fleet):
    messages = ({"role": "user", "content": "Say hello"},)
    want = direct(engines, 1, "/v1/chat/completions", {"messages": list(messages), "max_tokens": 16, "temperature": 0})
    handle = fleet.submit(Request((), GREEDY, messages=messages, backend="b"))
    assert handle.text(60) == want


def test_a_cancel_stops_the_request_on_the_remote_engine(engines, fleet):
    aborted = engines.aborted(0)
    handle = fleet.submit(Request((), LONG, text="Tell me a long story", backend="a"))
    next(iter(handle))  # it runs there
    assert engines.routing_items(0), "the engine shows the request running"
    handle.cancel()
    record = handle.result(30)
    assert record.status == RequestStatus.FINISHED_CANCELLED
    assert record.output_tokens < LONG.max_tokens
    # The engine itself cancelled it (its metrics count an abort), not merely finished it.
    wait_until(lambda: engines.aborted(0) == aborted + 1, 20, "the engine to count the request aborted")
    assert not engines.routing_items(0)


def test_a_request_beyond_the_cap_queues_locally(fleet):
    a = fleet.backends["a"]
    a.set_cap(1)
    first = fleet.submit(Request((), LONG, text="first", backend="a"))
    second = fleet.submit(Request((), GREEDY, text="second", backend="a"))
    next(iter(first))
    snap = a.snapshot()
    assert [i.running for i in snap.items if not i.request_id.startswith("external:")] == [True, False]
    second.cancel()
    assert second.result(10).status == RequestStatus.FINISHED_CANCELLED
    first.cancel()
    first.result(30)
    a.set_cap(4)
    assert fleet.submit(Request((), GREEDY, text="third", backend="a")).text(60)


# ---- prediction and load ----


def test_the_approximate_tree_predicts_a_repeated_prefix(fleet):
    a, b = fleet.backends["a"], fleet.backends["b"]
    shared = "You are a careful assistant. Answer in one line. " * 8
    fleet.submit(Request((), GREEDY, text=shared + "Question one?", backend="a")).text(60)
    again = Request((), GREEDY, text=shared + "Question two?", backend="a")
    assert a.match(again) >= len(shared) // 4 - 1  # characters / 4: a token estimate
    assert b.match(again) == 0
    fleet.submit(again).text(60)
    stats = a.snapshot().cache
    assert stats.hit_tokens > 0 and stats.query_tokens >= stats.hit_tokens
    assert a.cache_units == stats.units == "chars/4"


def test_load_polling_sees_requests_sent_directly_to_the_engine(engines, fleet):
    b = fleet.backends["b"]
    stop = threading.Event()

    def someone_else():
        body = {"prompt": "someone else's request", "max_tokens": 3500, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with http(engines.url(1) + "/v1/completions", body) as r:
            for _ in r:
                if stop.is_set():
                    break

    t = threading.Thread(target=someone_else, daemon=True)
    t.start()
    try:
        def external():
            return [i for i in b.snapshot().items if i.request_id.startswith("external:")]

        wait_until(lambda: any(i.running for i in external()), 20, "the external request in b's snapshot")
        assert b.describe()["external_running"] >= 1
        assert external()[0].decode_left > 0  # priced with the engine's own remaining budget
    finally:
        stop.set()
        t.join(30)
    wait_until(lambda: not any(i.request_id.startswith("external:") for i in b.snapshot().items), 20,
               "the external request gone from b's snapshot")


# ---- failure ----


def test_a_dead_engine_is_failed_over_until_probed_back(engines, fleet):
    a, b = fleet.backends["a"], fleet.backends["b"]
    a.set_cap(2)
    streaming = RequestHandle(Request((), LONG, text="a long one"))
    a.enqueue(streaming.request, streaming)
    first = next(iter(streaming))  # it has streamed text
    engines.procs[0].send_signal(signal.SIGSTOP)  # the engine still accepts, but answers nothing
    try:
        silent = RequestHandle(Request((), GREEDY, text="sent, nothing back yet"))
        a.enqueue(silent.request, silent)
        queued = [RequestHandle(Request((), GREEDY, text=f"queued {i}")) for i in range(2)]
        for h in queued:
            a.enqueue(h.request, h)
        wait_until(lambda: [i.running for i in a.snapshot().items if not i.request_id.startswith("external:")]
                   == [True, True, False, False], 10,
                   "two requests in flight at a, two queued here")
    finally:
        engines.kill(0)
    try:
        record = streaming.result(60)  # it had streamed: it goes on from its text on b
        assert record.error is None and record.backend == "b" and record.output_tokens == LONG.max_tokens
        assert first + "".join(streaming) == record.text  # one stream, nothing repeated
        for h in [silent, *queued]:
            moved = h.result(60)
            assert moved.error is None and moved.backend == "b" and h.backend == "b" and moved.text
        snap = a.snapshot()
        assert not snap.healthy and snap.error and not snap.items
        assert b.snapshot().healthy
        assert fleet.submit(Request((), GREEDY, text="while a is down")).result(60).backend == "b"
    finally:
        engines.start(0)
    engines.wait_up(0)
    wait_until(lambda: a.healthy, 20, "a probed back in")
    assert fleet.submit(Request((), GREEDY, text="a is back", backend="a")).text(60)


def test_restart_reconnects(fleet):
    a = fleet.backends["a"]
    assert a.healthy
    a.restart(timeout=30)
    assert a.healthy and a.snapshot().cache.cached_tokens == 0
    assert fleet.submit(Request((), GREEDY, text="after restart", backend="a")).text(60)


def test_a_second_restart_conflicts_with_one_under_way(engines, fleet):
    """The engine is paused, so the first restart waits on its probe while the second comes."""
    from engine.core.errors import RestartInProgress

    a = fleet.backends["a"]
    assert a.healthy
    first: dict = {}
    engines.procs[0].send_signal(signal.SIGSTOP)
    try:
        t = threading.Thread(target=lambda: first.update(done=a.restart(timeout=30)), name="first-restart")
        t.start()
        wait_until(lambda: a.snapshot().error == "restarting", 10, "the first restart under way")
        with pytest.raises(RestartInProgress):
            a.restart()
    finally:
        engines.procs[0].send_signal(signal.SIGCONT)
    t.join(40)
    assert not t.is_alive() and "done" in first
    wait_until(lambda: a.healthy, 20, "a back after the first restart")


# ---- rates ----


def test_calibrate_measures_a_remote_engine_by_sending_requests(fleet):
    from engine.rates.measure import calibrate_backend

    b = fleet.backends["b"]
    cal = calibrate_backend(b, prompt_tokens=64, gen_tokens=64, batches=[1, 2], repeats=1, timeout=60)
    assert cal.device == "remote" and cal.config_key == f"remote:{b.url}"
    assert cal.prefill_tok_s > 0 and set(cal.step_s) == {1, 2} and all(s > 0 for s in cal.step_s.values())
    b.set_rates(cal.rates())
    assert b.snapshot().rates.source == "calibrated"


def test_finished_requests_refine_the_rates_online(fleet):
    a = fleet.backends["a"]
    before = a.rates
    record = fleet.submit(Request((), SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                                  text="refine the rates", backend="a")).result(60)
    assert record.itl_s
    snap = a.snapshot()
    assert snap.rates.source == "online" and snap.rates.decode_tok_s != before.decode_tok_s
    assert snap.decode_tok_s > 0


def test_a_tokenizer_predicts_the_engines_cached_tokens(engines):
    backend = RemoteBackend(RemoteConfig(url=engines.url(0), name="t", tokenizer="synthetic:tiny")).start()
    try:
        shared = "The same long system prompt, sent twice to one engine. " * 6
        backend.enqueue(Request((), GREEDY, text=shared + "First question?")).text(60)
        again = Request((), GREEDY, text=shared + "Second question?")
        predicted = backend.match(again)
        assert backend.cache_units == "tokens"
        assert predicted >= len(backend.tokenizer.tokenize(shared)) - 2
        record = backend.enqueue(again).result(60)
        assert record.error is None
        assert abs(record.cached_tokens - predicted) <= 2  # the engine's own usage says what it reused
    finally:
        backend.stop()
