"""The API's small promises, through the official `openai` client and plain HTTP against a live
`tandem serve` on the default model (SmolLM2-135M-Instruct): `GET /v1/models/{id}` and the
model objects' `created` / `owned_by`; response ids unique across restarts; a
`system_fingerprint`; a reply cut inside a multi-byte character; a tools reply cut by its
length; an unknown endpoint's 404; the 429's text. Every wait is bounded."""

from __future__ import annotations

import threading

import httpx2 as httpx
import openai
import pytest
from pydantic import BaseModel
from servers import Server
from test_server import LoopThread

from app.server import create_app
from engine.backends.config import parse_backend_specs
from engine.engine import Engine

SPEC = "cpu:threads=1,cap=4,ctx=2048"
TIMEOUT = 300  # seconds: the bound on any one request on a loaded two-core machine
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(BaseModel):
    city: str
    unit: str


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city",
                                           "parameters": Weather.model_json_schema()}}]



def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=TIMEOUT)


# ---- models ----


def test_models_retrieve_returns_the_listed_model(client):
    listed = client.models.list().data[0]
    got = client.models.retrieve(listed.id)
    assert (got.id, got.object, got.created, got.owned_by) == (listed.id, "model", listed.created, listed.owned_by)


def test_models_retrieve_answers_to_the_models_alias(client):
    assert client.models.retrieve("default").id == client.models.list().data[0].id


def test_models_retrieve_of_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_model_objects_carry_openais_fields(server):
    model = server.get("/v1/models")["data"][0]
    assert isinstance(model["created"], int) and model["created"] > 0
    assert isinstance(model["owned_by"], str) and model["owned_by"]


# ---- ids and fingerprints ----


def first_reply_ids(n: int) -> list[str]:
    """The ids of `n` fresh servers' first replies (uncalibrated: every start does the same
    before it). The servers start side by side, so the test waits for one start, not `n`."""
    servers = [Server("--model", "default", "--backend", SPEC, "--no-calibrate") for _ in range(n)]
    try:
        ids = []
        for srv in servers:
            with openai.OpenAI(base_url=srv.wait_healthy().url + "/v1", api_key="unused", timeout=TIMEOUT,
                               max_retries=0) as c:
                ids.append(c.chat.completions.create(model="default", messages=ASK, max_tokens=1).id)
        return ids
    finally:
        for srv in servers:
            srv.close()


def test_response_ids_differ_across_restarts():
    first, second = first_reply_ids(2)  # were both chatcmpl-req-1
    assert first != second
    assert first.startswith("chatcmpl-") and second.startswith("chatcmpl-")


def test_response_ids_differ_within_a_server(client):
    ids = {client.chat.completions.create(model="default", messages=ASK, max_tokens=1).id for _ in range(2)}
    assert len(ids) == 2


def test_replies_carry_one_system_fingerprint(client):
    whole = client.chat.completions.create(model="default", messages=ASK, max_tokens=2)
    chunks = list(client.chat.completions.create(model="default", messages=ASK, max_tokens=2, stream=True))
    text = client.completions.create(model="default", prompt="Hello", max_tokens=2)
    assert whole.system_fingerprint and whole.system_fingerprint.startswith("fp_")
    assert {c.system_fingerprint for c in chunks} == {whole.system_fingerprint}
    assert text.system_fingerprint == whole.system_fingerprint


# ---- cut replies ----


@pytest.fixture(scope="module")
def partial_token(server) -> int:
    """A token whose bytes are the start of a multi-byte character, not a whole one."""
    pieces = post(server, "/tokenize", {"content": "🙂🌍 你好", "with_pieces": True}).json()["tokens"]
    partial = [p["id"] for p in pieces if isinstance(p["piece"], list)]
    assert partial, pieces
    return partial[0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_inside_a_multibyte_character_has_no_replacement_character(client, partial_token, stream):
    r = client.completions.create(model="default", prompt="Say hi:", max_tokens=1, temperature=0, stream=stream,
                                  logit_bias={str(partial_token): 100})
    text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    assert "\ufffd" not in text
    assert text == ""


@pytest.mark.parametrize("stream", [False, True])
def test_a_tools_reply_cut_by_its_length_leaks_no_tool_call_json(client, stream):
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="auto",
                                       max_tokens=4, temperature=0, stream=stream)
    if stream:
        chunks = list(r)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
        calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    else:
        content, finish, calls = r.choices[0].message.content or "", r.choices[0].finish_reason, \
            r.choices[0].message.tool_calls or []
    assert finish == "length"
    assert not calls
    assert "tool_call" not in content and not content.lstrip().startswith("{"), content


def test_a_required_tool_call_cut_by_its_length_has_no_content(client):
    r = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content is None
    assert not r.choices[0].message.tool_calls


# ---- errors ----


def test_an_unknown_endpoints_404_names_it_among_the_served_ones(server):
    r = httpx.post(server.url + "/v1/frobnicate", json={}, timeout=TIMEOUT)
    assert r.status_code == 404
    err = r.json()["error"]
    assert "/v1/frobnicate" in err["message"]
    assert "POST /v1/chat/completions" in err["message"] and "POST /v1/responses" in err["message"]
    assert err["type"] == "not_found_error"


def test_an_unknown_endpoint_through_the_sdk_is_a_not_found_error_naming_it(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.post("/images/generations", body={"prompt": "x"}, cast_to=object)
    assert "/v1/images/generations" in e.value.message


@pytest.fixture
def one_slot():
    """A served engine whose one backend runs one request and queues one more: (engine, URL)."""
    loop = LoopThread()
    try:
        with Engine.load("synthetic:tiny", parse_backend_specs(["cpu:threads=1,cap=1,max_queue=1,ctx=512"])) as eng, \
                loop.serving(create_app(eng)) as base:
            yield eng, base
    finally:
        loop.close()


def test_a_429_says_how_full_the_queue_is(one_slot):
    eng, base = one_slot
    (backend,) = eng.backends.values()
    gate, held = threading.Event(), threading.Event()
    try:
        # Hold the worker between steps: the queued request stays queued, and fills the queue.
        blocker = backend.call(lambda b: (held.set(), gate.wait(TIMEOUT)))
        assert held.wait(TIMEOUT)
        queued = eng.generate([1, 40, 41])
        r = httpx.post(base + "/v1/completions", json={"prompt": [1, 40], "max_tokens": 2}, timeout=TIMEOUT)
    finally:
        gate.set()
    blocker.result(TIMEOUT)
    assert queued.result(TIMEOUT).error is None
    assert r.status_code == 429
    message = r.json()["error"]["message"]
    assert "queue is full" in message and "1 queued, at most 1" in message, message
    assert "0 requests waiting" not in message

