"""RequestHandle delivery to asyncio consumers: per call, or gathered in an Outbox and handed
to the loop once per flush."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.core.handle import Outbox, RequestHandle
from engine.core.request import FinishRecord, Request, RequestStatus, SamplingParams


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)
    loop.close()


# The producer side (`_deliver_text`, `_deliver_finish`) is the engine's own: backends and the
# scheduler call it, callers never do; and `_aq`, the loop-side queue, is where the Outbox's
# promise (nothing reaches the loop before a flush) can be seen. Both are tested as they are.
def _handle(loop) -> RequestHandle:
    return RequestHandle(Request((1, 2), SamplingParams(max_tokens=4)), loop)


def _finish(h: RequestHandle, text: str) -> None:
    h._deliver_finish(FinishRecord(request_id=h.id, backend="b", status=RequestStatus.FINISHED_LENGTH, text=text,
                                   prompt_tokens=2, cached_tokens=0, output_tokens=len(text), queue_s=0.0,
                                   ttft_s=0.0, e2e_s=0.0, itl_s=None))


def _pending(loop, h: RequestHandle) -> int:
    return asyncio.run_coroutine_threadsafe(_qsize(h), loop).result(5)


async def _qsize(h):
    return h._aq.qsize()


async def _collect(h):
    return [d async for d in h.astream()]


def test_an_outbox_holds_deliveries_until_it_flushes(loop):
    a, b = _handle(loop), _handle(loop)
    with Outbox() as box:
        for piece in ("he", "ll", "o"):
            a._deliver_text(piece)
        b._deliver_text("x")
        _finish(b, "x")
        assert _pending(loop, a) == 0 and _pending(loop, b) == 0, "nothing reaches the loop before the flush"
        box.flush()
        assert _pending(loop, a) == 3 and _pending(loop, b) == 2
        a._deliver_text("!")
        _finish(a, "hello!")
    # leaving the block flushed the rest
    assert asyncio.run_coroutine_threadsafe(_collect(a), loop).result(5) == ["hello!"]
    assert asyncio.run_coroutine_threadsafe(_collect(b), loop).result(5) == ["x"]
    assert a.result(1).text == "hello!"


def test_without_an_outbox_each_delivery_goes_at_once(loop):
    h = _handle(loop)
    h._deliver_text("a")
    assert _pending(loop, h) == 1
    stream = asyncio.run_coroutine_threadsafe(_collect(h), loop)
    h._deliver_text("b")
    _finish(h, "ab")
    assert "".join(stream.result(5)) == "ab"
