"""A live run's phase strip: warming the shared prefix → arrivals → draining, with counts.

A demo's first seconds warm a 496-token prefix on every backend before any request arrives;
without a word the views showed "0 rows" and empty plots, which read as broken. `run_phases`
(pure) says where a run is; `RunStrip` (a label) shows it above the routing table and the
latency plots, re-read on the run's signals, and while warming once a second with the time left
(`warm_eta`: the prefix over the slowest backend's measured prefill rate; past it, how long it
has taken so far). A lesson (`ui.lesson.LessonRun`, no total) shows its arrivals: sent, done,
and when the next one comes. Main thread only.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget

from ..model.formatting import warm_eta, warm_left_text
from ..theme import HEALTHY, MUTED, WORKING

if TYPE_CHECKING:
    from ..lesson import LessonRun
    from ..live_run import WorkloadRun

STEPS = ("warming", "arrivals", "draining")
NAMES = {"warming": "Warming the shared prefix", "arrivals": "Arrivals", "draining": "Draining"}


def run_phase(state: str, submitted: int, done: int, total: int) -> str:
    """Which step of STEPS a run is in ('' once it ended): flushing and warming come before any
    arrival, arrivals while some are still to be sent, draining while sent ones still run."""
    if state in ("flushing", "warming"):
        return "warming"
    if state != "running":
        return ""
    return "arrivals" if submitted < total else "draining"


def lesson_html(run: LessonRun) -> str:
    """The strip for a lesson (`ui.lesson.LessonRun`): what was sent and done, and when the next
    one comes (the rate is in the lesson bar); one short line, even in large type."""
    if not run.running:
        return f"<b>{run.label}</b> {run.state}: {run.n_submitted} sent, {run.n_done} done"
    wait = run.seconds_to_next()
    when = ("paused: F7 sends one, F6 resumes" if run.paused
            else f"next in {wait:.1f} s" if wait is not None else "")
    return f"<b style='color:{WORKING}'>● {run.n_submitted} sent, {run.n_done} done</b> · {when}"


def rate_text(rate: float) -> str:
    """An arrival rate in words: 0.5 -> 'one every 2 s'; 2 -> '2 a second'."""
    if rate < 1:
        return f"one every {1 / rate:.3g} s"
    return f"{rate:.3g} a second"


def strip_html(run, prefix_tokens: int, warm_left: str = "") -> str:
    """The strip for `run` (a `ui.live_run.WorkloadRun`): each step, the current one bold with
    its counts (`warm_left`: the time left of the warming, in words)."""
    total = run.n_requests
    done = len(run.result.records)
    current = run_phase(run.state, run.n_submitted, done, total)
    counts = {
        "warming": (f"{prefix_tokens} tokens on every backend" if prefix_tokens else "nothing to warm")
        + (f", {warm_left}" if warm_left else ""),
        "arrivals": f"{run.n_submitted}/{total} sent, {done} done" + (" · paused (F6 resumes)" if run.paused else ""),
        "draining": f"{done}/{total} done, {total - done} still running",
    }
    order = STEPS.index(current) if current else len(STEPS)
    parts = []
    for i, step in enumerate(STEPS):
        if step == current:
            parts.append(f"<b style='color:{WORKING}'>● {NAMES[step]}: {counts[step]}</b>")
        elif i < order:
            parts.append(f"<span style='color:{HEALTHY}'>✓ {NAMES[step]}</span>")
        else:
            parts.append(f"<span style='color:{MUTED}'>{NAMES[step]}</span>")
    head = f"<b>{run.label}</b> ({total} requests): "
    if not current:
        head = f"<b>{run.label}</b> {run.state}: {done}/{total} done · "
    return head + "  →  ".join(parts)


class RunStrip(QLabel):
    """Shows the attached run's phase; hidden while no run is attached."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setTextFormat(Qt.TextFormat.RichText)
        self.setWordWrap(True)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.run = None
        self._warm_since: float | None = None  # monotonic, when the run was first seen warming
        self._clock = QTimer(self)  # the countdown while warming, the next arrival in a lesson
        self._clock.setInterval(500)
        self._clock.timeout.connect(self.refresh)
        self.setVisible(False)

    def attach(self, run) -> None:
        if self.run is not None:
            for sig in self._signals(self.run):
                sig.disconnect(self.refresh)
        self.run = run
        self._warm_since = None
        for sig in self._signals(run):
            sig.connect(self.refresh)
        self.refresh()

    @staticmethod
    def _signals(run) -> list:
        names = ("phase", "submitted", "progress", "paused_changed", "rate_changed")
        return [getattr(run, n) for n in names if hasattr(run, n)] if run is not None else []

    def refresh(self, *_args) -> None:
        run = self.run
        if run is None:
            self._clock.stop()
            self.setVisible(False)
            return
        ticking = run.running and (run.n_requests is None or run.state in ("flushing", "warming"))
        if ticking and not self._clock.isActive():
            self._clock.start()
        elif not ticking:
            self._clock.stop()
        if run.n_requests is None:
            self.setText(lesson_html(run))
            self.setToolTip("A lesson: requests keep arriving until Stop; change a ceiling, the policy or the "
                            "rate and watch the next rows")
            self.setVisible(True)
            return
        prefix = len(run.workload.prefix or ())
        self.setText(strip_html(run, prefix, self._warm_left(run, prefix)))
        self.setToolTip("Warming: the shared prompt prefix is computed once on each backend and cached, so the "
                        "requests reuse it. Arrivals: requests are sent on the workload's schedule. Draining: "
                        "every request is sent; the last ones finish.")
        self.setVisible(True)

    def _warm_left(self, run: WorkloadRun, prefix: int) -> str:
        if run.state not in ("flushing", "warming"):
            return ""
        now = time.monotonic()
        if self._warm_since is None:
            self._warm_since = now
        names = run.engine.backend_names
        return warm_left_text(warm_eta(prefix, [run.engine.rates(n).prefill_tok_s for n in names]),
                              now - self._warm_since)
