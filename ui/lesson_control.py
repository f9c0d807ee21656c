"""Lessons in the main window: Run ▸ Start a lesson, the lesson bar, and a lesson after a load.

`LessonControl` belongs to a `ui.main_window.MainWindow`. When the window's panels are built it
puts a `ui.lesson_bar.LessonBar` in a tool bar over the window (hidden until a lesson starts);
`start()` clears the routing table and the latency plots of what came before (a chat's requests
are not the lesson's rows), starts a `ui.lesson.LessonRun`, shows it in the views' phase strips
and the Experiments' Pause/Step row, and brings the Monitor forward at the routing view.

A lesson wants two backends to choose between. With one, Start a lesson offers to load the model
again on `engine.lesson.lesson_specs` (two CPU contexts on a CPU-only machine); a load asked for
with `ModelSpec(lesson=True)` (that, or `tandem gui --lesson`) warms the lesson's prefix while the
model loads (`ui.loader`) and starts the lesson as soon as the window has the engine.

Thread contract: main thread only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QMainWindow, QMessageBox, QToolBar

from engine.lesson import LessonMix, lesson_specs

from .lesson import LessonResult, LessonRun
from .lesson_bar import LessonBar
from .loader import ModelSpec

if TYPE_CHECKING:
    from engine.engine import Engine

    from .bridge import EngineBridge


class LessonHost(Protocol):
    """What a lesson needs of the window it runs in (`ui.main_window.MainWindow`)."""

    engine: Engine | None
    bridge: EngineBridge | None
    spec: ModelSpec | None
    panels: dict

    def watch(self) -> None: ...
    def show_panel(self, key: str) -> None: ...
    def load_model(self, spec: ModelSpec) -> bool: ...


class LessonControl(QObject):
    started = Signal(object)  # LessonRun
    status_message = Signal(str)

    def __init__(self, window: QMainWindow, gpu: bool | None) -> None:
        """`window`: a QMainWindow that is also a `LessonHost`."""
        super().__init__(window)
        self.window = window
        self.gpu = bool(gpu)
        self.run: LessonRun | None = None
        self.bar: LessonBar | None = None
        self.mix: LessonMix | None = None  # None: the engine's default mix
        self.toolbar = QToolBar("Lesson", window)
        self.toolbar.setObjectName("toolbar-lesson")
        self.toolbar.setMovable(False)
        self.toolbar.setVisible(False)
        window.addToolBar(Qt.ToolBarArea.TopToolBarArea, self.toolbar)
        self.start_action = QAction("Start a &lesson", self, shortcut=QKeySequence("Ctrl+L"),  # type: ignore[call-overload]
                                    triggered=self.start_from_menu)
        self.start_action.setToolTip("Requests that keep arriving until Stop, at a rate you set: change a "
                                     "ceiling or the policy and watch the next rows")
        self.stop_action = QAction("Stop the lesson", self, triggered=self.stop)  # type: ignore[call-overload]
        self.faster_action = QAction("Lesson: more arrivals a second", self, shortcut=QKeySequence("Ctrl+="),  # type: ignore[call-overload]
                                     triggered=lambda: self._rate(up=True))
        self.slower_action = QAction("Lesson: fewer arrivals a second", self, shortcut=QKeySequence("Ctrl+-"),  # type: ignore[call-overload]
                                     triggered=lambda: self._rate(up=False))

    def actions(self) -> list[QAction]:
        return [self.start_action, self.stop_action, self.faster_action, self.slower_action]

    # ---- panels come and go with the engine ----

    def build(self, engine: Engine, bridge: EngineBridge) -> None:
        self.bar = LessonBar(engine, bridge)
        self.bar.start_requested.connect(self.start_from_menu)
        self.bar.stop_requested.connect(self.stop)
        self.bar.status_message.connect(self.status_message)
        self.toolbar.addWidget(self.bar)

    def teardown(self) -> None:
        self.stop()
        self.toolbar.clear()
        self.toolbar.setVisible(False)
        if self.bar is not None:
            self.bar.deleteLater()
            self.bar = None
        self.run = None

    # ---- lessons ----

    @property
    def running(self) -> bool:
        return self.run is not None and self.run.running

    def start(self, rate: float | None = None) -> LessonRun | None:
        """Start a lesson on the window's engine (`rate`: arrivals a second; None: what the
        backends' measured rates suggest); None if there is no engine or a lesson runs already."""
        w: LessonHost = self.window  # type: ignore[assignment]
        engine, bridge = w.engine, w.bridge
        if engine is None or bridge is None or self.bar is None or self.running:
            return None
        panels = w.panels
        for key in ("routing", "latency"):  # the lesson's rows and plots, not what came before
            panel = panels.get(key)
            if panel is not None:
                panel.clear()
        run = LessonRun(engine, bridge, self.mix, rate, parent=self)
        run.done.connect(self._on_done)
        self.run = run
        for key in ("experiments", "routing", "latency"):
            panel = panels.get(key)
            if panel is not None and hasattr(panel, "show_run"):
                panel.show_run(run)
        self.bar.attach(run)
        self.toolbar.setVisible(True)
        w.watch()
        w.show_panel("routing")
        self.started.emit(run)  # before the first arrival, which start() sends at once
        run.start()
        return run

    def stop(self) -> None:
        if self.running and self.run is not None:
            self.run.stop()

    def start_from_menu(self) -> None:
        """Run ▸ Start a lesson: at once where there are backends to choose between; with one,
        offer to load the model again on two."""
        w: LessonHost = self.window  # type: ignore[assignment]
        engine = w.engine
        if engine is None:
            self.status_message.emit("load a model first (File ▸ Load model)")
            return
        if self.running:
            self.status_message.emit("a lesson is running: Stop it first")
            return
        if len(engine.backend_names) >= 2:
            self.start()
            return
        spec = w.spec or ModelSpec()
        specs = lesson_specs(self.gpu)
        answer = QMessageBox.question(
            self.window, "Start a lesson",
            f"A lesson needs two backends to choose between; {engine.backend_names[0]} is the only one.\n\n"
            f"Load {spec.model} again on {' and '.join(specs)}? The chats stay.")
        if answer == QMessageBox.StandardButton.Yes:
            w.load_model(replace(spec, backends=tuple(specs), lesson=True))

    def on_loaded(self, spec: ModelSpec | None) -> None:
        """The window has the engine of a load: a lesson load starts its lesson."""
        if spec is not None and spec.lesson:
            self.start()

    def _rate(self, up: bool) -> None:
        if self.bar is None or self.bar.change_rate(up) is None:
            self.status_message.emit("no lesson running (Run ▸ Start a lesson)")

    def _on_done(self, result: LessonResult) -> None:
        s = result.summary().metrics
        self.status_message.emit(f"lesson stopped: {len(result.request_ids)} requests sent, {s.completed} finished "
                                 f"(TTFT p50 {s.ttft_p50_s:.2f} s), the rest cancelled")
