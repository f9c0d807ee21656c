"""The server inside the window: started on the window's qasync loop, hit by a real HTTP client."""

from __future__ import annotations

import json
import socket

import aiohttp
import pytest
from ui_fixtures import UI_MODEL, WAIT_MS, free_port, make_window, qasync_loop, ui_engine  # noqa: F401

from app.gui import build_parser, load_engine, serve
from ui.loader import ModelSpec
from ui.server_control import ServerDialog, ServerOptions


def on_loop(qtbot, loop, coro):
    """Run `coro` on the qasync loop while Qt keeps processing events; return its result."""
    task = loop.create_task(coro)
    qtbot.waitUntil(task.done, timeout=WAIT_MS)
    return task.result()


def start(qtbot, w, options: ServerOptions) -> None:
    task = w.start_server(options)
    assert task is not None, w.server_label.text()
    qtbot.waitUntil(task.done, timeout=WAIT_MS)


def port_closed(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_server_started_from_the_window_shows_its_traffic_live(qtbot, make_window, qasync_loop):
    w = make_window(serve_fn=serve)
    assert w.server_label.text() == "server: off" and w.start_server_action.isEnabled()
    port = free_port()
    start(qtbot, w, ServerOptions("127.0.0.1", port))
    url = f"http://127.0.0.1:{port}"
    assert w.server.url == url and w.server_label.text() == f"server: {url}"
    assert f"{url}/v1" in w.server_label.toolTip()
    assert not w.start_server_action.isEnabled() and w.stop_server_action.isEnabled()
    routing = w.panels["routing"].model
    rows = routing.rowCount()

    async def client():
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "hello from outside"}],
                    "max_tokens": 6, "temperature": 0}
            async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                whole = (r.status, r.headers["X-Request-Id"], await r.json())
            # Streamed: the routing table has the request's row before its reply has ended.
            body = {**body, "stream": True, "max_tokens": 32}
            async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                request_id = r.headers["X-Request-Id"]
                lines = [await r.content.readline()]
                rows_mid_stream = routing.rowCount()
                lines += [line async for line in r.content]
            return whole, request_id, rows_mid_stream, lines

    (status, first_id, reply), stream_id, rows_mid_stream, lines = on_loop(qtbot, qasync_loop, client())
    assert status == 200, reply
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] >= 1
    assert rows_mid_stream == rows + 2
    assert [d.request_id for d in routing.decisions[rows:]] == [first_id, stream_id]
    events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert lines[-2].strip() == b"data: [DONE]" or lines[-1].strip() == b"data: [DONE]"

    task = w.stop_server()
    qtbot.waitUntil(task.done, timeout=WAIT_MS)
    assert w.server_label.text() == "server: off" and w.start_server_action.isEnabled()
    assert port_closed(port)


def test_a_port_in_use_shows_the_bind_error(qtbot, make_window):
    w = make_window(serve_fn=serve)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start(qtbot, w, ServerOptions("127.0.0.1", port))
    assert w.server.state == "failed" and not w.server.running
    assert w.server_label.text() == f"server: address already in use (127.0.0.1:{port})"
    assert w.server_label.toolTip() == f"Cannot listen on 127.0.0.1:{port}: Address already in use"
    assert w.start_server_action.isEnabled()  # try again on another port
    start(qtbot, w, ServerOptions("127.0.0.1", free_port()))
    assert w.server.state == "on"
    w.stop_server()
    qtbot.waitUntil(lambda: w.server.state == "off", timeout=WAIT_MS)


def test_an_open_address_needs_an_api_key(qtbot, make_window):
    w = make_window(serve_fn=serve)
    assert w.start_server(ServerOptions("0.0.0.0", free_port())) is None
    assert not w.server.running and w.server_label.text() == "server: not started (0.0.0.0 needs an API key)"
    assert "set an API key" in w.server_label.toolTip()
    dialog = ServerDialog(parent=w)
    assert dialog.options() == ServerOptions()  # 127.0.0.1:8080, no key
    dialog.host_edit.setText("0.0.0.0")
    dialog.accept()
    assert dialog.result() != ServerDialog.Accepted and "API key" in dialog.error_label.text()
    dialog.key_edit.setText("sekret")
    dialog.accept()
    assert dialog.result() == ServerDialog.Accepted
    assert dialog.options() == ServerOptions("0.0.0.0", 8080, "sekret")


def test_closing_the_window_stops_the_server_first(qtbot, make_window, ui_engine):
    w = make_window(serve_fn=serve)
    port = free_port()
    start(qtbot, w, ServerOptions("127.0.0.1", port))
    w.close()
    assert w.engine is ui_engine  # the close waits for the server
    qtbot.waitUntil(lambda: w.engine is None, timeout=WAIT_MS)
    assert w.server.state == "off" and port_closed(port)


def test_the_server_follows_a_newly_loaded_model(qtbot, make_window, qasync_loop, ui_engine):
    w = make_window(serve_fn=serve, load_fn=load_engine)
    port = free_port()
    start(qtbot, w, ServerOptions("127.0.0.1", port))
    states = []
    w.server.state_changed.connect(states.append)
    w.load_model(ModelSpec(UI_MODEL, ("cpu:threads=1,cap=2,ctx=512",)))
    qtbot.waitUntil(lambda: w.engine is not ui_engine and w.server.state == "on", timeout=WAIT_MS)
    assert states == ["server: stopping…", "server: off", "server: starting…", f"server: http://127.0.0.1:{port}"]

    async def client():
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "hello", "max_tokens": 4}
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                return r.status, r.headers["X-Tandem-Backend"]

    assert on_loop(qtbot, qasync_loop, client()) == (200, "cpu")  # the new engine's only backend
    qtbot.waitUntil(w.stop_server().done, timeout=WAIT_MS)


def test_serve_option():
    parse = build_parser().parse_args
    assert parse([]).serve is None
    assert parse(["--serve", "9000"]).serve == ("127.0.0.1", 9000)
    assert parse(["--serve", "0.0.0.0:9001", "--api-key", "k"]).serve == ("0.0.0.0", 9001)
    assert parse(["--serve", "[::1]:9002"]).serve == ("::1", 9002)
    with pytest.raises(SystemExit):
        parse(["--serve", "localhost:http"])
