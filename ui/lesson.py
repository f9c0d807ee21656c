"""A lesson run live: `engine.lesson.Lesson` driven by a Qt timer, and the hint that says what to
try next.

`LessonRun` submits each arrival when it falls due (one single-shot timer set to the next due
time, reset when the rate changes), collects each request's `FinishRecord` from the bridge, and
offers what the Pause/Step row (`ui.run_controls.RunControls`), the phase strip
(`ui.run_strip.RunStrip`) and the Run menu's F6/F7 read and drive: `running`, `paused`,
`n_submitted`, `n_requests` (None: open-ended), `label`, `state`, `pause()`, `resume()`,
`step()`, plus `set_rate()` and `stop()`. Arrivals come until `stop()`, which cancels what is
still in flight.

`lesson_hint` (pure) is the one line the lesson bar shows: the next thing to try, given what the
teacher has done so far (`Progress`).

Thread contract: main thread only (a QObject driven by a Qt timer and the bridge's signals).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, Qt, QTimer, Signal

from engine.lesson import Lesson, LessonMix, Sent
from engine.sim.benchmark import RunSummary

from .model.live_stats import summarize

if TYPE_CHECKING:
    from engine.core.request import FinishRecord
    from engine.engine import Engine

    from .bridge import EngineBridge


@dataclass
class LessonResult:
    """What a lesson sent and what came back (the same fields a `ui.live_run.RunResult` has for
    the views, without a workload: the arrivals had no end)."""

    label: str
    policy: str
    t_start: float = 0.0
    t_end: float = 0.0
    request_ids: list[str] = field(default_factory=list)
    submitted: dict = field(default_factory=dict)  # request id -> monotonic time it was submitted
    pauses: list = field(default_factory=list)
    records: dict = field(default_factory=dict)  # request id -> FinishRecord
    decisions: dict = field(default_factory=dict)  # request id -> RoutingDecision
    error: str | None = None  # the last request the engine refused, and why

    def ordered_records(self) -> list:
        return [self.records[r] for r in self.request_ids if r in self.records]

    def summary(self) -> RunSummary:
        return summarize(self.label, self.policy, self.ordered_records(), self.t_start, self.t_end or time.monotonic(),
                         submitted=self.submitted, pauses=self.pauses)


class LessonRun(QObject):
    """One lesson. Create, connect its signals, call `start()`; `stop()` ends it."""

    phase = Signal(str)  # "running", "stopped"
    submitted = Signal(int, int)  # requests sent so far, 0 (no total: open-ended)
    progress = Signal(int, int)  # requests finished, requests sent
    paused_changed = Signal(bool)
    rate_changed = Signal(float)
    first_arrival = Signal(float)  # seconds from start() to the first request sent
    done = Signal(object)  # LessonResult

    def __init__(self, engine: Engine, bridge: EngineBridge, mix: LessonMix | None = None,
                 rate: float | None = None, label: str = "lesson", parent: QObject | None = None) -> None:
        """`rate`: arrivals per second (None: the rate the backends' measured rates suggest)."""
        super().__init__(parent)
        self.engine = engine
        self.bridge = bridge
        self.lesson = Lesson(engine, mix, rate)
        self.result = LessonResult(label, engine.router.policy)
        self.state = "idle"
        self.steps = 0  # arrivals sent by step()
        self._ids: set[str] = set()
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setTimerType(Qt.TimerType.PreciseTimer)
        self._timer.timeout.connect(self._submit_due)
        bridge.finished.connect(self._on_finished)

    # ---- what the Pause/Step row and the strip read ----

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def paused(self) -> bool:
        return self.lesson.paused

    @property
    def n_submitted(self) -> int:
        return len(self.lesson.sent)

    @property
    def n_requests(self) -> None:
        """No total: a lesson's arrivals come until Stop."""
        return None

    @property
    def n_done(self) -> int:
        return len(self.result.records)

    @property
    def label(self) -> str:
        return self.result.label

    @property
    def rate(self) -> float:
        return self.lesson.rate

    def seconds_to_next(self) -> float | None:
        return self.lesson.seconds_to_next()

    # ---- control ----

    def start(self) -> None:
        if self.state != "idle":
            raise RuntimeError("a LessonRun runs once")
        self.lesson.start()
        self.result.t_start = self.lesson.t_start or time.monotonic()
        self._set("running")
        self._submit_due()

    def pause(self) -> bool:
        """Hold back the arrivals to come; what was sent runs on. False if not running or paused."""
        if not self.running or not self.lesson.pause():
            return False
        self._timer.stop()
        self.paused_changed.emit(True)
        return True

    def resume(self) -> bool:
        if not self.running or not self.lesson.resume():
            return False
        self.paused_changed.emit(False)
        self._submit_due()
        return True

    def step(self) -> bool:
        """Send the next arrival now and stay paused (pausing first). False once stopped."""
        was_paused = self.paused
        sent = self.lesson.step()
        if sent is None:
            return False
        self._timer.stop()
        self.steps += 1
        if not was_paused:
            self.paused_changed.emit(True)
        self._record(sent)
        return True

    def set_rate(self, rate: float) -> float:
        """Arrivals per second from the next one on (clamped); the rate set."""
        rate = self.lesson.set_rate(rate)
        self.rate_changed.emit(rate)
        if self.running and not self.paused:
            self._submit_due()  # the next arrival's time moved: due now, or the timer is reset
        return rate

    def stop(self) -> None:
        """No more arrivals; the requests in flight are cancelled (they finish as cancelled)."""
        if not self.running:
            return
        self._timer.stop()
        self.lesson.stop()
        self.result.t_end = time.monotonic()
        self.result.pauses = self.lesson.clock.pauses()
        self.bridge.finished.disconnect(self._on_finished)
        self._set("stopped")
        self.done.emit(self.result)

    # ---- the timer ----

    def _submit_due(self) -> None:
        for sent in self.lesson.pump():
            self._record(sent)
        wait = self.lesson.seconds_to_next()
        if wait is None:
            self._timer.stop()
        else:
            self._timer.start(max(0, round(wait * 1000)))

    def _record(self, sent: Sent) -> None:
        if sent.handle is not None:
            rid = sent.handle.id
            self._ids.add(rid)
            self.result.request_ids.append(rid)
            self.result.submitted[rid] = sent.t_submit
            self.result.decisions[rid] = sent.handle.decision
        else:
            self.result.error = sent.error
        n = len(self.lesson.sent)
        self.submitted.emit(n, 0)
        if n == 1 and self.lesson.first_arrival_s is not None:
            self.first_arrival.emit(self.lesson.first_arrival_s)

    def _on_finished(self, record: FinishRecord) -> None:
        if record.request_id in self._ids and record.request_id not in self.result.records:
            self.result.records[record.request_id] = record
            self.progress.emit(len(self.result.records), len(self.lesson.sent))

    def _set(self, state: str) -> None:
        self.state = state
        self.phase.emit(state)


@dataclass(frozen=True)
class Progress:
    """What the teacher has done so far in a lesson, for `lesson_hint`."""

    sent: int
    paused: bool
    ceiling_lowered: bool
    rate_changed: bool
    policy_changed: bool
    stepped: bool
    backlog: bool = False  # more requests wait than BACKLOG_CEILINGS times the ceilings run at once


WATCH_FIRST = 4  # rows to watch arrive before the first suggestion
BACKLOG_CEILINGS = 2  # waiting requests, in ceilings' worth, that say the arrivals outrun the backends


def lesson_hint(p: Progress, backends: list[str]) -> str:
    """The one line that says what to try next (plain words; the backends by name)."""
    first = backends[0] if backends else "the first backend"
    if p.paused:
        return "Paused: Step (F7) sends one request — watch its row — then Resume (F6)"
    if p.backlog:
        return "The queues keep growing: the machine is busier than measured. Slow the rate (−)"
    if p.sent < WATCH_FIRST:
        return "Each row is one request: it goes to the backend with the lowest score. Watch a few arrive"
    if not p.ceiling_lowered:
        return f"Lower {first}'s ceiling to 1 and watch the next rows"
    if not p.rate_changed:
        return f"{first} now runs one at a time: its score climbs with its queue. Turn the rate up (+)"
    if not p.policy_changed:
        return "Switch the policy to round-robin and compare the latency plots before and after the mark"
    if not p.stepped:
        return "Pause (F6), then Step (F7) to follow one request at a time"
    return "Raise the ceiling again, or Stop to end the lesson"
