"""One request must never wedge the server: a nested-repetition pattern (230 bytes that made one
call into llama.cpp spin for 25 minutes), the same nesting written as GBNF rules, and a body
parse that never returns. `docs/security.md` maps each defence to its test here."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import threading
import time

import httpx2 as httpx
import pytest
from test_security import engine, loop_thread, serve  # noqa: F401  (fixtures)
from test_server import HELLO, WAIT

import app.server as server_module
from app.parse_pool import PARSING, ParsePool
from app.server import create_app
from engine.llama.gbnf_cost import stacks
from engine.llama.grammar import MAX_STACKS, measure

BOMB = "^(([a-z]{0,999}){0,999}){0,999}$"


def _bomb_chat() -> dict:
    return {"messages": HELLO, "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": BOMB}}}}}}


def test_six_nested_repetition_patterns_are_answered_at_once_then_sigterm_ends_the_server():
    """Six at once: each answered (400) within 2 s while a chat is served normally, and
    SIGTERM then ends the server within 5 s (it spun at 100 % and ignored SIGTERM before)."""
    with serve() as (proc, base):
        def bomb() -> tuple[int, float, str]:
            t0 = time.monotonic()
            r = httpx.post(base + "/v1/chat/completions", json=_bomb_chat(), timeout=WAIT)
            return r.status_code, time.monotonic() - t0, r.text

        with concurrent.futures.ThreadPoolExecutor(7) as pool:
            bombs = [pool.submit(bomb) for _ in range(6)]
            chat = pool.submit(httpx.post, base + "/v1/chat/completions",
                               json={"messages": HELLO, "max_tokens": 4}, timeout=WAIT)
            results = [f.result() for f in bombs]
            assert chat.result().status_code == 200
        for status, seconds, text in results:
            assert status == 400 and "MAX_REPEAT" in text and seconds < 2, (status, seconds, text[:200])
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pytest.fail("tandem serve did not end within 5 s of SIGTERM")
        assert time.monotonic() - t0 < 5


def test_the_same_nesting_written_as_rules_is_refused_naming_the_limit(loop_thread, engine):
    """A raw grammar of nested optional rules (what the converter writes for the pattern): a
    fan-out of ~10^6 parse stacks from its start, refused before llama.cpp sees it."""
    nest = "(r1 " * 200 + ")?" * 200
    grammar = (f'root ::= "x" r4 "y"\nr4 ::= {nest.replace("r1", "r3")}\nr3 ::= {nest.replace("r1", "r2")}\n'
               f'r2 ::= {nest}\nr1 ::= [a-z]\n')  # 200 x 200 ways to start after "x"
    assert stacks(grammar, MAX_STACKS) > MAX_STACKS
    with loop_thread.serving(create_app(engine)) as base:
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, "grammar": grammar},
                       timeout=WAIT)
    assert r.status_code == 400 and "MAX_STACKS" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("grammar, fan", [
    ('root ::= "a" | "b" | "c"', 3),
    ('root ::= x{0,10} "y"\nx ::= "a"?', 11),  # ten copies of something that may match nothing
    ('root ::= ("a" | "b")* "."', 3),
    ('root ::= (x){0,4}\nx ::= (y){0,5}\ny ::= [a-z]?', 20),  # nested: 4 x 5
])
def test_parse_stacks_are_counted_as_llama_cpp_makes_them(grammar, fan):
    assert stacks(grammar, 10_000) == fan
    measure(grammar)


def test_a_parse_that_never_returns_times_out_with_health_reporting_it(loop_thread, engine, monkeypatch):
    """A call on the parsing pool past its deadline answers its client 503 (retry), its
    thread counts as stuck and a spare takes its place: other requests are parsed, and
    `/health` says `degraded` with the stuck count until the call comes back."""
    release = threading.Event()
    real = server_module.parse_chat

    def parse(raw, *args):
        if b"wedge" in raw:
            release.wait(WAIT)
        return real(raw, *args)

    monkeypatch.setattr(server_module, "parse_chat", parse)
    app = create_app(engine)
    with loop_thread.serving(app) as base, httpx.Client(base_url=base, timeout=WAIT) as http:
        pool: ParsePool = app[PARSING]
        pool.deadline_s = 0.5
        try:
            t0 = time.monotonic()
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "wedge"}],
                                                        "max_tokens": 2})
            assert r.status_code == 503 and r.headers["Retry-After"] and time.monotonic() - t0 < 5
            assert pool.stuck == 1
            health = http.get("/health").json()
            assert health["status"] == "degraded" and health["parsing"]["stuck"] == 1
            assert http.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2}).status_code == 200
        finally:
            release.set()
        from waiting import wait_until

        wait_until(lambda: pool.stuck == 0, timeout=WAIT, what="the stuck call came back")
        assert http.get("/health").json()["status"] == "ok"
