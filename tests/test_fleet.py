"""A fleet: two real `tandem serve` engines behind a `tandem serve` that has only remote
backends and loads no model (router-only mode), driven with the official `openai` client.

Every process is real (`python -m app serve`, loopback only) and every wait is bounded; the
fixtures kill what they started. An engine killed mid-run is killed at a moment checked while it
was stopped (`Server.kill_when`), so the state the test needs cannot pass before the kill.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import openai
import pytest
from servers import WAIT, Server
from waiting import wait_until

ENGINE_SPEC = "cpu:threads=1,cap=4,ctx=4096"
TENANTS = 4


@pytest.fixture
def fleet():
    """Two engines and a router in front of them (cache-aware)."""
    started: list[Server] = []
    try:
        engines = [Server("--model", "synthetic:tiny", "--backend", ENGINE_SPEC) for _ in range(2)]
        started += engines
        for e in engines:
            e.wait_healthy()
        router = Server(*[a for i, e in enumerate(engines) for a in ("--backend", f"remote:url={e.url},name=e{i}")],
                        "--policy", "cache-aware")
        started.append(router)
        router.wait_healthy()
        yield router, engines
    finally:
        for s in started:
            s.close()


def _client(router: Server) -> tuple[openai.OpenAI, str]:
    """The official client in front of the router, and the fleet's model id."""
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=WAIT, max_retries=0)
    return client, router.get("/v1/models")["data"][0]["id"]


def _tenant_prompt(tenant: int, i: int) -> str:
    """A long system text per tenant (the shared prefix) and a short question of its own."""
    prefix = " ".join(f"tenant{tenant} rule {k} says the answer is {k * (tenant + 3)}." for k in range(20))
    return f"{prefix}\nQuestion {i}: what is rule {i}?"


def _decision_of(router: Server, completion_id: str) -> dict:
    request_id = completion_id.split("-", 2)[2]  # chatcmpl-RUN-req-N
    for d in router.get("/v1/routing?n=1000")["decisions"]:
        if d["request_id"] == request_id:
            return d
    raise AssertionError(f"no routing decision for {request_id}")


def test_router_only_mode_serves_the_fleet_without_a_model(fleet):
    router, engines = fleet
    routing = router.get("/v1/routing")
    assert {b["name"]: b["device"] for b in routing["backends"]} == {"e0": "remote", "e1": "remote"}
    served = {m["id"] for m in router.get("/v1/models")["data"]}
    assert served == {m["id"] for m in engines[0].get("/v1/models")["data"]}


def test_cache_aware_spreads_tenants_keeping_each_on_one_engine(fleet):
    router, _ = fleet
    client, model = _client(router)
    placed: dict[int, list[str]] = {t: [] for t in range(TENANTS)}
    why: dict[int, list[str]] = {t: [] for t in range(TENANTS)}
    for i in range(4):  # rounds: every tenant sends one request per round, all at once
        with cf.ThreadPoolExecutor(TENANTS) as pool:
            futures = {t: pool.submit(client.completions.create, model=model, prompt=_tenant_prompt(t, i),
                                      max_tokens=8, temperature=0) for t in range(TENANTS)}
            for t, f in futures.items():
                d = _decision_of(router, f.result(WAIT).id)
                placed[t].append(d["backend"])
                why[t].append(d["reason"])
    for t, where in placed.items():
        assert len(set(where[1:])) == 1, f"tenant {t} moved between engines after its first request: {where}: {why[t]}"
    assert {w for where in placed.values() for w in where[1:]} == {"e0", "e1"}, f"one engine idle: {placed}"


def test_killing_one_engine_mid_run_moves_its_queue(fleet):
    router, engines = fleet
    client, model = _client(router)

    def ask(i: int):
        try:
            r = client.completions.create(model=model, prompt=_tenant_prompt(i % 2, i), max_tokens=48,
                                          temperature=0, extra_body={"ignore_eos": True})
            return "ok", r.usage.completion_tokens
        except openai.APIError as e:
            return "error", str(e)

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(ask, i) for i in range(24)]
        engines[1].kill_when(lambda: any(b["name"] == "e1" and b["items"] for b in router.get("/v1/routing")["backends"]),
                             "work on e1", unless=lambda: all(f.done() for f in futures))
        results = [f.result(WAIT) for f in futures]
    assert time.monotonic() - t0 < WAIT
    ok = [r for r in results if r[0] == "ok"]
    errors = [r for r in results if r[0] == "error"]
    assert all(n == 48 for _, n in ok)
    assert len(ok) >= 24 - 4 - 1, f"more failed than e1 had running (cap 4): {errors}"
    assert all("e1" in msg or "unavailable" in msg.lower() or "disconnect" in msg.lower() for _, msg in errors), errors
    # A request in flight on e1 when it died marks it at once; if all of them had finished, the
    # next health probe (every second) does: wait for that, it cannot fail to come.
    wait_until(lambda: not next(b for b in router.get("/v1/routing")["backends"] if b["name"] == "e1")["healthy"],
               WAIT, "the router marks the killed engine unhealthy")
    # The rest of the fleet still serves.
    r = client.completions.create(model=model, prompt="after the failure", max_tokens=4, temperature=0)
    assert r.choices[0].text is not None


def test_non_streaming_requests_survive_their_engine_dying_mid_answer(fleet):
    # A client that did not ask for a stream sees nothing until the end: when e1 dies while it
    # is generating for such requests, they start again from the prompt on e0 and succeed.
    router, engines = fleet
    client, model = _client(router)
    n, out = 16, 160

    def ask(i: int):
        try:
            r = client.completions.create(model=model, prompt=_tenant_prompt(i % 2, i), max_tokens=out,
                                          temperature=0, extra_body={"ignore_eos": True})
            return "ok", r.usage.completion_tokens
        except openai.APIError as e:
            return "error", str(e)

    def e1_generating() -> bool:
        e1 = next(b for b in router.get("/v1/routing")["backends"] if b["name"] == "e1")
        return any(i["running"] and i["generated"] > 0 for i in e1["items"])

    with cf.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(ask, i) for i in range(n)]
        engines[1].kill_when(e1_generating, "e1 generating", unless=lambda: all(f.done() for f in futures))
        results = [f.result(WAIT) for f in futures]
    assert results == [("ok", out)] * n
    e1 = next(b for b in router.get("/v1/routing")["backends"] if b["name"] == "e1")
    assert not e1["healthy"]


def test_streams_survive_their_engine_dying_mid_answer(fleet):
    # Streams that e1 had begun go on from their text on e0: each client sees one stream of the
    # whole max_tokens and no error event; completions and chats alike.
    router, engines = fleet
    client, model = _client(router)
    n, out = 8, 160

    def ask(i: int):
        chat = (i // 2) % 2 == 1  # each tenant sends both kinds
        common = dict(model=model, max_tokens=out, temperature=0, stream=True,
                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        parts, finish, usage, rid = [], None, None, ""
        try:
            if chat:
                stream = client.chat.completions.create(
                    messages=[{"role": "user", "content": _tenant_prompt(i % 2, i)}], **common)
            else:
                stream = client.completions.create(prompt=_tenant_prompt(i % 2, i), **common)
            for chunk in stream:
                rid = chunk.id.split("-", 2)[2]
                for c in chunk.choices:
                    parts.append((c.delta.content if chat else c.text) or "")
                    finish = c.finish_reason or finish
                usage = chunk.usage or usage
        except openai.APIError as e:
            return "error", str(e), "", "", chat
        return finish, usage.completion_tokens, "".join(parts), rid, chat

    def e1_streaming() -> bool:
        e1 = next(b for b in router.get("/v1/routing")["backends"] if b["name"] == "e1")
        return sum(1 for i in e1["items"] if i["running"] and i["generated"] > 0) >= 2

    with cf.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(ask, i) for i in range(n)]
        engines[1].kill_when(e1_streaming, "two streams under way on e1",
                             unless=lambda: all(f.done() for f in futures))  # every stream over: it cannot come
        results = [f.result(WAIT) for f in futures]
    assert [r[:2] for r in results] == [("length", out)] * n, results
    assert all(r[2] for r in results)
    moves = {d["request_id"]: d for d in router.get("/v1/routing?n=1000")["decisions"] if d["moved_from"] == "e1"}
    continued = [r for r in results if r[3] in moves and moves[r[3]]["continued"] > 0]
    assert continued and all(moves[r[3]]["backend"] == "e0" for r in continued), moves


def test_a_stream_ends_with_a_clear_error_when_no_engine_is_left(fleet):
    router, engines = fleet
    client, model = _client(router)
    engines[0].kill()
    wait_until(lambda: not next(b for b in router.get("/v1/routing")["backends"] if b["name"] == "e0")["healthy"],
               WAIT, "e0 seen down")
    stream = client.completions.create(model=model, prompt="a long answer", max_tokens=3000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    text = next(iter(stream)).choices[0].text
    engines[1].kill()
    with pytest.raises(openai.APIError, match=r"(?i)unavailable|no healthy backend"):
        for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
    assert text
