"""Pause / Step for the live run in progress.

`RunControls` is a row of two buttons and a line of state: Pause holds back the arrivals still to
come (the engine keeps serving what it holds), Step submits the next arrival now, Resume goes
on at the workload's spacing. `attach(run)` binds it to a run: a `ui.live_run.WorkloadRun` (a
demo from the Run menu, the Experiments panel's own runs), an `ui.experiments.BenchRun` (the
benchmark runner's thread waiting on an `engine.sim.arrivals.ArrivalClock`) or a
`ui.lesson.LessonRun` (arrivals until Stop: no total, `n_requests` None). A run offers `running`,
`paused`, `n_submitted`, `n_requests`, `label`, `state`, `pause()`, `resume()` and `step()`;
the row re-reads them on a short timer (and at once on a WorkloadRun's signals). With no run
both buttons are off. `pause_text` names the Pause button (a narrow row says just "Pause"), and
`state=False` leaves the line of state out (the Teaching panel's row, whose progress bar and note
say it, and the lesson bar, whose phase strip does).

Thread contract: main thread only (a widget).
"""

from __future__ import annotations

from typing import Protocol

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSizePolicy, QWidget


class SteppableRun(Protocol):
    """What the row reads and drives (a `WorkloadRun` or a `BenchRun`; named here, not
    imported, so `ui.experiments`, which holds this row, is not imported back)."""

    @property
    def running(self) -> bool: ...
    @property
    def paused(self) -> bool: ...
    @property
    def n_submitted(self) -> int: ...
    @property
    def n_requests(self) -> int | None: ...  # None: arrivals until Stop (a lesson)
    @property
    def label(self) -> str: ...
    @property
    def state(self) -> str: ...
    def pause(self) -> bool: ...
    def resume(self) -> bool: ...
    def step(self) -> bool: ...


class RunControls(QWidget):
    status_message = Signal(str)

    def __init__(self, parent: QWidget | None = None, pause_text: str = "Pause arrivals", state: bool = True):
        """`state`: show the line of state beside the buttons (a row that says it elsewhere, or has
        no room for it in large type, leaves it out)."""
        super().__init__(parent)
        self.run: SteppableRun | None = None
        self._why_off = "no live run"
        self._pause_text = pause_text
        self.pause_button = QPushButton(pause_text)
        self.pause_button.setCheckable(True)
        self.pause_button.setToolTip("Hold back the arrivals still to come; requests already sent keep running")
        self.pause_button.toggled.connect(self._on_pause_toggled)
        self.step_button = QPushButton("Step ▸")
        self.step_button.setToolTip("Send the next arrival now (and stay paused)")
        self.step_button.clicked.connect(self.step)
        self.state_label = QLabel()
        self.state_label.setObjectName("muted")
        self.state_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.pause_button)
        lay.addWidget(self.step_button)
        lay.addWidget(self.state_label, 1)
        self.state_label.setVisible(state)
        self._timer = QTimer(self)
        self._timer.setInterval(250)
        self._timer.timeout.connect(self._refresh)
        self._refresh()

    def attach(self, run: SteppableRun | None, why_off: str = "no live run") -> None:
        """Drive `run` (a WorkloadRun), or nothing (`run=None`, with `why_off` shown)."""
        for sig in self._signals(self.run):
            sig.disconnect(self._refresh)
        self.run = run
        self._why_off = why_off
        for sig in self._signals(run):
            sig.connect(self._refresh)
        if run is None:
            self._timer.stop()
        else:
            self._timer.start()
        self._refresh()

    @staticmethod
    def _signals(run) -> list:
        names = ("paused_changed", "submitted", "progress", "phase")
        return [getattr(run, n) for n in names if hasattr(run, n)] if run is not None else []

    def pause(self) -> bool:
        return self.run is not None and self.run.pause()

    def resume(self) -> bool:
        return self.run is not None and self.run.resume()

    def step(self) -> bool:
        if self.run is None:
            return False
        if not self.run.step():
            self.status_message.emit("no arrival to step: " + ("the run is still warming up" if self.run.running
                                                              else "the run is over"))
            return False
        return True

    def _on_pause_toggled(self, on: bool) -> None:
        if self.run is not None and on != self.run.paused:
            if on:
                self.run.pause()
            else:
                self.run.resume()
        self._refresh()

    def _refresh(self, *_args) -> None:
        run = self.run
        live = run is not None and run.running
        self.pause_button.setEnabled(live)
        total = run.n_requests if run is not None else None
        self.step_button.setEnabled(run is not None and live and (total is None or run.n_submitted < total))
        paused = run is not None and live and run.paused
        if self.pause_button.isChecked() != paused:
            self.pause_button.blockSignals(True)
            self.pause_button.setChecked(paused)
            self.pause_button.blockSignals(False)
        self.pause_button.setText("Resume" if paused else self._pause_text)
        if run is None or not live:
            self.state_label.setText(self._why_off if run is None else f"{run.label}: {run.state}")
            if run is not None:
                self._timer.stop()
            return
        sent = f"{run.n_submitted}" + (f"/{total}" if total is not None else "")
        self.state_label.setText(f"{run.label}: {sent} sent" + (" · paused" if paused else ""))
