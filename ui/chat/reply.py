"""The reply being streamed: its request's handle, the asyncio task that reads it, its text so far.

`ReplyStream.start` submits a request with `loop=` the running (qasync) loop and reads
`handle.astream()` in a task on it, so every delta arrives on the GUI thread (`text_changed`
carries the text so far) without a worker ever touching a widget. When the stream ends the
stream forgets its handle, then emits `ended(record, decision, to)`: the request's
`FinishRecord`, its routing decision and what the reply becomes in its chat (`ReplyTo`).
`chat_request` builds the request: the chat's tokens through the model's template, or the
messages themselves for remote engines, which render their own.

Main thread only.
"""

from __future__ import annotations

import asyncio

from PySide6.QtCore import QObject, Signal

from engine.core.handle import RequestHandle
from engine.core.request import Request, SamplingParams

from ..model.history import APPEND, ReplyTo


def chat_request(engine, messages: list[dict], sampling: SamplingParams, backend: str | None = None,
                 continue_final: bool = False) -> Request:
    """The request for a reply to `messages` (pinned to `backend` if given); `continue_final`
    goes on with the last message instead of answering it. `EngineError` if the engine refuses
    the prompt (too long for the context, no template)."""
    if engine.model is None:  # remote engines only: each renders its own template
        return Request((), sampling, backend=backend, source="gui", messages=tuple(messages))
    tokens = engine.chat_tokens(messages, continue_final=continue_final)
    return Request(tuple(tokens), sampling, backend=backend, source="gui")


class ReplyStream(QObject):
    """At most one reply at a time, read from the engine on the running asyncio loop."""

    text_changed = Signal(str)  # the reply's text so far
    ended = Signal(object, object, object)  # FinishRecord, the routing decision, ReplyTo

    def __init__(self, engine, parent: QObject | None = None):
        super().__init__(parent)
        self.engine = engine
        self.handle: RequestHandle | None = None
        self.to: ReplyTo = APPEND  # what the reply streaming now becomes
        self._task: asyncio.Task | None = None
        self._pieces: list[str] = []

    @property
    def busy(self) -> bool:
        return self.handle is not None

    @property
    def text(self) -> str:
        """The text of the reply streaming now (or the last one), as far as it has come."""
        return "".join(self._pieces)

    def start(self, request: Request, to: ReplyTo) -> RequestHandle:
        """Submit `request` and read its reply; `EngineError` or `ValueError` if it is refused."""
        loop = asyncio.get_event_loop()
        handle = self.engine.submit(request, loop=loop)
        self.handle, self.to, self._pieces = handle, to, []
        self._task = loop.create_task(self._read(handle))
        return handle

    def stop(self) -> bool:
        """Cancel the reply: the engine ends its stream, and `ended` comes with the text so far."""
        if self.handle is None:
            return False
        self.handle.cancel()
        return True

    def shutdown(self) -> None:
        """Cancel the reply and the task reading it (the panel is going away): no `ended`."""
        if self.handle is not None:
            self.handle.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _read(self, handle: RequestHandle) -> None:
        try:
            async for delta in handle.astream():
                self._pieces.append(delta)
                self.text_changed.emit(self.text)
        except asyncio.CancelledError:
            handle.cancel()
            raise
        record, decision, to = handle.result(0), handle.decision, self.to
        self.handle, self._task, self.to = None, None, APPEND
        self.ended.emit(record, decision, to)
