"""Write-side limits, head sizes, trusted proxies, kept-alive pools, CORS, request-size bounds
and stream backpressure: each attack reproduced at a size this machine takes in seconds,
against a real server (in-process on the tiny model, or `tandem serve` in a subprocess when
its memory is measured). `docs/security.md` maps each defence to its test here."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
import tracemalloc

import aiohttp
import httpx2 as httpx
import pytest
from test_security import engine, loop_thread, rss_bytes, serve  # noqa: F401  (fixtures)
from test_server import WAIT
from waiting import wait_until

from app.http_guard import CONNECTIONS, REFUSALS, GuardSettings
from app.responses import MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE, MAX_USER, Stored, footprint
from app.server import METRICS, create_app

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


# ---- a kept-alive pool is never raced ----


def test_the_keepalive_timeout_outlasts_aiohttps_client_pool():
    """A server that closes an idle connection while a client sends its next request on it
    resets that request: its keep-alive must outlast the pools of the clients that reuse them."""
    async def pool_s() -> float:
        connector = aiohttp.TCPConnector()
        try:
            return connector._keepalive_timeout  # type: ignore[attr-defined]
        finally:
            await connector.close()

    assert GuardSettings().keepalive_timeout > asyncio.run(pool_s())


def test_pooled_connections_reused_after_pauses_longer_than_5_s_are_never_reset(loop_thread, engine):
    """Streamed turns from a real aiohttp client (default pool, keep-alive) with think times
    past the old 5 s keep-alive: every turn answered, and each pooled connection reused (with
    5 s, each pause found its connection closed, and one that crossed the close was reset)."""
    app = create_app(engine)
    users, turns, pause = 6, 3, 6.0
    with loop_thread.serving(app) as base:
        async def run() -> list[str]:
            failures: list[str] = []
            async with aiohttp.ClientSession() as session:
                async def user() -> None:
                    for turn in range(turns):
                        if turn:
                            await asyncio.sleep(pause)
                        try:
                            async with session.post(base + "/v1/chat/completions",
                                                    json={**CHAT, "stream": True}) as r:
                                body = await r.read()
                                if r.status != 200 or b"[DONE]" not in body:
                                    failures.append(f"{r.status}: {body[:100]!r}")
                        except (aiohttp.ClientError, OSError) as e:
                            failures.append(repr(e))

                await asyncio.gather(*(user() for _ in range(users)))
            return failures

        failures = asyncio.run(run())
    assert failures == []
    accepted = app[CONNECTIONS].accepted
    assert accepted <= users, f"{accepted} connections for {users} users: pooled ones were closed"


# ---- CORS for browsers and SDKs ----


@pytest.fixture
def cors_base(engine, loop_thread):
    app = create_app(engine, guard=GuardSettings(allowed_origins=("http://localhost:3000",)))
    with loop_thread.serving(app) as base:
        yield base


def test_a_preflight_echoes_the_headers_an_sdk_asks_for(cors_base):
    asked = ("authorization, content-type, x-stainless-os, x-stainless-lang, x-stainless-package-version, "
             "x-stainless-runtime, x-stainless-retry-count, x-stainless-timeout")
    r = httpx.options(cors_base + "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": asked}, timeout=WAIT)
    assert r.status_code == 204
    allowed = {h.strip() for h in r.headers["Access-Control-Allow-Headers"].lower().split(",")}
    assert {h.strip() for h in asked.split(",")} <= allowed


def test_a_delete_preflight_is_allowed(cors_base):
    r = httpx.options(cors_base + "/v1/responses/resp_x", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "DELETE"}, timeout=WAIT)
    assert r.status_code == 204
    methods = {m.strip() for m in r.headers["Access-Control-Allow-Methods"].split(",")}
    assert {"GET", "POST", "DELETE", "OPTIONS"} <= methods


def test_a_preflight_asking_for_odd_or_too_many_headers_gets_the_api_s_own(cors_base):
    for asked in ("x-a\r\nx-b", ", ".join(f"x-h{i}" for i in range(500))):
        r = httpx.options(cors_base + "/v1/models", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": asked.replace("\r\n", " ")}, timeout=WAIT)
        assert r.headers["Access-Control-Allow-Headers"] == "Authorization, Content-Type"


# ---- request heads: bytes, not only lines ----


def test_unfinished_8kb_header_lines_get_431_at_little_memory(many_files):
    """300 connections each sending 40 header lines of 8,000 bytes and no end of head: each is
    answered 431 past 32 KiB (or 429: the 431s charge their address), and the server's memory
    barely moves (each held ~1 MB before)."""
    n, lines = 300, 40
    line = b"X-Pad: " + b"a" * 7993 + b"\r\n"
    with serve() as (proc, base):
        port = _port(base)
        before = rss_bytes(proc.pid)
        socks, replies = [], []
        try:
            for _ in range(n):
                s = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                socks.append(s)
            for s in socks:
                try:
                    for _ in range(lines):
                        s.sendall(line)
                except OSError:  # answered and dropped while it still sent: what we test
                    pass
            peak = rss_bytes(proc.pid)
            for s in socks:
                s.settimeout(WAIT)
                try:
                    replies.append(s.recv(200))
                except ConnectionResetError:  # answered, then reset while it still sent
                    replies.append(b"")
        finally:
            for s in socks:
                s.close()
        # 431, or 429 once the 431s put the address in debt (`TIMEOUT_CHARGE_S` each), or a reset
        assert all(r == b"" or r[:12] in (b"HTTP/1.1 431", b"HTTP/1.1 429") for r in replies), {r[:40] for r in replies}
        assert any(r.startswith(b"HTTP/1.1 431") for r in replies)
        assert peak - before < 40 << 20, f"RSS grew {(peak - before) >> 20} MB"
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=WAIT) as other:
            assert other.get(base + "/health").status_code == 200


@pytest.fixture
def many_files():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_malformed_head_is_refused_without_echoing_the_request(loop_thread, engine):
    """aiohttp's own 400 quoted the line it could not parse; the `Authorization` header sent
    beside it must never come back."""
    secret = b"sk-very-secret-key-1234"
    with loop_thread.serving(create_app(engine)) as base, \
            socket.create_connection(("127.0.0.1", _port(base)), timeout=WAIT) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + secret +
                  b"\x01\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request")  # HTTP/1.0: the version was not read
    assert secret not in reply and b"Authorization" not in reply


# ---- connections that never read their replies ----


def _pipelined(port: int, n: int, source: str, path: bytes = b"/openapi.json", count: int = 200) -> list[socket.socket]:
    """`n` connections (2 KB receive buffers) that pipeline `count` GETs of `path` and never read:
    200 x 33 KB of `/openapi.json` is past what the kernel buffers (its send buffer grows to 4 MB)."""
    socks = []
    request = b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        s.sendall(request * count)
        socks.append(s)
    return socks


def test_connections_that_never_read_cannot_lock_a_new_client_out(loop_thread, engine):
    """A table full of connections whose replies fill their readers' sockets: each is blocked
    writing, which makes it evictable (it counted as busy, and a third address got nothing)."""
    cap = 12
    app = create_app(engine, guard=GuardSettings(max_connections=cap, send_timeout=120))
    runner, base = loop_thread.serve(app)
    guard = app[CONNECTIONS]
    socks: list[socket.socket] = []
    try:
        socks = _pipelined(_port(base), cap, "127.0.0.2")
        wait_until(lambda: guard.open == cap and guard.busy == 0, timeout=WAIT,
                   what="every connection blocked writing, none busy")
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3"), timeout=WAIT) as other:
            r = other.get(base + "/health")
        assert r.status_code == 200 and guard.evicted >= 1
    finally:
        for s in socks:
            s.close()
        loop_thread.run(runner.cleanup())


def test_pipelined_metrics_requests_share_one_rendering(loop_thread, engine):
    """120 pipelined `GET /metrics` on one connection: the first `METRICS_PER_CONNECTION`
    answered from one rendering, then 429 and the connection closed (each was rendered,
    2.2 ms, and written before)."""
    from app.server import METRICS_PER_CONNECTION

    app = create_app(engine)
    runner, base = loop_thread.serve(app)
    metrics, renders = app[METRICS], [0]
    render = metrics.render

    def counted() -> bytes:
        renders[0] += 1
        return render()

    metrics.render = counted  # type: ignore[method-assign]
    try:
        with socket.create_connection(("127.0.0.1", _port(base)), timeout=WAIT) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 119 +
                      b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            replies = b""
            while chunk := s.recv(65536):
                replies += chunk
        assert replies.count(b"HTTP/1.1 200") == METRICS_PER_CONNECTION and replies.count(b"HTTP/1.1 429") == 1
        assert renders[0] <= 2, f"rendered {renders[0]} times"
    finally:
        loop_thread.run(runner.cleanup())


def test_a_reply_that_makes_no_progress_times_out(loop_thread, engine):
    """nginx's `send_timeout`: a connection whose reply has not moved for `send_timeout` is
    dropped and charged to its address."""
    app = create_app(engine, guard=GuardSettings(send_timeout=0.5))
    runner, base = loop_thread.serve(app)
    guard = app[CONNECTIONS]
    socks: list[socket.socket] = []
    try:
        socks = _pipelined(_port(base), 4, "127.0.0.2")
        wait_until(lambda: guard.send_timeouts == 4 and guard.open == 0, timeout=WAIT,
                   what="every stuck reply timed out")
        assert app[REFUSALS].owed("127.0.0.2") > 0
    finally:
        for s in socks:
            s.close()
        loop_thread.run(runner.cleanup())


# ---- a stream whose reader does not read ----


def test_a_stream_whose_reader_stops_reading_pauses_then_frees_its_kv(loop_thread):
    """n=4 with top_logprobs=20 and a reader that never reads: once a bounded backlog is
    unread its sequences pause (the server buffered the whole reply before, 6.9 MB for a
    135-byte request: here ~12 MB, past the 4 MB a kernel send buffer takes), and when the reply
    makes no progress for `send_timeout` the connection is dropped and the request's KV freed."""
    from test_server import MODEL

    from engine.backends.config import parse_backend_specs
    from engine.engine import Engine

    n, most = 4, 1500  # 4 x 1,500 tokens fit 8,192 cells
    eng = Engine.load(MODEL, parse_backend_specs(["cpu:threads=1,cap=4,ctx=8192"]))
    app = create_app(eng, guard=GuardSettings(send_timeout=3))
    runner, base = loop_thread.serve(app)
    sched = next(iter(eng.backends.values()))._sched
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": most, "n": n,
                       "logprobs": True, "top_logprobs": 20, "stream": True, "ignore_eos": True,
                       "temperature": 1}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    try:
        s.connect(("127.0.0.1", _port(base)))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: sched.n_paused == n, timeout=WAIT, what="every choice paused for its reader")
        generated = [w.generated for w in eng.snapshot()[0].running]
        assert len(generated) == n and max(generated) < most, generated
        # the reader never comes back: the reply times out, the request is cancelled, its KV freed
        wait_until(lambda: not sched.running, timeout=WAIT, what="the request dropped and its KV freed")
        assert app[CONNECTIONS].send_timeouts == 1
    finally:
        s.close()
        loop_thread.run(runner.cleanup())
        eng.close()


# ---- trusted proxies and answers for an indebted address ----


def test_behind_a_trusted_proxy_each_client_pays_for_itself(loop_thread, engine):
    """With `--trusted-proxy`, X-Forwarded-For names the client: an indebted client behind the
    proxy gets 429 with `Retry-After` at once while another behind the same proxy is served;
    from an untrusted peer the header is ignored."""
    app = create_app(engine, guard=GuardSettings(trusted_proxies=("127.0.0.0/8",)))
    app[REFUSALS].charge("203.0.113.7", 5.0)
    with loop_thread.serving(app) as base, httpx.Client(base_url=base, timeout=WAIT) as proxy:
        t0 = time.monotonic()
        r = proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Forwarded-For": "203.0.113.7, 127.0.0.9"})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) > 1 and time.monotonic() - t0 < 5
        r = proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Forwarded-For": "198.51.100.1"})
        assert r.status_code == 200
        assert app[CONNECTIONS].trust.client("127.0.0.1", ["203.0.113.7"]) == "203.0.113.7"
    untrusting = create_app(engine)
    untrusting[REFUSALS].charge("203.0.113.7", 5.0)
    with loop_thread.serving(untrusting) as base:
        r = httpx.post(base + "/v1/chat/completions", json=CHAT, headers={"X-Forwarded-For": "203.0.113.7"},
                       timeout=WAIT)
        assert r.status_code == 200


def test_a_trusted_proxy_is_not_held_to_one_address_s_connection_cap(loop_thread, engine):
    app = create_app(engine, guard=GuardSettings(max_client_connections=2, trusted_proxies=("127.0.0.1",),
                                                 keepalive_timeout=60))
    socks = []
    with loop_thread.serving(app) as base:
        try:
            for _ in range(4):
                s = socket.create_connection(("127.0.0.1", _port(base)), timeout=WAIT)
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert s.recv(65536).startswith(b"HTTP/1.1 200")
                socks.append(s)
        finally:
            for s in socks:
                s.close()


def test_trusted_proxy_settings_must_be_addresses():
    with pytest.raises(ValueError, match="not an address"):
        GuardSettings(trusted_proxies=("proxy.example",))


# ---- sizes checked before any conversion ----


@pytest.fixture
def http(engine, loop_thread):
    with loop_thread.serving(create_app(engine)) as base, httpx.Client(base_url=base, timeout=WAIT) as client:
        yield client


def test_a_huge_tool_list_is_refused_by_its_size_before_it_is_converted(http):
    """128 tools x 300 properties (1.4 MB) took 1.2-6.5 s of CPU to convert before the grammar's
    size refused them; the raw schemas' size refuses them first."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{k}": {"type": "string"} for k in range(300)}}}} for i in range(128)]
    r = http.post("/v1/chat/completions", json={**CHAT, "tools": tools})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "tools" and "bytes of JSON Schema" in error["message"]


@pytest.mark.parametrize("field, value", [
    ("metadata", {f"k{i}": "v" for i in range(MAX_METADATA + 1)}),
    ("metadata", {"k" * (MAX_METADATA_KEY + 1): "v"}),
    ("metadata", {"k": "v" * (MAX_METADATA_VALUE + 1)}),
    ("user", "u" * (MAX_USER + 1)),
])
def test_responses_metadata_or_user_past_openai_s_bounds_is_refused(http, field, value):
    r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(field)


def test_responses_metadata_at_its_bounds_is_echoed(http):
    metadata = {f"{i:0{MAX_METADATA_KEY}d}": "v" * MAX_METADATA_VALUE for i in range(MAX_METADATA)}
    r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "metadata": metadata,
                                         "user": "u" * MAX_USER})
    assert r.status_code == 200 and r.json()["metadata"] == metadata


def test_the_response_store_counts_the_memory_it_holds():
    """JSON's length under-counted a stored response's memory ~5.8x (140,000 metadata keys:
    11 MB of Python objects per 1.9 MB of JSON): the store counts what the objects take."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        history = [{"role": "user", "content": f"m{i}"} for i in range(20_000)]
        response = {"id": "resp_1", "metadata": {f"k{i}": str(i) for i in range(20_000)}}
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    counted = footprint(history) + footprint(response)
    assert counted >= 0.8 * held, (counted, held)
    stored = Stored(response, history)
    from app.responses import ResponseStore

    store = ResponseStore(max_chars=held // 2)
    store.put(stored)
    assert len(store) == 0  # over the store's bound: not kept
    assert stored.chars == counted + footprint(stored.inputs)  # its input items (none here) count too
    assert sys.getsizeof(history) < counted


# ---- smaller ----


def test_a_recursive_defs_schema_is_served(http):
    schema = {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "tree", "schema": schema}}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("pattern", ["^((((a$", "a)", "[abc", "*a", "^a{5,2}$"])
def test_a_malformed_pattern_is_refused(http, pattern):
    r = http.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": pattern}}}})
    assert r.status_code == 400 and "pattern" in r.json()["error"]["message"]


def test_one_address_s_sequences_are_bounded_with_429(loop_thread, engine):
    """40 unread streams of n=16 from one address queued 640 sequences: past
    `max_client_sequences` an address's next request is 429 with `Retry-After`, another
    address's is served."""
    app = create_app(engine, guard=GuardSettings(max_client_sequences=3))
    with loop_thread.serving(app) as base, httpx.Client(base_url=base, timeout=WAIT) as http:
        r = http.post("/v1/chat/completions", json={**CHAT, "n": 4})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert "--max-client-sequences" in r.json()["error"]["message"]
        assert http.post("/v1/chat/completions", json={**CHAT, "n": 3}).status_code == 200


def test_refused_large_bodies_leave_no_memory_behind(loop_thread, engine):
    """A refusal's traceback held the parse's frames (the validated body) in cycles only the
    full collector broke: a 1 MB tool list refused 25 times kept +400 MB of RSS."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{k}": {"type": "string"} for k in range(300)}}}} for i in range(128)]
    body = json.dumps({**CHAT, "tools": tools}).encode()
    app = create_app(engine, guard=GuardSettings(refused_cpu_share=100, refused_cpu_burst_s=100))
    with loop_thread.serving(app) as base, httpx.Client(base_url=base, timeout=WAIT) as http:
        def refuse() -> None:
            r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400

        refuse()
        before = rss_bytes(os.getpid())
        for _ in range(20):
            refuse()
        grown = rss_bytes(os.getpid()) - before
    assert grown < 100 << 20, f"RSS grew {grown >> 20} MB over 20 refusals"
