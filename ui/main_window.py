"""The main window: the chat first, the live panels in a Monitor drawer, the engine's state in the status bar.

The window can start without an engine (while the model loads, or after a failed load); panels
are built when an engine arrives (`set_engine`) and rebuilt when another model is loaded, each
taking the engine and the bridge in its constructor. A failed load shows an error dialog and
leaves the current engine serving.

With a `serve_fn` the Server menu runs the OpenAI-compatible server in this process, on the
window's asyncio loop (`ui.server_control`): its requests go to the shown engine and appear in the
views live; the status bar shows its address or why it is not serving. Loading another model
moves the server to the new engine; closing the window stops the server first.

The window fills the screen it opens on. The chat is the central widget, so the transcript gets
most of the height at any size. Backends, Controls, Routing, Latency, Teaching and Experiments are
tabs of one dock, the Monitor drawer: View ▸ Monitor (F9) opens and closes it, its edge resizes
it, and it can sit at the right or at the bottom (View ▸ Monitor at the right / at the bottom, or
dragged by its title; floated on another screen). The switch at the menu bar's right
(`ui.focus`: Focus chat, Both, Focus monitor; Ctrl+1/2/3) gives the height to the chat, to both,
or to the Monitor alone. The drawer's default follows the screen (`compact_layout`): on a short or
narrow one (a 1280x720 or 1366x768 laptop, a 1280x1024 screen) it opens at the bottom, full
width, and starts closed; on a larger one it starts open at the right, beside the chat. A demo or
a lesson opens it (Focus monitor on a short screen). Whatever the user chooses is kept
(`QSettings`). A lesson (Run ▸ Start a lesson, `ui.lesson_control`) puts its bar over the window.

Settings persist in `QSettings` (the `settings=` argument; the app's default store otherwise):
window geometry, dock layout (one per layout), the chat's sampling settings and the last model
loaded, and the theme (View ▸ Theme: dark, light, or the system's, followed live; `ui.theme`).
Ctrl+/ lists the keyboard shortcuts.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from PySide6.QtCore import QSettings, QSize, Qt, Signal
from PySide6.QtGui import QAction, QActionGroup, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QDockWidget,
    QFileDialog,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QStackedWidget,
    QTabWidget,
    QWidget,
)

from engine.core.snapshot import BackendSnapshot

from .bridge import EngineBridge
from .chat import ChatPanel
from .dialogs.get_model import GetModelDialog
from .dialogs.load_model import ModelDialog
from .focus import FocusSwitch
from .lesson import LessonRun
from .lesson_control import LessonControl
from .live_run import STUDY, WorkloadRun, WorkloadSpec, seed_workload
from .loader import PHASES, ModelLoader, ModelSpec
from .loop_probe import LoopProbe
from .model.advice import advise
from .model.formatting import live_cap_text, model_title
from .model.history import ChatStore
from .model.local_models import remember
from .panels.backends import BackendsPanel
from .panels.controls import ControlsPanel
from .panels.experiments import ExperimentsPanel
from .panels.first_start import LoadScreen
from .panels.latency import LatencyView
from .panels.presenter import present
from .panels.routing import RoutingView
from .panels.teaching import TeachingPanel
from .server_control import ServerControl, ServerDialog, ServerOptions
from .theme import CHOICES, FAILED, Theme, configure_pyqtgraph, scrollable
from .worker import Worker

if TYPE_CHECKING:
    from engine.engine import Engine

log = logging.getLogger(__name__)
P = TypeVar("P", bound=QWidget)

# Under this width the Monitor drawer beside the chat would squeeze one or the other (the chat's
# rows need ~650 px, two backend cards side by side ~700), so the drawer opens at the bottom.
WIDE_MIN_WIDTH = 1400
MONITOR_SHARE = 0.42  # of the window's width, at the right, when it first opens


def compact_layout(available: QSize) -> bool:
    """Whether a screen with this much room gets the compact layout (the Monitor drawer at the
    bottom and closed at first): short (under 900 px, a 1280x720 or 1366x768 laptop) or too narrow
    for the chat and the monitor side by side (a 1280x1024 one)."""
    return available.height() < 900 or available.width() < WIDE_MIN_WIDTH


class MainWindow(QMainWindow):
    engine_loaded = Signal(object)  # Engine
    load_failed = Signal(str)

    def __init__(self, engine=None, *, load_fn=None, store: ChatStore | None = None, owns_engine: bool = True,
                 gpu_offload: bool | None = None, recalibrate=None, bench_runner_factory=None, serve_fn=None,
                 hz: int = 15, compact: bool | None = None, settings: QSettings | None = None,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.settings = settings if settings is not None else QSettings()
        self._layout_restored = False
        self.theme = Theme(self, self.settings, self)
        self.theme.apply()
        self.theme.changed.connect(self._on_theme_changed)
        configure_pyqtgraph()
        self.engine: Engine | None = None
        self.spec: ModelSpec | None = None
        self.bridge: EngineBridge | None = None
        self.store = store or ChatStore()
        self.gpu_offload = gpu_offload
        self._owns_engine = owns_engine
        self._recalibrate = recalibrate  # fn(engine, progress) -> None, blocking (run on a worker thread)
        self._bench_runner_factory = bench_runner_factory  # fn(engine) -> ExperimentsPanel's bench_runner
        self._hz = hz
        self._tab_of: dict[QWidget, QWidget] = {}  # a monitored panel -> its tab in the Monitor drawer
        self.panels: dict[str, QWidget] = {}
        self.demo: WorkloadRun | None = None
        self.lessons = LessonControl(self, gpu_offload)
        self.lessons.status_message.connect(self.show_message)
        # serve_fn(engine, host, port, api_key) -> (runner, url), a coroutine (app.gui.serve)
        self.server = ServerControl(serve_fn, self) if serve_fn is not None else None
        self.loader = ModelLoader(load_fn, self) if load_fn is not None else None
        if self.loader is not None:
            self.loader.progress.connect(self._on_load_progress)
            self.loader.status.connect(self._on_load_status)
            self.loader.phase.connect(self._on_load_phase)
            self.loader.step.connect(self._on_load_step)
            self.loader.loaded.connect(self._on_loaded)
            self.loader.failed.connect(self._on_load_failed)
        self.error_dialog = QMessageBox(QMessageBox.Icon.Critical, "Could not load the model", "", QMessageBox.StandardButton.Ok, self)
        self.probe = LoopProbe(parent=self)
        self.probe.start()

        self.setWindowTitle("Tandem")
        screen = QGuiApplication.primaryScreen()
        avail = screen.availableGeometry() if screen is not None else None
        self.compact = compact if compact is not None else (avail is not None and compact_layout(avail.size()))
        if avail is not None:  # the whole screen, as a maximised window would have it
            self.resize(avail.width(), avail.height())
            self.move(avail.topLeft())
        else:
            self.resize(1600, 1000)
        geometry = self.settings.value("window/geometry")
        if geometry is not None:
            self.restoreGeometry(geometry)
        self.setDockOptions(QMainWindow.DockOption.AnimatedDocks | QMainWindow.DockOption.AllowTabbedDocks | QMainWindow.DockOption.AllowNestedDocks)
        self._build_central()
        self._build_monitor()
        self._build_status()
        self._build_menus()
        if engine is not None:
            self.set_engine(engine, owns=owns_engine)

    # ---- layout ----

    def _build_central(self) -> None:
        self.stack = QStackedWidget()
        # No engine yet: the load's phases, or the ways to get one (ui.first_start).
        self.load_screen = LoadScreen()
        self.load_screen.load_requested.connect(self.choose_model)
        self.load_screen.get_requested.connect(self.get_model)
        self.placeholder_label = self.load_screen.label
        self.placeholder_progress = self.load_screen.progress
        self.stack.addWidget(self.load_screen)
        self.setCentralWidget(self.stack)

    def _build_monitor(self) -> None:
        """The Monitor drawer: one dock whose tabs are the live panels (filled by `_build_panels`)."""
        self.monitor_tabs = QTabWidget()
        self.monitor_tabs.setDocumentMode(True)
        self.monitor = QDockWidget("Monitor", self)
        self.monitor.setObjectName("dock-monitor")
        self.monitor.setWidget(self.monitor_tabs)
        self.monitor.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable | QDockWidget.DockWidgetFeature.DockWidgetFloatable
                                 | QDockWidget.DockWidgetFeature.DockWidgetClosable)
        self.monitor.setAllowedAreas(Qt.DockWidgetArea.RightDockWidgetArea | Qt.DockWidgetArea.BottomDockWidgetArea | Qt.DockWidgetArea.LeftDockWidgetArea)
        self.addDockWidget(Qt.DockWidgetArea.BottomDockWidgetArea if self.compact else Qt.DockWidgetArea.RightDockWidgetArea, self.monitor)
        self.monitor.setVisible(False)  # opened when there are panels to show (`_build_panels`)
        self._monitor_sized = False  # given its first size (or a saved one)
        self._monitor_defaulted = False  # opened or not as the screen suggests, once
        self.monitor.visibilityChanged.connect(self._on_monitor_shown)
        self.monitor_action = self.monitor.toggleViewAction()
        self.monitor_action.setText("&Monitor")
        self.monitor_action.setShortcut(QKeySequence("F9"))
        self.monitor_action.setToolTip("Open or close the Monitor: backends, controls, routing, latency, "
                                       "teaching, experiments (F9)")
        # Which of the chat and the Monitor gets the height: a switch at the menu bar's right.
        self.focus = FocusSwitch(self.stack, self.monitor, self._size_monitor, self)
        self.menuBar().setCornerWidget(self.focus.widget, Qt.Corner.TopRightCorner)

    def set_monitor_side(self, area) -> None:
        """Put the Monitor drawer at the right (`Qt.RightDockWidgetArea`) or at the bottom, open."""
        self.removeDockWidget(self.monitor)
        self.addDockWidget(area, self.monitor)
        self.monitor.show()
        self._size_monitor()

    def _on_monitor_shown(self, visible: bool) -> None:
        if visible and not self._monitor_sized:  # opened for the first time: its default size
            self._size_monitor()

    def _size_monitor(self) -> None:
        """The drawer's first size: at the right, a share of the width; at the bottom, half the
        height, and at least the 380 px that show the teaching table's 8 rows under the drawer's
        title and tabs."""
        if self.dockWidgetArea(self.monitor) == Qt.DockWidgetArea.BottomDockWidgetArea:
            h = self.height()
            self.resizeDocks([self.monitor], [max(380, min(h - 300, h // 2))], Qt.Orientation.Vertical)
        else:
            self.resizeDocks([self.monitor], [int(self.width() * MONITOR_SHARE)], Qt.Orientation.Horizontal)
        self._monitor_sized = True

    def _build_status(self) -> None:
        sb = self.statusBar()
        self.model_label = QLabel("no model")
        self.backends_label = QLabel("")
        self.model_label.setMaximumWidth(300)
        self.device_label = QLabel(self._device_text())
        if self.gpu_offload is False:  # the status bar is crowded: the why goes in the tooltip
            self.device_label.setToolTip("This llama.cpp build is CPU-only (llama_supports_gpu_offload() is false)")
        self.state_label = QLabel("idle")
        self.presenter = False
        self.lag_label = QLabel("")
        self.lag_label.setVisible(False)
        self.lag_label.setToolTip("How late the GUI event loop runs (p95 of a 10 ms timer over the last 30 s)")
        self.load_bar = QProgressBar()
        self.load_bar.setMaximumWidth(160)
        self.load_bar.setVisible(False)
        self.server_label = QLabel("server: off")
        self.server_label.setVisible(self.server is not None)
        self.server_label.setToolTip("The OpenAI-compatible server in this window (Server menu)")
        if self.server is not None:
            self.server.state_changed.connect(self._on_server_state)
        for w in (self.model_label, self.backends_label, self.device_label, self.state_label, self.server_label,
                  self.load_bar, self.lag_label):
            sb.addPermanentWidget(w)

    def _build_menus(self) -> None:
        # PySide6 connects signals given as keywords (triggered=, toggled=); its stubs do not know
        # them, hence the `call-overload` ignores on the QActions below.
        m = self.menuBar().addMenu("&File")
        self.load_action = QAction("&Load model…", self, shortcut=QKeySequence.StandardKey.Open, triggered=self.choose_model)  # type: ignore[call-overload]
        m.addAction(self.load_action)
        self.get_model_action = QAction("&Get model…", self, triggered=self.get_model)  # type: ignore[call-overload]
        self.get_model_action.setToolTip("Search the Hugging Face Hub for a GGUF model, download it and load it")
        m.addAction(self.get_model_action)
        self.new_chat_action = QAction("&New chat", self, shortcut=QKeySequence.StandardKey.New, triggered=self._new_chat)  # type: ignore[call-overload]
        m.addAction(self.new_chat_action)
        m.addAction(QAction("Save &screenshot…", self, triggered=self._ask_screenshot))  # type: ignore[call-overload]
        m.addSeparator()
        m.addAction(QAction("&Quit", self, shortcut=QKeySequence.StandardKey.Quit, triggered=self.close))  # type: ignore[call-overload]
        chat_menu = self.menuBar().addMenu("&Chat")
        self.regenerate_action = QAction("&Regenerate the last reply", self, shortcut=QKeySequence("Ctrl+R"),  # type: ignore[call-overload]
                                         triggered=lambda: self._chat_call("regenerate"))
        self.copy_reply_action = QAction("&Copy the last reply", self, shortcut=QKeySequence("Ctrl+Shift+C"),  # type: ignore[call-overload]
                                         triggered=lambda: self._chat_call("copy_reply"))
        self.search_action = QAction("&Search chats", self, shortcut=QKeySequence.StandardKey.Find, triggered=self.search_chats)  # type: ignore[call-overload]
        for a in (self.regenerate_action, self.copy_reply_action, self.search_action):
            chat_menu.addAction(a)
        self.view_menu = self.menuBar().addMenu("&View")
        theme_menu = self.view_menu.addMenu("&Theme")
        group = QActionGroup(self)
        self.theme_actions: dict[str, QAction] = {}
        for choice in CHOICES:
            label = {"system": "Follow the &system", "dark": "&Dark", "light": "&Light"}[choice]
            a = QAction(label, self, checkable=True, checked=choice == self.theme.choice)
            a.triggered.connect(lambda _=False, c=choice: self.set_theme(c))
            group.addAction(a)
            theme_menu.addAction(a)
            self.theme_actions[choice] = a
        # The teacher's view, and the figures a developer wants (the event loop's lateness).
        self.presenter_action = QAction("&Presenter view (large type)", self, shortcut=QKeySequence("F11"),  # type: ignore[call-overload]
                                        checkable=True, toggled=self.set_presenter)
        self.developer_action = QAction("&Developer figures (UI lag)", self, checkable=True,  # type: ignore[call-overload]
                                        checked=bool(self.settings.value("view/developer", False, type=bool)),
                                        toggled=self._set_developer)
        self.reset_counters_action = QAction("&Reset the counters", self, triggered=self.reset_counters)  # type: ignore[call-overload]
        self.reset_counters_action.setToolTip("Zero every backend's prefix hits, evictions and observed speeds")
        for a in (self.presenter_action, self.developer_action, self.reset_counters_action):
            self.view_menu.addAction(a)
        self.view_menu.addSeparator()
        for a in self.focus.actions.values():
            self.view_menu.addAction(a)
        self.view_menu.addAction(self.monitor_action)
        self.view_menu.addAction(QAction("Monitor at the &right", self,  # type: ignore[call-overload]
                                         triggered=lambda: self.set_monitor_side(Qt.DockWidgetArea.RightDockWidgetArea)))
        self.view_menu.addAction(QAction("Monitor at the &bottom", self,  # type: ignore[call-overload]
                                         triggered=lambda: self.set_monitor_side(Qt.DockWidgetArea.BottomDockWidgetArea)))
        self.view_menu.addSeparator()
        run = self.menuBar().addMenu("&Run")
        run.addAction(QAction("Send the study's 8 requests", self, triggered=lambda: self.start_demo(STUDY)))  # type: ignore[call-overload]
        run.addAction(QAction("Send 48 study requests", self,  # type: ignore[call-overload]
                              triggered=lambda: self.start_demo(seed_workload(48))))
        run.addAction(QAction("Stop the demo workload", self, triggered=self.stop_demo))  # type: ignore[call-overload]
        run.addSeparator()
        for a in self.lessons.actions():
            run.addAction(a)
        run.addSeparator()
        self.pause_action = QAction("&Pause or resume arrivals", self, shortcut=QKeySequence("F6"),  # type: ignore[call-overload]
                                    triggered=self.toggle_pause)
        self.step_action = QAction("S&tep: send the next arrival", self, shortcut=QKeySequence("F7"),  # type: ignore[call-overload]
                                   triggered=self.step_run)
        run.addAction(self.pause_action)
        run.addAction(self.step_action)
        self.start_server_action = QAction("&Start server…", self, triggered=self.choose_server)  # type: ignore[call-overload]
        self.stop_server_action = QAction("S&top server", self, triggered=self.stop_server)  # type: ignore[call-overload]
        if self.server is not None:
            server = self.menuBar().addMenu("&Server")
            server.addAction(self.start_server_action)
            server.addAction(self.stop_server_action)
        self._update_server_actions()
        help_menu = self.menuBar().addMenu("&Help")
        self.shortcuts_action = QAction("&Keyboard shortcuts", self, shortcut=QKeySequence("Ctrl+/"),  # type: ignore[call-overload]
                                        triggered=self.show_shortcuts)
        help_menu.addAction(self.shortcuts_action)
        help_menu.addAction(QAction("&About Tandem", self, triggered=self._about))  # type: ignore[call-overload]
        self.shortcuts_dialog = QMessageBox(QMessageBox.Icon.Information, "Keyboard shortcuts", "", QMessageBox.StandardButton.Close, self)

    # ---- engine ----

    def load_model(self, spec: ModelSpec) -> bool:
        """Load `spec` in the background; the current engine keeps serving until it is ready."""
        if self.loader is None:
            self._on_load_failed("this window was built without a model loader", spec)
            return False
        if not self.loader.start(spec):
            self.statusBar().showMessage("a model is already loading", 4000)
            return False
        self.state_label.setText(f"loading {spec.model}…")
        self.load_bar.setRange(0, 100)
        self.load_bar.setValue(0)
        self.load_bar.setVisible(True)
        self.load_screen.start(spec.describe())
        self._set_load_actions(False)
        return True

    def _set_load_actions(self, enabled: bool) -> None:
        """Nothing invites a second load while one runs."""
        for a in (self.load_action, self.get_model_action):
            a.setEnabled(enabled)
            a.setStatusTip("" if enabled else "a model is loading")

    def choose_model(self) -> None:
        dialog = self.model_dialog()
        if dialog.exec() == ModelDialog.DialogCode.Accepted:
            self.load_model(dialog.spec())

    def model_dialog(self, folders=None) -> ModelDialog:
        """The model picker, with the recent models and (scanned in the background) local ones."""
        last = self.settings.value("model/last")
        return ModelDialog(self.spec or (ModelSpec(str(last)) if last else None), self,
                           recent=self.recent_models(), folders=folders)

    def recent_models(self) -> list[str]:
        """Model specs loaded before, newest first (QSettings `model/recent`)."""
        value = self.settings.value("model/recent") or []
        return [str(v) for v in ([value] if isinstance(value, str) else value)]

    def set_engine(self, engine, spec: ModelSpec | None = None, owns: bool = True) -> None:
        """Show `engine` (replacing and, if owned, closing the previous one)."""
        old, old_owned = self.engine, self._owns_engine
        self._teardown_panels()
        if old is not None and old_owned and old is not engine:
            Worker(old.close, name="engine-close").start()
        self.engine = engine
        self.spec = spec
        self._owns_engine = owns
        self._build_panels()
        if self.server is not None and old is not engine:
            self.server.restart(engine)  # a no-op while the server is off
        if engine.model is None:  # a router in front of remote engines: no model here
            title = ", ".join(engine.model_ids()) or "remote engines"
            self.setWindowTitle(f"Tandem — {title}")
            self.model_label.setText(self.model_label.fontMetrics().elidedText(
                f"{title} · {len(engine.backend_names)} remote engines", Qt.TextElideMode.ElideMiddle, 300 - 20))  # the style sheet pads it 8 px a side
            self.model_label.setToolTip("\n".join(f"{s.name}: {s.url} ({s.model})" for s in engine.snapshot()))
        else:
            self._show_model(engine)
        self.state_label.setText("engine ready")
        self.state_label.setToolTip("")
        self.engine_loaded.emit(engine)

    def _show_model(self, engine) -> None:
        info = engine.model.info
        synthetic = " (synthetic)" if getattr(engine.model, "synthetic", False) else ""
        title = model_title(info)
        self.setWindowTitle(f"Tandem — {title}")
        text = f"{title}{synthetic} · {_params(info.n_params)}"
        self.model_label.setText(self.model_label.fontMetrics().elidedText(text, Qt.TextElideMode.ElideMiddle, 300 - 20))  # the style sheet pads it 8 px a side
        self.model_label.setToolTip(f"{info.path}\nGGUF general.name: {info.name}"
                                    + ("\nSynthetic: random weights, the text is noise" if synthetic else ""))

    def _build_panels(self) -> None:
        engine = self.engine
        if engine is None:
            raise RuntimeError("the panels show an engine: set_engine gives one first")
        self.bridge = EngineBridge(engine, self._hz, self)
        self.bridge.tick.connect(self._on_tick)
        chat = ChatPanel(engine, self.store)
        backends = BackendsPanel(engine, self.bridge, warm_tokens=self._system_prefix_tokens)
        controls = ControlsPanel(engine, self.bridge, recalibrate=self._recalibrate)
        routing = RoutingView(engine, self.bridge)
        latency = LatencyView(engine, self.bridge)
        teaching = TeachingPanel(engine, self.bridge)
        runner = self._bench_runner_factory(engine) if self._bench_runner_factory else None
        experiments = ExperimentsPanel(engine, self.bridge, bench_runner=runner)
        self.panels = {"chat": chat, "backends": backends, "controls": controls, "routing": routing,
                       "latency": latency, "teaching": teaching, "experiments": experiments}
        for p in self.panels.values():
            if hasattr(p, "status_message"):
                p.status_message.connect(self.show_message)
        self.stack.addWidget(chat)
        self.stack.setCurrentWidget(chat)
        self.lessons.build(engine, self.bridge)

        for title, key in (("Backends", "backends"), ("Controls", "controls"), ("Routing", "routing"),
                           ("Latency", "latency"), ("Teaching", "teaching"), ("Experiments", "experiments")):
            panel = self.panels[key]
            # A panel wider than the drawer scrolls inside it rather than widening it past the chat.
            tab = scrollable(panel) if key in ("controls", "teaching", "experiments") else panel
            self._tab_of[panel] = tab
            self.monitor_tabs.addTab(tab, title)
        if not self._layout_restored and not self._monitor_defaulted:  # the first panels: the default
            self._monitor_defaulted = True  # (a saved layout, below, replaces it)
            self.monitor.setVisible(not self.compact)
            if not self.compact:
                self._size_monitor()
        chat.load_settings(self.settings)
        self.theme.apply()  # the new panels' plots in the palette in use
        state = self.settings.value(self._state_key())
        if state is not None and not self._layout_restored:
            self._layout_restored = self._monitor_sized = self.restoreState(state)

    def _state_key(self) -> str:
        # -v2: the Monitor drawer; a layout saved with one dock per panel is not restored into it
        return "window/state-v2-compact" if self.compact else "window/state-v2"

    def save_settings(self) -> None:
        """Window geometry, dock layout, sampling settings, last model (on close; idempotent)."""
        self.settings.setValue("window/geometry", self.saveGeometry())
        if self.panels:
            self.settings.setValue(self._state_key(), self.saveState())
            chat = self._panel("chat", ChatPanel)
            if chat is not None:
                chat.save_settings(self.settings)
        if self.spec is not None:
            self.settings.setValue("model/last", self.spec.model)
        self.settings.sync()

    def _on_theme_changed(self, _name: str) -> None:
        for panel in self.panels.values():  # views whose inline colours follow the palette
            restyle = getattr(panel, "restyle", None)
            if restyle is not None:
                restyle()

    def set_theme(self, choice: str) -> None:
        """"system", "dark" or "light": applied at once, plots included, and kept for the next start."""
        self.theme.set_choice(choice)
        self.theme_actions[choice].setChecked(True)
        self.settings.sync()

    def show_shortcuts(self) -> None:
        rows = [(a.shortcut().toString(QKeySequence.SequenceFormat.NativeText), a.text().replace("&", ""))
                for a in self.findChildren(QAction) if not a.shortcut().isEmpty()]
        rows += [("Enter", "Send the message"), ("Shift+Enter", "New line in the message"),
                 ("Esc", "Stop the reply being streamed")]
        seen, lines = set(), []
        for key, what in rows:
            if (key, what) not in seen:
                seen.add((key, what))
                lines.append(f"<tr><td><b>{key}</b>&nbsp;&nbsp;</td><td>{what}</td></tr>")
        self.shortcuts_dialog.setText(f"<table>{''.join(lines)}</table>")
        self.shortcuts_dialog.open()

    def show_message(self, message: str, ms: int = 8000) -> None:
        """A passing message in the status bar; the whole of it (and the last one) in its tooltip."""
        sb = self.statusBar()
        sb.showMessage(message, ms)
        sb.setToolTip(f"Last message: {message}")

    def dock_of(self, key: str) -> QDockWidget | None:
        """The dock that holds a panel (`panels[key]`): the Monitor drawer; None for the chat."""
        return self.monitor if self.panels.get(key) in self._tab_of else None

    def show_panel(self, key: str) -> None:
        """Open the Monitor drawer at a panel's tab."""
        panel = self.panels.get(key)
        tab = self._tab_of.get(panel) if panel is not None else None
        if tab is not None:
            self.monitor.show()
            self.monitor.raise_()
            self.monitor_tabs.setCurrentWidget(tab)

    def _panel(self, key: str, kind: type[P]) -> P | None:
        """The panel under `key`, if the window has one of that kind."""
        panel = self.panels.get(key)
        return panel if isinstance(panel, kind) else None

    def _teardown_panels(self) -> None:
        self.stop_demo()
        self.lessons.teardown()
        for panel in (self._panel("experiments", ExperimentsPanel), self._panel("teaching", TeachingPanel)):
            if panel is not None:
                panel.stop()
        chat = self._panel("chat", ChatPanel)
        if chat is not None:
            chat.shutdown()
            self.stack.removeWidget(chat)
            chat.deleteLater()
        while self.monitor_tabs.count():
            tab = self.monitor_tabs.widget(0)
            self.monitor_tabs.removeTab(0)
            if tab is not None:
                tab.deleteLater()
        self._tab_of = {}
        self.panels = {}
        if self.bridge is not None:
            self.bridge.close()
            self.bridge.deleteLater()
            self.bridge = None

    def _system_prefix_tokens(self):
        """Tokens of the chat's system prompt as the template renders it (what Warm fills)."""
        chat = self.panels.get("chat")
        if chat is None or self.engine is None or self.engine.model is None or not chat.chat.system.strip():
            return None
        return self.engine.chat_tokens([{"role": "system", "content": chat.chat.system}])

    # ---- loader signals ----

    def _on_load_progress(self, fraction: float) -> None:
        self.load_bar.setRange(0, 100)
        self.load_bar.setValue(int(fraction * 100))
        self.load_screen.on_progress(fraction)

    def _on_load_phase(self, key: str) -> None:
        """A phase of the load began (ui.loader.PHASES): the bars start again from 0."""
        self.load_bar.setValue(0)
        self.load_bar.setToolTip(PHASES.get(key, key))
        self.load_screen.on_phase(key)

    def _on_load_status(self, text: str) -> None:
        """The weights are in and the engine measures something (a backend's speed on a first
        start): say what; its steps (`_on_load_step`) fill the bars."""
        self.state_label.setText(text.split(" (", 1)[0] + "…")
        self.state_label.setToolTip(text)
        self.load_screen.on_status(text)

    def _on_load_step(self, done: int, total: int, what: str) -> None:
        self.load_bar.setToolTip(f"Measuring the speed: step {done} of {total} ({what})")
        self.load_screen.on_step(done, total, what)

    def _on_loaded(self, engine, spec) -> None:
        if spec.model:
            self.settings.setValue("model/recent", remember(self.recent_models(), spec.model))
        self.load_bar.setVisible(False)
        self.load_screen.finish()
        self._set_load_actions(True)
        self.set_engine(engine, spec, owns=True)
        self.statusBar().showMessage(f"loaded {spec.describe()}", 5000)
        self.lessons.on_loaded(spec)

    def _on_load_failed(self, message: str, spec) -> None:
        self.load_bar.setVisible(False)
        self._set_load_actions(True)
        what = spec.describe() if spec is not None else "the model"
        advice = advise(message, "load")  # plain words; the raw error in the dialog's details
        self.error_dialog.setDetailedText(advice.detail if advice.detail != advice.text else "")
        self.load_screen.finish(f"Could not load {what}:\n{advice.text}" if self.engine is None else None)
        if self.engine is None:
            self.state_label.setText("no model")
        else:
            self.state_label.setText("engine ready (last load failed)")
        self.error_dialog.setText(f"Could not load {what}.")
        self.error_dialog.setInformativeText(advice.text)
        self.error_dialog.open()  # window-modal, does not block the event loop
        self.load_failed.emit(message)

    # ---- per tick ----

    def _on_tick(self, tick) -> None:
        parts = []
        tips = []
        for s in tick.snapshots:
            dot = "●" if s.healthy else "✖"
            parts.append(f"{dot} {s.name} {len(s.running)}/{s.cap} +{len(s.waiting)}")
            tips.append(f"{s.name}: {len(s.running)} running, {live_cap_text(s)}; {len(s.waiting)} waiting"
                        + ("" if s.healthy else "; down"))
        text = "  ".join(parts)
        if self.backends_label.text() != text:
            self.backends_label.setText(text)
            self.backends_label.setToolTip("\n".join(tips))
        p95 = self.probe.percentile(95)
        if p95 == p95:  # a developer's figure when asked for; else "machine busy", only while the lag lasts
            developer = self.developer_action.isChecked()
            self.lag_label.setText(f"UI lag p95 {p95 * 1000:.0f} ms" if developer else "machine busy")
            self.lag_label.setToolTip(self.probe.lag_text())
            self.lag_label.setVisible(developer or self.probe.lasting_lag())
        busy = any(s.items for s in tick.snapshots)
        lesson = self.lessons.run
        if lesson is not None and lesson.running:
            self.state_label.setText(f"lesson: {lesson.n_submitted} sent, {lesson.n_done} done")
        elif self.demo is not None and self.demo.running:
            d = self.demo
            self.state_label.setText("demo: warming the prefix" if d.state in ("flushing", "warming") else
                                     f"demo: {len(d.result.records)}/{d.spec.n_requests} done")
        elif not self.load_bar.isVisible():
            self.state_label.setText("engine busy" if busy else "engine idle")

    def _device_text(self) -> str:
        if self.gpu_offload is None:
            return ""
        return "GPU offload: yes" if self.gpu_offload else "GPU offload: no"

    # ---- demo workload ----

    def start_demo(self, spec: WorkloadSpec = STUDY) -> WorkloadRun | None:
        if self.engine is None or self.bridge is None or (self.demo is not None and self.demo.running):
            return None
        self.demo = WorkloadRun(self.engine, self.bridge, spec, label="demo", parent=self, reuse_warm=True)
        self.demo.done.connect(self._on_demo_done)
        routing = self._panel("routing", RoutingView)
        if routing is not None:  # the demo's rows, numbered from #1, not a chat's from before
            routing.clear()
        for key in ("experiments", "routing", "latency"):  # the Pause/Step row, the phase strips
            panel = self.panels.get(key)
            if panel is not None and hasattr(panel, "show_run"):
                panel.show_run(self.demo)
        self.watch()  # a demo is there to be watched
        self.demo.start()
        return self.demo

    def watch(self) -> None:
        """A run started: open the Monitor, on a short screen with the whole height (Focus monitor)."""
        if self.compact:
            self.focus.set_mode("monitor")
        elif self.focus.mode == "chat":
            self.focus.set_mode("both")

    def _on_demo_done(self, result) -> None:
        """A demo run is an experiment like any other: its row goes to the Experiments table."""
        if result.records:
            summary = result.summary()
            experiments = self._panel("experiments", ExperimentsPanel)
            if experiments is not None:
                experiments.add_summary(summary)
            self.show_message(f"demo {summary.metrics.completed}/{result.spec.n_requests} requests in "
                              f"{summary.metrics.makespan_s:.1f} s"
                              " (a row in Experiments)" + (f" — {result.error}" if result.error else ""))
        else:
            self.show_message(f"demo failed: {result.error or 'no request finished'}")

    def live_run(self) -> WorkloadRun | LessonRun | None:
        """The live run in progress (a lesson, a demo, an experiment, the teaching run), if any."""
        runs = [self.lessons.run, self.demo, getattr(self.panels.get("experiments"), "_run", None),
                getattr(self.panels.get("teaching"), "run", None)]
        return next((r for r in runs if isinstance(r, WorkloadRun | LessonRun) and r.running), None)

    def toggle_pause(self) -> bool:
        """Pause the live run's arrivals, or resume them; False if no live run."""
        run = self.live_run()
        if run is None:
            self.show_message("no live run to pause (Run ▸ Start a lesson starts one)", 4000)
            return False
        done = run.resume() if run.paused else run.pause()
        self.show_message(f"{run.label}: arrivals " + ("paused" if run.paused else "resumed"), 4000)
        return done

    def step_run(self) -> bool:
        """Send the live run's next arrival now (the run stays paused)."""
        run = self.live_run()
        if run is None or not run.step():
            if run is None:
                why = "no live run (Run ▸ Start a lesson starts one)"
            elif run.state in ("flushing", "warming"):
                why = f"{run.label} is warming the shared prefix; arrivals start after it"
            else:
                why = f"no arrival left to send ({run.label}: {run.state})"
            self.show_message(why, 5000)
            return False
        total = "" if run.n_requests is None else f"/{run.n_requests}"
        self.show_message(f"{run.label}: sent {run.n_submitted}{total}, paused (F6 resumes)", 5000)
        return True

    def stop_demo(self) -> None:
        if self.demo is not None and self.demo.running:
            self.demo.stop()

    # ---- in-process server ----

    def choose_server(self) -> None:
        if self.server is None:
            return
        dialog = ServerDialog(self.server.options, self)
        if dialog.exec() == ServerDialog.DialogCode.Accepted:
            self.start_server(dialog.options())

    def start_server(self, options: ServerOptions | None = None):
        """Serve the shown engine (a task on the running loop), or None if it cannot start."""
        if self.server is None:
            return None
        if self.engine is None:
            self.statusBar().showMessage("load a model before starting the server", 5000)
            return None
        return self.server.start(self.engine, options or ServerOptions())

    def stop_server(self):
        return self.server.stop() if self.server is not None else None

    def _on_server_state(self, text: str) -> None:
        if self.server is None:
            raise RuntimeError("a server state arrived at a window that has no server")
        failed = self.server.state == "failed"
        self.server_label.setText(text)
        self.server_label.setStyleSheet(f"color:{FAILED}" if failed else "")
        detail = self.server.detail()
        if self.server.state == "on":
            detail += "; its requests show up in the routing and latency views"
        self.server_label.setToolTip(detail[:1].upper() + detail[1:])
        self._update_server_actions()

    def _update_server_actions(self) -> None:
        on = self.server is not None and self.server.state in ("on", "starting")
        self.start_server_action.setEnabled(self.server is not None and self.server.state in ("off", "failed"))
        self.stop_server_action.setEnabled(on)

    # ---- presenter view, developer figures, counters, getting a model ----

    def set_presenter(self, on: bool) -> None:
        """Large type on the routing explanation, Teaching and the latency plots (`ui.presenter`),
        full screen, the routing view in front; off: as before."""
        if self.presenter_action.isChecked() != on:
            self.presenter_action.setChecked(on)  # toggled calls back here
            return
        self.presenter = on
        for key, panel in self.panels.items():  # every Monitor tab
            if key != "chat":
                present(panel, on)
        if on:  # the Monitor takes the whole screen; the chat comes back after
            self.stack.setVisible(False)
            self.focus.bare_monitor(True)
            self.monitor.show()
        else:
            self.focus.apply()
        if on:
            self._normal_geometry = self.saveGeometry()
            self.showFullScreen()
            self.show_panel("routing")
        else:
            self.showNormal()
            if getattr(self, "_normal_geometry", None) is not None:
                self.restoreGeometry(self._normal_geometry)
        self.show_message("presenter view: large type on every Monitor tab (F11 leaves it)" if on
                          else "presenter view off", 4000)

    def _set_developer(self, on: bool) -> None:
        self.settings.setValue("view/developer", on)
        self.lag_label.setVisible(on and bool(self.lag_label.text()))

    def reset_counters(self) -> None:
        """Zero the backends' counters (prefix hits, evictions, observed speeds) without waiting."""
        if self.engine is None:
            return
        Worker(self.engine.reset_stats, name="reset-counters", owner=self).start()
        self.show_message("counters reset: prefix hits, evictions and observed speeds start from zero", 4000)

    def get_model(self) -> None:
        """File ▸ Get model: search the Hub, download a GGUF into the models folder, load it."""
        if self.loader is not None and self.loader.busy:
            return
        dialog = self.get_model_dialog()
        if dialog.exec() == GetModelDialog.DialogCode.Accepted and dialog.downloaded is not None:
            self.load_model(ModelSpec(str(dialog.downloaded)))

    def get_model_dialog(self, **kw) -> GetModelDialog:
        """The Hub dialog, pricing a model against this machine (a GPU backend's memory, if any)."""
        snaps: list[BackendSnapshot] = self.engine.snapshot() if self.engine is not None else []
        vram = max((s.device_memory_total_bytes for s in snaps if s.device != "cpu"), default=0)
        n_ctx = max((s.kv_cells_total for s in snaps), default=0) or 4096  # a local pool, else a default
        return GetModelDialog(self, n_ctx=n_ctx, vram_total=vram, **kw)

    # ---- misc ----

    def save_screenshot(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.grab().save(str(path))
        return path

    def _ask_screenshot(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save screenshot", "tandem.png", "PNG image (*.png)")
        if path:
            self.save_screenshot(path)

    def _chat_call(self, method: str):
        chat = self.panels.get("chat")
        return getattr(chat, method)() if chat is not None else None

    def search_chats(self) -> None:
        """Put the cursor in the chat list's search box (Ctrl+F)."""
        chat = self._panel("chat", ChatPanel)
        if chat is not None:
            self.stack.setCurrentWidget(chat)
            chat.search_edit.setFocus(Qt.FocusReason.ShortcutFocusReason)
            chat.search_edit.selectAll()

    def _new_chat(self) -> None:
        chat = self._panel("chat", ChatPanel)
        if chat is not None:
            chat.new_chat()

    def _about(self) -> None:
        QMessageBox.about(self, "About Tandem",
                          "<b>Tandem</b><br>One local model on two backends at once, a router that sends each "
                          "request where its score is lowest, and a live view of why.")

    def shutdown(self) -> None:
        """Save the settings, stop timers, cancel the loader, close the engine if the window owns it.
        Idempotent."""
        if self.panels:
            self.save_settings()
        self.probe.stop()
        self.theme.disconnect_system()
        if self.server is not None:
            self.server.stop()  # finishes on the loop; `closeEvent` waits for it instead
        if self.loader is not None:
            self.loader.cancel()
        engine, owned = self.engine, self._owns_engine
        self._teardown_panels()
        self.engine = None
        if engine is not None and owned:
            engine.close()

    def closeEvent(self, event) -> None:
        if self.server is not None and (self.server.running or self.server.busy):
            # Stop serving before the engine goes away, then close for real.
            event.ignore()
            task = self.server.stop()
            if task is not None:
                task.add_done_callback(lambda _task: self.close())
            return
        self.shutdown()
        super().closeEvent(event)


def _params(n: int) -> str:
    """1.35e8 -> '135M params', 4.1e5 -> '410K params'."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B params"
    if n >= 1e6:
        return f"{n / 1e6:.0f}M params"
    return f"{n / 1e3:.0f}K params"
