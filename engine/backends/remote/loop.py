"""The asyncio loop a remote backend runs in a thread of its own, and how it hands text over.

Deliveries made in one loop iteration (all streams' data that arrived together) reach each
consumer's loop in one hand-over (`Outbox`, engine/core/handle.py): `batch()` opens the
outbox for this iteration, the flush scheduled behind it closes it.

Thread contract: `start`, `stop`, `submit` and `wake` from any thread; `batch` and `flush`
on the loop thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from engine.core.errors import BackendUnavailable
from engine.core.handle import Outbox


class LoopThread:
    """One event loop in one daemon thread, named for its backend."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._outbox = Outbox()
        self._pending = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop; `BackendUnavailable` before it started."""
        if self._loop is None:
            raise BackendUnavailable(f"backend {self.name}'s event loop has not started")
        return self._loop

    @property
    def started(self) -> bool:
        return self._loop is not None

    def here(self) -> bool:
        """Whether the caller runs on the loop's thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def start(self, timeout: float) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"remote-{self.name}", daemon=True)
        self._thread.start()
        ready.wait(timeout)

    def stop(self, timeout: float) -> None:
        """Stop the loop and join its thread (what ran on it must be done first)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wake(self, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)` on the loop soon; nothing where the loop has gone."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # closed in between
                pass

    def batch(self) -> None:
        """This thread's deliveries go to the outbox until the flush behind this iteration."""
        if not self._pending:
            self._pending = True
            self._outbox.__enter__()
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Hand what the outbox holds over now (idempotent)."""
        if self._pending:
            self._pending = False
            self._outbox.__exit__(None, None, None)

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
