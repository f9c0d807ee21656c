"""A live run's phase strip: warming the shared prefix → arrivals → draining, with counts.

A demo's first seconds warm a 496-token prefix on every backend before any request arrives;
without a word the views showed "0 rows" and empty plots, which read as broken. `run_phases`
(pure) says where a run is; `RunStrip` (a label) shows it above the routing table and the
latency plots, re-read on the run's signals. Main thread only.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget

from ..theme import HEALTHY, MUTED, WORKING

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


def strip_html(run, prefix_tokens: int) -> str:
    """The strip for `run` (a `ui.live_run.WorkloadRun`): each step, the current one bold with
    its counts."""
    total = run.n_requests
    done = len(run.result.records)
    current = run_phase(run.state, run.n_submitted, done, total)
    counts = {
        "warming": f"{prefix_tokens} tokens on every backend" if prefix_tokens else "nothing to warm",
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
        self.setVisible(False)

    def attach(self, run) -> None:
        if self.run is not None:
            for sig in self._signals(self.run):
                sig.disconnect(self.refresh)
        self.run = run
        for sig in self._signals(run):
            sig.connect(self.refresh)
        self.refresh()

    @staticmethod
    def _signals(run) -> list:
        return [getattr(run, n) for n in ("phase", "submitted", "progress", "paused_changed")]

    def refresh(self, *_args) -> None:
        run = self.run
        if run is None:
            self.setVisible(False)
            return
        prefix = len(run.workload.prefix or ())
        self.setText(strip_html(run, prefix))
        self.setToolTip("Warming: the shared prompt prefix is computed once on each backend and cached, so the "
                        "requests reuse it. Arrivals: requests are sent on the workload's schedule. Draining: "
                        "every request is sent; the last ones finish.")
        self.setVisible(True)
