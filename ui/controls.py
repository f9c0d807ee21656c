"""Controls: routing policy, decode-budget mode, per-backend rates, caps, cache.

Every control writes through the engine's thread-safe setters (`Router.set_policy`,
`Router.set_budget`, `Backend.set_rates`, `Backend.set_cap`, `Backend.flush`) and applies at
once; the next request is routed with it. Values the engine changes by itself (a cap set from
a backend card) are read back from the tick.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtGui import QFont, QFontMetrics
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.core.errors import EngineError
from engine.core.snapshot import Rates
from engine.routing import BUDGET_MODES, DEFAULT_POLICY, POLICIES
from engine.routing import HELP as POLICY_HELP  # one line per policy, beside each (engine/routing/)

from .formatting import CAP_HELP, cap_reason_detail, live_cap_text, policy_sentence
from .presenter import VALUE_PT
from .theme import backend_color, palette, wrap_label
from .worker import Worker

SPIN_WIDTH = 92  # px: a rate box at the app's type size
BUDGET_HELP = {
    "raw": "Every request counts its whole unused max_tokens budget (the study's rule).",
    "ratio": "Running requests' budget scaled by SGLang's new_token_ratio (starts 0.7, decays to 0.1).",
}


def policy_choices(engine) -> list[str]:
    """Policies that make sense for this engine's backends (device-only ones need the device)."""
    devices = {("cpu" if d == "cpu" else "gpu") for d in engine.devices.values()}
    out = []
    for name in POLICIES:
        if name == "gpu-only" and "gpu" not in devices:
            continue
        if name == "cpu-only" and "cpu" not in devices:
            continue
        out.append(name)
    out += [f"only:{b}" for b in engine.backend_names]
    return out


class ControlsPanel(QWidget):
    """`recalibrate(engine, progress)` (optional, blocking) measures and applies fresh rates; it runs
    on a worker thread and reports through `progress(text)`."""

    status_message = Signal(str)
    rates_changed = Signal()

    def __init__(self, engine, bridge, recalibrate=None, parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        self._recalibrate = recalibrate
        self._recal_worker: Worker | None = None
        self._initial_rates = {name: engine.rates(name) for name in engine.backend_names}
        self._build()
        bridge.tick.connect(self._on_tick)

    def _build(self) -> None:
        router = self.engine.router
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.setSpacing(8)

        routing = QGroupBox("Routing")
        f = QFormLayout(routing)
        self.policy_combo = QComboBox()
        self.policy_combo.addItems(policy_choices(self.engine))
        self.policy_combo.setCurrentText(router.policy)
        self.policy_combo.currentTextChanged.connect(self.set_policy)
        self.budget_combo = QComboBox()
        self.budget_combo.addItems(list(BUDGET_MODES))
        self.budget_combo.setCurrentText(router.budget)
        self.budget_combo.currentTextChanged.connect(self.set_budget)
        self.policy_help = QLabel()  # the policy in a sentence
        wrap_label(self.policy_help)
        self.details = QLabel()  # the engine's own description, the decode budget's rule
        wrap_label(self.details)
        self.details.setObjectName("muted")
        self.details.setVisible(False)
        self.details_link = QLabel()
        self.details_link.linkActivated.connect(lambda _link: self.show_details(self.details.isHidden()))
        self.ratio_label = QLabel()
        self.ratio_label.setObjectName("muted")
        f.addRow("Policy", self.policy_combo)
        f.addRow("Decode budget", self.budget_combo)
        f.addRow(self.policy_help)
        f.addRow(self.details_link)
        f.addRow(self.details)
        f.addRow(self.ratio_label)
        lay.addWidget(routing)

        rates = QGroupBox("Rates the router prices work at (tok/s)")
        g = QGridLayout(rates)
        for col, text in enumerate(("", "prefill", "decode", "source", "ceiling", "cache")):
            lab = QLabel(text)
            lab.setObjectName("muted")
            if text == "ceiling":
                lab.setToolTip(CAP_HELP)
            g.addWidget(lab, 0, col)
        self.prefill_spins: dict[str, QDoubleSpinBox] = {}
        self.decode_spins: dict[str, QDoubleSpinBox] = {}
        self.source_labels: dict[str, QLabel] = {}
        self.cap_spins: dict[str, QSpinBox] = {}
        self.live_labels: dict[str, QLabel] = {}  # the live cap beside each ceiling
        self.cache_checks: dict[str, QCheckBox] = {}
        for row, name in enumerate(self.engine.backend_names, start=1):
            r, snap, info = self.engine.rates(name), self.engine.backend_snapshot(name), self.engine.info(name)
            i = row - 1
            g.addWidget(QLabel(f"<span style='color:{backend_color(i)}'>■</span> {name}"), row, 0)
            ps = QDoubleSpinBox(decimals=1, minimum=0.1, maximum=1e7, value=r.prefill_tok_s)
            ds = QDoubleSpinBox(decimals=1, minimum=0.1, maximum=1e6, value=r.decode_tok_s)
            for s in (ps, ds):
                s.setFixedWidth(SPIN_WIDTH)
                s.setKeyboardTracking(False)  # apply on Enter / focus out / arrows, not per digit
                s.valueChanged.connect(lambda _v, n=name: self.apply_rates(n))
            src = QLabel(r.source)
            src.setObjectName("muted")
            cap = QSpinBox(minimum=1, maximum=info.n_seq_max, value=snap.cap_ceiling or snap.cap)
            cap.setKeyboardTracking(False)
            cap.setToolTip(CAP_HELP)
            cap.valueChanged.connect(lambda v, n=name: self.set_cap(n, v))
            cache = QCheckBox()
            cache.setChecked(snap.cache.enabled)
            cache.setToolTip("Prefix cache on/off, live: off drops what is cached and reuses nothing"
                             + ("" if info.kv_unified else " (split KV: a cached prefix is copied)"))
            cache.toggled.connect(lambda on, n=name: self.set_cache(n, on))
            self.prefill_spins[name], self.decode_spins[name] = ps, ds
            self.source_labels[name], self.cap_spins[name], self.cache_checks[name] = src, cap, cache
            live = QLabel(f"live {snap.cap}" if snap.cap_adaptive else "fixed")
            live.setObjectName("muted")
            self.live_labels[name] = live
            ceiling = QHBoxLayout()
            ceiling.setSpacing(4)
            ceiling.addWidget(cap)
            ceiling.addWidget(live)
            cells: tuple[QWidget | QHBoxLayout, ...] = (ps, ds, src, ceiling, cache)
            for col, w in enumerate(cells, start=1):
                if isinstance(w, QHBoxLayout):
                    g.addLayout(w, row, col)
                else:
                    g.addWidget(w, row, col)
        buttons = QHBoxLayout()
        buttons.setSpacing(4)
        self.reset_button = QPushButton("Reset rates")
        self.reset_button.setToolTip("Back to the rates the engine started with")
        self.reset_button.clicked.connect(self.reset_rates)
        self.recal_button = QPushButton("Recalibrate")
        if self._recalibrate is None:
            self.recal_button.setEnabled(False)
            self.recal_button.setToolTip("Calibration is not available in this engine build yet")
        else:
            self.recal_button.setToolTip("Measure every backend's prefill rate and decode step times now "
                                         "(backends should be idle; takes a while) and use them")
            self.recal_button.clicked.connect(self._on_recalibrate)
        self.flush_button = QPushButton("Flush caches")
        self.flush_button.clicked.connect(self.flush_all)
        buttons.addWidget(self.reset_button)
        buttons.addWidget(self.recal_button)
        buttons.addWidget(self.flush_button)
        buttons.addStretch(1)
        g.addLayout(buttons, len(self.engine.backend_names) + 1, 0, 1, 6)
        g.setColumnStretch(6, 1)  # spare width goes right of the table, not into the cap boxes
        lay.addWidget(rates)
        lay.addStretch(1)
        self._update_help()

    # ---- actions (GUI thread; engine setters are thread-safe) ----

    def set_policy(self, name: str) -> None:
        try:
            self.engine.router.set_policy(name)
            self.status_message.emit(f"routing policy: {name}")
        except EngineError as e:
            self.status_message.emit(str(e))
            self.policy_combo.blockSignals(True)
            self.policy_combo.setCurrentText(self.engine.router.policy)
            self.policy_combo.blockSignals(False)
        self._update_help()

    def set_budget(self, mode: str) -> None:
        try:
            self.engine.router.set_budget(mode)
            self.status_message.emit(f"decode budget: {mode}")
        except EngineError as e:
            self.status_message.emit(str(e))
        self._update_help()

    def apply_rates(self, name: str) -> None:
        old = self.engine.rates(name)
        new = Rates(prefill_tok_s=self.prefill_spins[name].value(), decode_tok_s=self.decode_spins[name].value(),
                    source="override")
        if (new.prefill_tok_s, new.decode_tok_s) == (old.prefill_tok_s, old.decode_tok_s):
            return
        self.engine.set_rates(name, new)
        self.status_message.emit(f"{name}: rates set to prefill {new.prefill_tok_s:g}, decode {new.decode_tok_s:g} tok/s")
        self.rates_changed.emit()

    def reset_rates(self) -> None:
        for name, rates in self._initial_rates.items():
            self.engine.set_rates(name, rates)
            self._show_rates(name, rates)
        self.status_message.emit("rates reset")
        self.rates_changed.emit()

    def set_cap(self, name: str, cap: int) -> None:
        try:
            self.engine.set_cap(name, cap)
            self.status_message.emit(f"{name}: ceiling set to {cap}")
        except EngineError as e:
            self.status_message.emit(str(e))

    def set_cache(self, name: str, enabled: bool) -> None:
        try:
            self.engine.set_cache_enabled(name, enabled)  # applied on the worker, not waited for
            self.status_message.emit(f"{name}: prefix cache {'on' if enabled else 'off'}")
        except EngineError as e:
            self.status_message.emit(str(e))

    def flush_all(self) -> None:
        self.engine.flush(wait=False)
        self.status_message.emit("every prefix cache flushed")

    def _on_recalibrate(self) -> None:
        if self._recal_worker is not None and self._recal_worker.running:
            return
        self.recal_button.setEnabled(False)
        self.recal_button.setText("Calibrating…")
        worker = Worker(lambda: self._recalibrate(self.engine, worker.report), name="recalibrate", owner=self)
        worker.progress.connect(self.status_message.emit)
        worker.returned.connect(lambda _: self._on_recal_done("recalibrated: the router now uses the measured rates"))
        worker.errored.connect(lambda e: self._on_recal_done(f"recalibration failed: {e}"))
        self._recal_worker = worker.start()

    def _on_recal_done(self, message: str) -> None:
        self.recal_button.setEnabled(True)
        self.recal_button.setText("Recalibrate")
        self.status_message.emit(message)
        self.rates_changed.emit()

    def presenter_changed(self, on: bool) -> None:
        """The presenter view (ui.presenter): rate boxes wide enough for their larger digits."""
        font = QFont(self.font())
        font.setPointSize(VALUE_PT if on else 10)
        width = QFontMetrics(font).horizontalAdvance("0000000.0") + 30 if on else SPIN_WIDTH
        for spin in (*self.prefill_spins.values(), *self.decode_spins.values()):
            spin.setFixedWidth(width)

    def restyle(self) -> None:
        """The theme now in use: the details link's colour."""
        self.show_details(not self.details.isHidden())

    # ---- per tick ----

    def _show_rates(self, name: str, rates: Rates) -> None:
        for spin, v in ((self.prefill_spins[name], rates.prefill_tok_s), (self.decode_spins[name], rates.decode_tok_s)):
            if not spin.hasFocus() and abs(spin.value() - v) > 1e-9:
                spin.blockSignals(True)
                spin.setValue(v)
                spin.blockSignals(False)
        self.source_labels[name].setText(rates.source)

    def _on_tick(self, tick) -> None:
        for snap in tick.snapshots:
            if snap.name not in self.cap_spins:
                continue
            self._show_rates(snap.name, snap.rates)
            spin = self.cap_spins[snap.name]
            live = self.live_labels[snap.name]
            text = f"live {snap.cap}" if snap.cap_adaptive else "fixed"
            if live.text() != text:
                live.setText(text)
                live.setToolTip(f"{live_cap_text(snap)}\n\n{cap_reason_detail(snap)}")
            if not spin.hasFocus() and spin.value() != (snap.cap_ceiling or snap.cap):
                spin.blockSignals(True)
                spin.setValue(snap.cap_ceiling or snap.cap)
                spin.blockSignals(False)
            check = self.cache_checks[snap.name]
            if check.isChecked() != snap.cache.enabled:
                check.blockSignals(True)
                check.setChecked(snap.cache.enabled)
                check.blockSignals(False)
        router = self.engine.router
        if router.policy != self.policy_combo.currentText() and not self.policy_combo.hasFocus():
            self.policy_combo.blockSignals(True)
            self.policy_combo.setCurrentText(router.policy)
            self.policy_combo.blockSignals(False)
            self._update_help()
        if router.budget == "ratio":
            self.ratio_label.setText(f"new_token_ratio now {router.new_token_ratio:.2f}")

    def show_details(self, on: bool) -> None:
        """The engine's description of the policy and the decode budget's rule, or the sentence alone."""
        self.details.setVisible(on)
        color = palette().transcript.user
        self.details_link.setText(f"<a href='#details' style='color:{color}'>{'Hide' if on else 'Show'} "
                                  "the details</a>")

    def _update_help(self) -> None:
        router = self.engine.router
        name = router.policy
        self.policy_help.setText(policy_sentence(name, len(self.engine.backend_names), name == DEFAULT_POLICY))
        detail = POLICY_HELP.get(name) or (f"Everything to {name[5:]}." if name.startswith("only:") else "")
        self.details.setText(f"{detail}\n{BUDGET_HELP.get(router.budget, '')}".strip())
        self.show_details(not self.details.isHidden())
        self.ratio_label.setText(f"new_token_ratio now {router.new_token_ratio:.2f}" if router.budget == "ratio" else "")
        self.ratio_label.setVisible(router.budget == "ratio")
