"""The screen the window shows while it has no engine: the model loading, phase by phase.

A first start used to sit 20-30 s behind a bouncing bar and a promise of "a few seconds". This
screen says which phase runs (`ui.loader.PHASES`: writing a synthetic model's file, loading the
weights, measuring each backend's speed), with a bar that fills where the length is known (the
weights' fraction, the measurement's steps), the time so far and, once a phase is a tenth done, a
rough time left from its own pace. Nothing invites a second load meanwhile: the buttons are
disabled until the load ends. Without a load it offers Load a model… and Get a model….

`ui.model.load_times.LoadTimes` is the arithmetic (Qt-free, tested alone); `LoadScreen` the widget, driven by the
window from `ui.loader.ModelLoader`'s signals. Main thread only.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWidget

from ..loader import OPTIONAL_PHASES, PHASES
from ..model.load_times import LoadTimes, fmt_duration
from ..theme import HEALTHY, MUTED, WORKING


class LoadScreen(QWidget):
    """The window's centre while no engine is shown. `load_requested` / `get_requested`: the
    user asked to load a model / to get one from the Hub."""

    load_requested = Signal()
    get_requested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        lay = QVBoxLayout(self)
        lay.addStretch(1)
        self.label = QLabel("No model loaded.")
        self.label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.label.setObjectName("big")
        self.label.setWordWrap(True)
        self.phases_label = QLabel()
        self.phases_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.phases_label.setTextFormat(Qt.TextFormat.RichText)
        self.detail_label = QLabel()
        self.detail_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.detail_label.setWordWrap(True)
        self.progress = QProgressBar()
        self.progress.setFixedWidth(460)
        self.progress.setRange(0, 100)
        self.time_label = QLabel()
        self.time_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.time_label.setObjectName("muted")
        self.note_label = QLabel()
        self.note_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.note_label.setObjectName("muted")
        self.note_label.setWordWrap(True)
        self.load_button = QPushButton("Load a model…")
        self.load_button.setObjectName("primary")
        self.load_button.clicked.connect(self.load_requested)
        self.get_button = QPushButton("Get a model…")
        self.get_button.setToolTip("Search the Hugging Face Hub for GGUF models and download one")
        self.get_button.clicked.connect(self.get_requested)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.load_button)
        buttons.addWidget(self.get_button)
        buttons.addStretch(1)
        for w in (self.label, self.phases_label, self.detail_label):
            lay.addWidget(w)
        lay.addWidget(self.progress, 0, Qt.AlignmentFlag.AlignHCenter)
        lay.addWidget(self.time_label)
        lay.addWidget(self.note_label)
        lay.addLayout(buttons)
        lay.addStretch(2)
        self.times: LoadTimes | None = None
        self.phase = ""
        self._seen: list[str] = []
        self._timer = QTimer(self)
        self._timer.setInterval(250)
        self._timer.timeout.connect(self._show_time)
        self._set_loading(False)

    @property
    def loading(self) -> bool:
        return self.times is not None

    def start(self, what: str) -> None:
        """A load of `what` began."""
        self.times = LoadTimes()
        self.phase = ""
        self._seen = []
        self.label.setText(f"Loading {what}…")
        self.detail_label.setText("Reading the model file…")
        self.progress.setRange(0, 100)
        self.progress.setValue(0)
        self.note_label.setText("The first start of a model measures each backend's speed once "
                                "(stored for the next start); later starts skip that phase.")
        self._set_loading(True)
        self._show_phases()
        self._show_time()
        self._timer.start()

    def on_phase(self, key: str) -> None:
        if self.times is None:
            return
        self.phase = key
        if key not in self._seen:
            self._seen.append(key)
        self.times.new_phase()
        self.progress.setRange(0, 100)
        self.progress.setValue(0)
        self.detail_label.setText({"unpacking": "Writing the model file…", "loading": "Loading the weights…",
                                   "measuring": "Measuring the speed…"}.get(key, ""))
        self._show_phases()

    def on_progress(self, fraction: float) -> None:
        if self.times is None:
            return
        self.times.fraction = max(0.0, min(1.0, fraction))
        self.progress.setValue(round(self.times.fraction * 100))

    def on_status(self, text: str) -> None:
        if self.times is not None:
            self.detail_label.setText(text[:1].upper() + text[1:] + "…")

    def on_step(self, done: int, total: int, what: str) -> None:
        if self.times is not None:
            name, _, step = what.partition(": ")
            self.detail_label.setText(f"Measuring {name}'s speed: {step} (step {done} of {total})")

    def finish(self, message: str | None = None) -> None:
        """The load ended: `message` says why it failed (None: it worked)."""
        self.times = None
        self._timer.stop()
        self._set_loading(False)
        self.phases_label.setText("")
        self.time_label.setText("")
        self.note_label.setText("")
        self.detail_label.setText("")
        if message is not None:
            self.label.setText(message)

    # ---- helpers ----

    def _set_loading(self, loading: bool) -> None:
        for w in (self.phases_label, self.detail_label, self.progress, self.time_label, self.note_label):
            w.setVisible(loading)
        for b in (self.load_button, self.get_button):
            b.setEnabled(not loading)

    def _show_phases(self) -> None:
        """Each phase seen so far (done ✓, in progress ●), then those still to come."""
        keys = [k for k in PHASES if k in self._seen or k not in OPTIONAL_PHASES]
        parts = []
        for i, k in enumerate(keys, 1):
            name = PHASES[k] + (" (first start)" if k == "measuring" else "")
            if k == self.phase:
                parts.append(f"<b style='color:{WORKING}'>● {i}. {name}</b>")
            elif k in self._seen:
                parts.append(f"<span style='color:{HEALTHY}'>✓ {i}. {name}</span>")
            else:
                parts.append(f"<span style='color:{MUTED}'>{i}. {name}</span>")
        self.phases_label.setText("  →  ".join(parts))

    def _show_time(self) -> None:
        if self.times is None:
            return
        text = f"{fmt_duration(self.times.elapsed())} so far"
        left = self.times.left()
        if left is not None:
            text += f" · about {fmt_duration(left)} left in this phase"
        self.time_label.setText(text)
