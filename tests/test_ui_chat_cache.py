"""The app's own chat on SmolLM2: a conversation's later turns find its earlier turns in the
prefix cache, and each reply's details say how many prompt tokens were cached."""

from __future__ import annotations

import itertools

import pytest
from ui_fixtures import WAIT_MS, make_window, qasync_loop, ui_engine  # noqa: F401

from engine.backends.config import parse_backend_specs
from engine.engine import Engine


@pytest.fixture
def smollm_engine():
    """Request it before `make_window`, so it is closed after the windows on it."""
    eng = Engine.load("default", parse_backend_specs(["cpu:threads=2,cap=2,ctx=2048"]))
    yield eng
    eng.close()


def test_later_turns_show_their_cached_history_in_the_details(qtbot, smollm_engine, make_window):
    chat = make_window(engine=smollm_engine).panels["chat"]
    chat.max_tokens.setValue(24)
    # A fixed seed: the same replies every run. A reply's text, tokenized again in the next
    # prompt, can split differently from the tokens sampled (a random reply in a fresh clone did),
    # and then less of it matches the cache than this test asserts.
    chat.seed.setValue(7)
    for text in ("Name three fruits that grow on trees.", "Which of them is red?", "And which one is yellow?"):
        chat.input.setPlainText(text)
        chat.send_button.click()
        qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    replies = [m.meta for m in chat.chat.messages if m.role == "assistant"]
    assert len(replies) == 3 and not any(r["error"] for r in replies)
    transcript = chat.transcript_text()
    for before, meta in itertools.pairwise(replies):
        # the earlier turn's prompt and its reply, as far as it was decoded, came from the cache
        assert meta["cached_tokens"] >= before["prompt_tokens"] + before["output_tokens"] - 1, replies
        assert f"cached {meta['cached_tokens']}/{meta['prompt_tokens']}" in transcript
