"""From the engine's threads to the GUI thread: queued signals and one snapshot timer.

The engine publishes events on backend worker threads (`engine.core.events`). `EngineBridge`
subscribes to the bus and re-emits the few events views need as Qt signals; a signal emitted
on a thread other than the bridge's is delivered through the receiver's event queue (a queued
connection), so slots always run on the GUI thread. `StepDone` arrives per `llama_decode`
(hundreds a second): it is only counted, under a lock, and the counts are handed out once per
tick instead of as one signal each.

Once per tick (10-20 Hz) the bridge reads `engine.snapshot()` on the GUI thread and emits
`tick(Tick)`; every plot and label updates from that one timer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, QTimer, Signal

from engine.core.events import RequestAdmitted, RequestFinished, RequestRouted, StepDone

DEFAULT_HZ = 15


@dataclass(frozen=True, slots=True)
class Tick:
    """One frame: every backend's snapshot and what each decoded since the previous tick."""

    time: float  # time.monotonic()
    snapshots: tuple  # BackendSnapshot, in engine order
    decode_tokens: dict = field(default_factory=dict)  # backend -> tokens decoded since last tick
    prefill_tokens: dict = field(default_factory=dict)  # backend -> prompt tokens computed
    dt: float = 0.0  # seconds since the previous tick


class EngineBridge(QObject):
    """Marshals engine events to the GUI thread and drives the snapshot timer.

    Thread contract: `_on_event` runs on engine threads and only emits signals or updates the
    step counters under `_lock`; everything else runs on the GUI thread.
    """

    routed = Signal(object)  # engine.routing.RoutingDecision
    admitted = Signal(object)  # engine.core.events.RequestAdmitted
    finished = Signal(object)  # engine.core.request.FinishRecord
    tick = Signal(object)  # Tick

    def __init__(self, engine, hz: int = DEFAULT_HZ, parent: QObject | None = None):
        super().__init__(parent)
        self.engine = engine
        self._lock = threading.Lock()
        self._decoded: dict[str, int] = {}
        self._prefilled: dict[str, int] = {}
        self._closed = False
        self._last_tick = time.monotonic()
        self._unsubscribe = engine.bus.subscribe(
            self._on_event, (RequestRouted, RequestAdmitted, RequestFinished, StepDone))
        self._timer = QTimer(self)
        self._timer.setInterval(max(1, round(1000 / hz)))
        self._timer.timeout.connect(self._on_timer)
        self._timer.start()

    @property
    def interval_ms(self) -> int:
        return self._timer.interval()

    def close(self) -> None:
        """Stop the timer and unsubscribe (GUI thread). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._timer.stop()
        self._unsubscribe()

    # ---- any thread ----

    def _on_event(self, event) -> None:
        if self._closed:
            return
        if isinstance(event, StepDone):
            with self._lock:
                self._decoded[event.backend] = self._decoded.get(event.backend, 0) + event.n_decode
                self._prefilled[event.backend] = self._prefilled.get(event.backend, 0) + event.n_prefill
        elif isinstance(event, RequestRouted):
            self.routed.emit(event.decision)
        elif isinstance(event, RequestFinished):
            self.finished.emit(event.record)
        elif isinstance(event, RequestAdmitted):
            self.admitted.emit(event)

    # ---- GUI thread ----

    def _on_timer(self) -> None:
        self.tick.emit(self.read())

    def read(self) -> Tick:
        """Take a tick now (also used to refresh a view at once after a control changed)."""
        now = time.monotonic()
        with self._lock:
            decoded, self._decoded = self._decoded, {}
            prefilled, self._prefilled = self._prefilled, {}
        dt, self._last_tick = now - self._last_tick, now
        return Tick(now, tuple(self.engine.snapshot()), decoded, prefilled, dt)
