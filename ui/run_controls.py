"""Pause / Step for the live run in progress (`ui.live_run.WorkloadRun`).

`RunControls` is a row of two buttons and a line of state: Pause holds back the arrivals still to
come (the engine keeps serving what it holds), Step submits the next arrival now, Resume goes
on at the workload's spacing. `attach(run)` binds it to a run (the Experiments panel's own runs,
a demo from the Run menu); with no run, or a run it cannot drive (the benchmark runner times its
own arrivals), both buttons are off and the line says why.

Thread contract: main thread only (a widget).
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSizePolicy, QWidget


class RunControls(QWidget):
    status_message = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.run = None
        self._why_off = "no live run"
        self.pause_button = QPushButton("Pause arrivals")
        self.pause_button.setCheckable(True)
        self.pause_button.setToolTip("Hold back the arrivals still to come; requests already sent keep running")
        self.pause_button.toggled.connect(self._on_pause_toggled)
        self.step_button = QPushButton("Step ▸")
        self.step_button.setToolTip("Send the next arrival now (and stay paused)")
        self.step_button.clicked.connect(self.step)
        self.state_label = QLabel()
        self.state_label.setObjectName("muted")
        self.state_label.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.pause_button)
        lay.addWidget(self.step_button)
        lay.addWidget(self.state_label, 1)
        self._refresh()

    def attach(self, run, why_off: str = "no live run") -> None:
        """Drive `run` (a WorkloadRun), or nothing (`run=None`, with `why_off` shown)."""
        if self.run is not None:
            for sig, slot in ((self.run.paused_changed, self._refresh), (self.run.submitted, self._refresh),
                              (self.run.progress, self._refresh), (self.run.phase, self._refresh)):
                try:
                    sig.disconnect(slot)
                except (RuntimeError, TypeError):
                    pass
        self.run = run
        self._why_off = why_off
        if run is not None:
            for sig in (run.paused_changed, run.submitted, run.progress, run.phase):
                sig.connect(self._refresh)
        self._refresh()

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
            self.run.pause() if on else self.run.resume()
        self._refresh()

    def _refresh(self, *_args) -> None:
        run = self.run
        live = run is not None and run.running
        self.pause_button.setEnabled(live)
        self.step_button.setEnabled(live and run.n_submitted < run.spec.n_requests)
        paused = live and run.paused
        if self.pause_button.isChecked() != paused:
            self.pause_button.blockSignals(True)
            self.pause_button.setChecked(paused)
            self.pause_button.blockSignals(False)
        self.pause_button.setText("Resume" if paused else "Pause arrivals")
        if not live:
            self.state_label.setText(self._why_off if run is None else f"{run.result.label}: {run.state}")
            return
        total = run.spec.n_requests
        self.state_label.setText(f"{run.result.label}: {run.n_submitted}/{total} sent, "
                                 f"{len(run.result.records)} done" + (" · paused" if paused else ""))
