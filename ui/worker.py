"""One way to run blocking work off the GUI thread: `Worker`.

A `Worker` runs one callable on its own daemon thread and hands what happened back to the main
thread (napari's `thread_worker` + `ensure_main_thread` idea, without the generator protocol):

    worker = Worker(engine.restart, "cpu0", name="restart-cpu0", owner=card)
    worker.returned.connect(card.on_restarted)    # the callable's return value
    worker.errored.connect(card.on_restart_error)  # the exception it raised
    worker.start()

Thread contract:
- Build, connect and `start()` a worker on the main thread. The callable runs on the worker's
  thread and may call `worker.report(value)` from there (progress, partial results).
- `progress`, `returned`, `errored` and `finished` are emitted on the main thread only: the
  worker thread emits private signals that reach the worker (a main-thread QObject) through queued
  connections, and the worker re-emits them there. So slots may touch widgets.
- Exactly one of `returned` / `errored` fires, then `finished`, each once. Every `progress`
  reported before the callable returned is delivered before them. `errored` carries any
  `BaseException` the callable raised (it is also logged); nothing is raised on the thread.
- With an `owner`, nothing is delivered once the owner's C++ object is gone (a panel torn down
  while its worker ran), as when the signal lived on the owner itself.
- A started worker keeps itself alive (a class-level set) until `finished` has been delivered,
  so `Worker(...).start()` without keeping a reference is fine.
- `join(timeout)` waits for the thread (shutdown, tests; it does not pump Qt events, so nothing
  is delivered while it waits); `running` is true from `start()` until `finished` is delivered.
  `Worker.join_all(timeout)` waits for every worker thread started so far (a test's teardown
  uses it to fail on a thread left running).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import shiboken6
from PySide6.QtCore import QObject, Qt, Signal

log = logging.getLogger(__name__)


class Worker(QObject):
    progress = Signal(object)  # what the callable passed to `report`
    returned = Signal(object)  # the callable's return value
    errored = Signal(object)  # the BaseException it raised
    finished = Signal()  # last, after returned or errored

    # Emitted on the worker thread; queued to the main thread.
    _reported = Signal(object)
    _outcome = Signal(bool, object)  # ok, value or exception

    _live: ClassVar[set[Worker]] = set()
    _threads: ClassVar[weakref.WeakSet[threading.Thread]] = weakref.WeakSet()

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str, owner: QObject | None = None,
                 **kwargs: Any):
        super().__init__()  # no Qt parent: the worker outlives nothing by accident, see _live
        self._call = (fn, args, kwargs)
        self._owner = owner
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._delivered = False
        self._reported.connect(self._on_reported, Qt.ConnectionType.QueuedConnection)
        self._outcome.connect(self._on_outcome, Qt.ConnectionType.QueuedConnection)

    @property
    def name(self) -> str:
        return self._thread.name

    @property
    def running(self) -> bool:
        """Started, and its outcome not yet delivered on the main thread."""
        return self._thread.ident is not None and not self._delivered

    def start(self) -> Worker:
        Worker._live.add(self)
        Worker._threads.add(self._thread)
        self._thread.start()
        return self

    @classmethod
    def join_all(cls, timeout: float) -> list[str]:
        """Wait up to `timeout` seconds in all for every worker thread started so far to end;
        the names of those still running."""
        deadline = time.monotonic() + timeout
        for t in list(cls._threads):
            t.join(max(0.0, deadline - time.monotonic()))
        return sorted(t.name for t in cls._threads if t.is_alive())

    def report(self, value: Any = None) -> None:
        """Called by the callable, on the worker thread: delivered as `progress` on the main thread."""
        self._reported.emit(value)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; True if it has (or never started)."""
        if self._thread.ident is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- worker thread ----

    def _work(self) -> None:
        fn, args, kwargs = self._call
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:  # every failure is delivered, never raised here
            log.info("%s failed: %s", self.name, e, exc_info=True)
            self._outcome.emit(False, e)
        else:
            self._outcome.emit(True, value)

    # ---- main thread ----

    def _owner_alive(self) -> bool:
        return self._owner is None or shiboken6.isValid(self._owner)

    def _on_reported(self, value: Any) -> None:
        if not self._delivered and self._owner_alive():
            self.progress.emit(value)

    def _on_outcome(self, ok: bool, value: Any) -> None:
        self._delivered = True
        Worker._live.discard(self)
        if not self._owner_alive():
            return
        (self.returned if ok else self.errored).emit(value)
        self.finished.emit()
