"""The lesson bar: a lesson's controls in one strip above every view, and the hint.

One row: Start/Stop, Pause and Step (`ui.run_controls.RunControls`), the arrival rate (− and +),
each backend's ceiling, the routing policy. Below it one line in large type says what to try
next (`ui.lesson.lesson_hint`). It sits in a tool bar of the main window, so it stays on screen
whichever panel is in front, in Focus chat or Focus monitor and in the presenter view.

A ceiling or policy set here writes through the engine's setters (`Engine.set_cap`,
`Router.set_policy`) like the Controls panel, so the next request is routed with it; the views'
change marks (`ui.plot_marks`) show the moment. Values changed elsewhere are read back each tick.

Thread contract: main thread only (a widget).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.core.errors import EngineError
from engine.lesson import RATE_STEPS

from .lesson import BACKLOG_CEILINGS, LessonRun, Progress, lesson_hint
from .panels.controls import policy_choices
from .panels.run_controls import RunControls
from .panels.run_strip import rate_text

if TYPE_CHECKING:
    from engine.engine import Engine

    from .bridge import EngineBridge, Tick

HINT_PT = 15  # the hint's size: read from the back of a room


def next_rate(rate: float, up: bool) -> float:
    """The next of `RATE_STEPS` above (or below) `rate`, or `rate` at the end of them."""
    if up:
        return next((r for r in RATE_STEPS if r > rate * 1.001), rate)
    return next((r for r in reversed(RATE_STEPS) if r < rate * 0.999), rate)


class LessonBar(QWidget):
    status_message = Signal(str)
    start_requested = Signal()
    stop_requested = Signal()

    def __init__(self, engine: Engine, bridge: EngineBridge, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("lessonBar")
        self.engine = engine
        self.run: LessonRun | None = None
        self._start_ceilings: dict[str, int] = {}
        self._start_policy = engine.router.policy
        self._start_rate = 0.0
        self._backlog = False  # the queues outrun the backends (read each tick)
        self._build()
        bridge.tick.connect(self._on_tick)

    def _build(self) -> None:
        self.start_button = QPushButton("Start the lesson")
        self.start_button.setToolTip("Requests keep arriving until Stop (Run ▸ Start a lesson, Ctrl+L)")
        self.start_button.clicked.connect(self._on_start_stop)
        self.run_controls = RunControls(pause_text="Pause", state=False)  # the phase strip says it
        self.run_controls.status_message.connect(self.status_message)
        self.slower = QToolButton()
        self.slower.setText("−")
        self.slower.setToolTip("Fewer arrivals a second (Ctrl+minus)")
        self.slower.clicked.connect(lambda: self.change_rate(up=False))
        self.faster = QToolButton()
        self.faster.setText("+")
        self.faster.setToolTip("More arrivals a second (Ctrl+plus)")
        self.faster.clicked.connect(lambda: self.change_rate(up=True))
        self.rate_label = QLabel()
        self.rate_label.setToolTip("How often a request arrives; a change applies from the next arrival")
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        for w in (self.start_button, self.run_controls, QLabel("  Rate"), self.slower, self.rate_label, self.faster,
                  QLabel("  Ceilings")):
            row.addWidget(w)
        self.ceilings: dict[str, QSpinBox] = {}
        for snap in self.engine.snapshot():
            ceiling = max(snap.cap_ceiling or snap.cap, 1)
            box = QSpinBox(minimum=1, maximum=ceiling, value=ceiling)
            box.setKeyboardTracking(False)
            box.setPrefix(f"{snap.name} ")
            box.setToolTip(f"{snap.name}'s ceiling: the most requests it runs at once; the next request is "
                           "routed with the new one")
            box.valueChanged.connect(lambda v, n=snap.name: self.set_ceiling(n, v))
            self.ceilings[snap.name] = box
            row.addWidget(box)
        self.policy_combo = QComboBox()
        self.policy_combo.addItems(policy_choices(self.engine))
        self.policy_combo.setCurrentText(self.engine.router.policy)
        self.policy_combo.setToolTip("The routing policy; the next request is routed by it")
        self.policy_combo.currentTextChanged.connect(self.set_policy)
        row.addWidget(QLabel("  Policy"))
        row.addWidget(self.policy_combo)
        row.addStretch(1)
        self.hint_label = QLabel()
        self.hint_label.setObjectName("lessonHint")
        self.hint_label.setStyleSheet(f"font-size: {HINT_PT}pt; font-weight: bold;")
        self.hint_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.hint_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 2, 6, 2)
        lay.setSpacing(2)
        lay.addLayout(row)
        lay.addWidget(self.hint_label)
        self._refresh()

    # ---- the run ----

    def attach(self, run: LessonRun | None) -> None:
        """Drive `run` (a lesson just started), or nothing."""
        if self.run is not None:
            self.run.phase.disconnect(self._refresh)
            self.run.rate_changed.disconnect(self._refresh)
        self.run = run
        self.run_controls.attach(run, why_off="no lesson")
        if run is not None:
            run.phase.connect(self._refresh)
            run.rate_changed.connect(self._refresh)
            self._start_ceilings = {s.name: s.cap_ceiling or s.cap for s in self.engine.snapshot()}
            self._start_policy = self.engine.router.policy
            self._start_rate = run.rate
        self._refresh()

    def change_rate(self, up: bool) -> float | None:
        """The next rate of the ladder up or down; None without a lesson running."""
        if self.run is None or not self.run.running:
            return None
        rate = self.run.set_rate(next_rate(self.run.rate, up))
        self.status_message.emit(f"arrivals: {rate_text(rate)}, from the next one")
        return rate

    def set_ceiling(self, name: str, ceiling: int) -> None:
        try:
            self.engine.set_cap(name, ceiling)
        except EngineError as e:
            self.status_message.emit(f"could not set {name}'s ceiling: {e}")
            return
        self.status_message.emit(f"{name}'s ceiling is {ceiling}: the next request is routed with it")

    def set_policy(self, name: str) -> None:
        try:
            self.engine.router.set_policy(name)
        except (EngineError, ValueError) as e:
            self.status_message.emit(f"could not use the policy {name}: {e}")
            return
        self.status_message.emit(f"routing policy: {name}, from the next request")

    def _on_start_stop(self) -> None:
        if self.run is not None and self.run.running:
            self.stop_requested.emit()
        else:
            self.start_requested.emit()

    # ---- per tick ----

    def _on_tick(self, tick: Tick) -> None:
        ceilings = sum(s.cap_ceiling or s.cap for s in tick.snapshots)
        self._backlog = sum(len(s.waiting) for s in tick.snapshots) > BACKLOG_CEILINGS * ceilings
        for s in tick.snapshots:
            box = self.ceilings.get(s.name)
            ceiling = s.cap_ceiling or s.cap
            if box is not None and not box.hasFocus() and box.value() != ceiling and ceiling <= box.maximum():
                box.blockSignals(True)
                box.setValue(ceiling)
                box.blockSignals(False)
        policy = self.engine.router.policy
        if policy != self.policy_combo.currentText() and not self.policy_combo.hasFocus():
            self.policy_combo.blockSignals(True)
            self.policy_combo.setCurrentText(policy)
            self.policy_combo.blockSignals(False)
        self._refresh()

    def progress(self) -> Progress:
        """What the teacher has done in this lesson so far."""
        run = self.run
        lowered = any(box.value() < self._start_ceilings.get(name, box.value()) for name, box in self.ceilings.items())
        return Progress(sent=run.n_submitted if run is not None else 0, paused=run is not None and run.paused,
                        ceiling_lowered=lowered, rate_changed=run is not None and run.rate != self._start_rate,
                        policy_changed=self.engine.router.policy != self._start_policy,
                        stepped=run is not None and run.steps > 0, backlog=self._backlog)

    def _refresh(self, *_args) -> None:
        run = self.run
        live = run is not None and run.running
        self.start_button.setText("Stop the lesson" if live else "Start a lesson")
        for w in (self.slower, self.faster):
            w.setEnabled(live)
        self.rate_label.setText(rate_text(run.rate) if run is not None else "—")
        if live:
            hint = lesson_hint(self.progress(), list(self.ceilings))
        elif run is not None:
            hint = f"Lesson over: {run.n_submitted} requests sent, {run.n_done} finished. Start a lesson to go again"
        else:
            hint = "Start a lesson: requests keep arriving until Stop"
        if self.hint_label.text() != hint:
            self.hint_label.setText(hint)
