"""The app in front of a fleet: two real `tandem serve` engines as remote backends, no local
model. The window shows them like local backends, and a chat routes to them."""

from __future__ import annotations

import pytest
from servers import Server
from ui_fixtures import WAIT_MS, make_window, qasync_loop, ui_engine  # noqa: F401

from engine.backends.config import parse_backend_specs
from engine.engine import Engine


@pytest.fixture
def fleet_engine():
    engines = [Server("--model", "synthetic:tiny", "--backend", "cpu:threads=1,cap=4,ctx=1024") for _ in range(2)]
    try:
        for e in engines:
            e.wait_healthy()
        specs = [f"remote:url={e.url},name=e{i}" for i, e in enumerate(engines)]
        eng = Engine.load(None, parse_backend_specs(specs), policy="cache-aware")
        yield eng
        eng.close()
    finally:
        for e in engines:
            e.close()


def test_backends_panel_shows_each_remote_engine(make_window, fleet_engine):
    w = make_window(engine=fleet_engine)
    cards = w.panels["backends"].cards
    assert set(cards) == {"e0", "e1"}
    assert all(c.facts.text().startswith("REMOTE · 127.0.0.1:") for c in cards.values())


def test_window_names_the_fleets_model_without_a_local_one(make_window, fleet_engine):
    w = make_window(engine=fleet_engine)
    assert fleet_engine.model is None
    assert "synthetic-tiny" in w.windowTitle()


def test_a_chat_reply_from_a_remote_engine_shows_its_decision(qtbot, make_window, fleet_engine):
    w = make_window(engine=fleet_engine)
    chat, routing = w.panels["chat"], w.panels["routing"]
    chat.max_tokens.setValue(8)
    chat.input.setPlainText("Say something.")
    chat.send_button.click()
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    qtbot.waitUntil(lambda: routing.model.rowCount() == 1, timeout=WAIT_MS)
    reply = chat.chat.messages[-1]
    assert reply.role == "assistant"
    assert reply.meta["finish_reason"] in ("stop", "length")
    assert reply.meta["backend"] in ("e0", "e1")
