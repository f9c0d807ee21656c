"""The threads that read, check and tokenize request bodies, apart from everything else.

A request's body is parsed off the event loop (templating and tokenizing megabytes, checking a
grammar against the vocabulary in llama.cpp). Those calls were asyncio's default executor,
shared with every other `to_thread`: six requests whose grammar check never returned (a call
into llama.cpp that spun for 25 minutes) filled it, every chat and `/tokenize` then hung while
`/health` said `ok`, and the process ignored SIGTERM (Python joins executor threads at exit).
`ParsePool` is that executor made for the job:

* its own `workers` daemon threads (a stuck one never keeps the process alive);
* a deadline per call: a caller waits at most `deadline_s`, then gets `ParseTimeout` (503,
  `Retry-After`) while the call goes on in its thread, which now counts as *stuck*;
* a stuck thread is replaced, up to `spares` extra threads, so calls that never return take
  no capacity from the rest until the spares are spent too;
* `stuck` and `exhausted` for `/health`.

Thread contract: `run` is called on the loop; workers run calls; the counts are under a lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from engine.core.errors import BackendUnavailable, EngineError

PARSE_WORKERS = 4  # the CPU work they do holds the GIL: more would only queue behind it
PARSE_SPARES = 4  # threads that may replace stuck ones
PARSE_DEADLINE_S = 20.0  # a near-2 MiB chat takes ~1 s here; a grammar check at most MAX_PASS_MS


class ParseTimeout(BackendUnavailable):
    """A body that could not be checked in time (503, retry)."""


class ParsePool:
    """Daemon worker threads with a deadline per call (see the module doc)."""

    def __init__(self, workers: int = PARSE_WORKERS, spares: int = PARSE_SPARES,
                 deadline_s: float = PARSE_DEADLINE_S, clock: Callable[[], float] = time.monotonic):
        self.workers, self.spares, self.deadline_s, self._clock = workers, spares, deadline_s, clock
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict[concurrent.futures.Future, float] = {}  # call -> when it started
        self._live = 0
        self.timeouts = 0
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        with self._lock:
            self._live += 1
        threading.Thread(target=self._work, name="tandem-parse", daemon=True).start()

    def _work(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[future] = self._clock()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the caller, whatever it is
                future.set_exception(e)
            finally:
                with self._lock:
                    self._running.pop(future, None)
                    retire = self._live > self.workers + self._stuck_locked()
                    if retire:
                        self._live -= 1
            # Let go of the call before waiting for the next: a refusal's traceback holds this
            # frame, whose locals held the future that holds the refusal (a cycle only the
            # full collector broke; each idle thread kept its last body's tens of MB alive).
            del item, future, fn, args
            if retire:  # a spare whose stuck call came back: the pool is whole again without it
                return

    def _stuck_locked(self) -> int:
        now = self._clock()
        return sum(1 for t in self._running.values() if now - t > self.deadline_s)

    @property
    def stuck(self) -> int:
        """Calls running past their deadline (each holds a thread)."""
        with self._lock:
            return self._stuck_locked()

    @property
    def exhausted(self) -> bool:
        """Every thread, spares included, is stuck: bodies wait for nothing."""
        with self._lock:
            return self._stuck_locked() >= self.workers + self.spares

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a worker; `ParseTimeout` past `deadline_s` (the call goes on)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((future, fn, args))
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.deadline_s)
        except TimeoutError:
            if not future.cancel():  # running: its thread is stuck; a spare takes its place
                self.timeouts += 1
                with self._lock:
                    grow = self._live < self.workers + self.spares
                if grow:
                    self._spawn()
            raise ParseTimeout(f"the request could not be checked within {self.deadline_s:g} s; retry later") \
                from None
        except asyncio.CancelledError:
            future.cancel()  # the client left before a worker took it
            raise
        except EngineError as e:
            # A refusal, re-raised without the frames it came through, and without this frame's
            # `future`: asyncio's `wait_for` frame held its future, this frame the call's, each
            # holding the refusal whose traceback held those frames and the parse's (the validated
            # body): cycles only the full collector broke, so a 1 MB tool list refused 25 times
            # kept +400 MB of RSS.
            raise e.with_traceback(None) from None
        finally:
            del future

    def close(self) -> None:
        """Let idle workers go (a stuck one is a daemon: it ends with the process)."""
        for _ in range(self.workers + self.spares):
            self._tasks.put(None)


PARSING = web.AppKey("parsing", ParsePool)  # `create_app` sets it

# Bodies this large have their parse's garbage handed back to the system at once: each parsing
# thread has its own glibc heap, which kept the peak of the largest body it parsed (90,000
# metadata keys, refused again and again: the server's RSS grew 339 MB; trimmed, a fraction).
TRIM_ABOVE_BYTES = 256 << 10


def _find_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _find_trim()


def trim_heap(body_bytes: int) -> None:
    """After parsing a body of `body_bytes`, when large: give the heap's free pages back (glibc)."""
    if body_bytes >= TRIM_ABOVE_BYTES and _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
