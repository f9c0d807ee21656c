"""A remote engine's key stays secret: `key_file=` keeps it off the command line, and no message
shows it (spec errors on stderr, the config's repr, logs, snapshots, `/v1/backends`, an
engine's error that echoes our request back).

The engine is a small aiohttp server in this process that answers only `Bearer KEY` (`Locked`);
the router is a real `tandem serve` process with only that remote backend. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import httpx2 as httpx
import pytest
from aiohttp import web
from servers import WAIT, Server

from engine.backends.config import parse_backend_spec
from engine.backends.remote import RemoteBackend
from engine.backends.remote.config import RemoteConfig
from engine.core.errors import InvalidRequest
from engine.core.request import Request, RequestStatus, SamplingParams

KEY = "sk-TOPSECRET-4242"


class Locked:
    """An OpenAI-compatible engine that serves `Bearer {key}` only; other keys get a 401 whose
    message echoes the request's headers (as some servers' errors do)."""

    def __init__(self, key: str):
        self.key = key
        self.seen: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="locked-engine", daemon=True)
        self.thread.start()
        app = web.Application()
        app.add_routes([web.get("/health", self.health), web.get("/v1/models", self.models),
                        web.post("/v1/completions", self.complete), web.post("/v1/chat/completions", self.complete)])
        self.runner = web.AppRunner(app)
        self._run(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self._run(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT)

    def close(self) -> None:
        self._run(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT)
        self.loop.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "locked", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        said = request.headers.get("Authorization", "")
        self.seen.append(said)
        if said != f"Bearer {self.key}":
            return web.json_response({"error": {"message": f"bad key in {dict(request.headers)}",
                                                "type": "invalid_request_error"}}, status=401)
        body = await request.json()
        chat = "messages" in body
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        delta = {"delta": {"content": "open"}} if chat else {"text": "open"}
        for event in ({"choices": [{"index": 0, **delta, "finish_reason": "stop"}]},
                      {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}):
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.fixture
def engine():
    e = Locked(KEY)
    yield e
    e.close()


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "engine.key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return path


def ask(backend: RemoteBackend) -> object:
    return backend.enqueue(Request((), SamplingParams(max_tokens=4, temperature=0.0), text="hi")).result(WAIT)


# ---- the spec ----


def test_a_key_file_spec_reads_the_key_from_the_file(key_file):
    c = parse_backend_spec(f"remote:url=http://h:1,key_file={key_file}")
    assert isinstance(c, RemoteConfig) and c.key is None and c.key_file == str(key_file)
    assert c.secret() == KEY and KEY not in repr(c)


def test_a_config_s_repr_leaves_the_key_out():
    assert KEY not in repr(RemoteConfig(url="http://h:1", key=KEY))


@pytest.mark.parametrize("bad", [f"remote:url=http://h:1,key={KEY},cap=0", f"remote:url=http://h:1,key={KEY},color=red",
                                 f"remote:url=http://h:1, key : {KEY}", f"remote:url=http://u:{KEY}@h:1",
                                 f"remote:url=http://h:1?api_key={KEY}", "remote:url=http://h:1,key=\u00e9t\u00e9"])
def test_a_bad_remote_spec_is_refused_without_showing_its_key(bad):
    with pytest.raises(InvalidRequest) as e:
        parse_backend_spec(bad)
    assert KEY not in str(e.value) and "\u00e9t\u00e9" not in str(e.value), str(e.value)


def test_a_bad_spec_on_the_command_line_prints_no_key():
    p = subprocess.run([sys.executable, "-m", "app", "serve", "--port", "0", "--backend",
                        f"remote:url=http://127.0.0.1:9,key={KEY},cap=0"], capture_output=True, text=True, timeout=WAIT)
    assert p.returncode != 0 and "cap must be >= 1" in p.stderr, p.stderr
    assert KEY not in p.stderr + p.stdout


@pytest.mark.parametrize("content", ["", "two words\n", "\u00e9t\u00e9\n"], ids=["empty", "space", "non-ascii"])
def test_a_key_file_that_holds_no_usable_key_is_refused_naming_the_file(tmp_path, content):
    path = tmp_path / "k"
    path.write_text(content)
    with pytest.raises(InvalidRequest, match="key_file") as e:
        parse_backend_spec(f"remote:url=http://h:1,key_file={path}")
    assert str(path) in str(e.value) and (not content.strip() or content.strip() not in str(e.value))


def test_a_missing_key_file_is_refused_naming_the_file(tmp_path):
    with pytest.raises(InvalidRequest, match="cannot read"):
        parse_backend_spec(f"remote:url=http://h:1,key_file={tmp_path / 'absent'}")


# ---- in use ----


def test_the_key_from_its_file_opens_the_engine_without_showing_anywhere(engine, key_file, caplog):
    with caplog.at_level(logging.DEBUG):
        backend = RemoteBackend(RemoteConfig(url=engine.url, name="locked", key_file=str(key_file))).start()
        try:
            record = ask(backend)
            assert record.status == RequestStatus.FINISHED_STOPPED and record.text == "open"
            shown = json.dumps(backend.snapshot().to_dict()) + repr(backend.info()) + json.dumps(backend.describe())
        finally:
            backend.stop()
    assert engine.seen == [f"Bearer {KEY}"]
    assert KEY not in shown and KEY not in caplog.text


def test_an_engine_echoing_our_key_in_its_error_has_it_masked(engine, tmp_path):
    wrong = tmp_path / "wrong.key"
    wrong.write_text("sk-WRONG-1234\n")
    backend = RemoteBackend(RemoteConfig(url=engine.url, name="locked", key_file=str(wrong))).start()
    try:
        record = ask(backend)
        assert record.status == RequestStatus.FINISHED_ERROR and "bad key" in record.error
        assert "sk-WRONG-1234" not in record.error and "Bearer ***" in record.error, record.error
    finally:
        backend.stop()


def test_a_rotated_key_file_is_read_again_at_restart(engine, key_file):
    backend = RemoteBackend(RemoteConfig(url=engine.url, name="locked", key_file=str(key_file))).start()
    try:
        assert ask(backend).status == RequestStatus.FINISHED_STOPPED
        engine.key = "sk-ROTATED-7777"
        key_file.write_text(engine.key + "\n")
        backend.restart()
        assert ask(backend).status == RequestStatus.FINISHED_STOPPED
        assert engine.seen[-1] == "Bearer sk-ROTATED-7777"
    finally:
        backend.stop()


def test_a_router_with_a_key_file_keeps_the_key_off_its_command_line(engine, key_file):
    router = Server("--backend", f"remote:url={engine.url},name=locked,key_file={key_file}")
    try:
        router.wait_healthy()
        cmdline = Path(f"/proc/{router.proc.pid}/cmdline").read_bytes().decode()
        assert str(key_file) in cmdline and KEY not in cmdline
        r = httpx.post(router.url + "/v1/completions", json={"model": "locked", "prompt": "hi", "max_tokens": 4},
                       timeout=WAIT)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "open", r.text
        assert KEY not in json.dumps(router.get("/v1/backends")) + json.dumps(router.get("/health"))
    finally:
        router.close()
    assert KEY not in router.proc.stderr.read()
