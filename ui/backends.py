"""One card per backend: running vs waiting, cap, KV cells, prefix-cache hits, speeds.

Cards update from the bridge's tick (a `BackendSnapshot` each) and write only through the
backend's thread-safe controls: `set_cap` (applies at once), `warm` and `flush` (both run on
the backend's worker; the card never waits for them).
"""

from __future__ import annotations

import logging

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFrame, QGridLayout, QHBoxLayout, QLabel, QProgressBar, QPushButton, QScrollArea, QSpinBox,
    QVBoxLayout, QWidget,
)

from engine.errors import EngineError

from .metrics import RingSeries
from .theme import backend_color, qcolor

log = logging.getLogger(__name__)

HISTORY_S = 30.0
CARD_WIDTH = 320  # narrowest a card stays readable


class BackendCard(QFrame):
    """A live view of one backend. `warm_tokens()` gives the prefix the Warm button fills."""

    status_message = Signal(str)

    def __init__(self, backend, index: int, warm_tokens=None, hz: int = 15, parent: QWidget | None = None):
        super().__init__(parent)
        self.backend = backend
        self.index = index
        self.color = backend_color(index)
        self._warm_tokens = warm_tokens
        self._t0 = None
        self._history = RingSeries(int(HISTORY_S * hz) + 1, 2)
        self.setObjectName("card")
        self.setMinimumWidth(CARD_WIDTH)
        self._build()

    def _build(self) -> None:
        b = self.backend
        grid = QGridLayout(self)
        grid.setContentsMargins(10, 8, 10, 8)
        grid.setHorizontalSpacing(8)
        grid.setVerticalSpacing(4)

        title = QLabel(f"<span style='color:{self.color}'>■</span> <b>{b.name}</b>")
        title.setObjectName("title")
        threads = b.config.threads
        self.facts = QLabel(f"{b.model.device.upper()} · {threads} thread{'s' if threads != 1 else ''} · "
                            f"ctx {b.n_ctx} · {b.config.n_seq_max} seqs")
        self.facts.setToolTip(f"{b.model.info.name} on {b.model.device}; n_batch {b.config.n_batch}, "
                              f"flash attention {b.config.flash_attn}, unified KV {b.config.kv_unified}")
        self.facts.setObjectName("muted")
        self.health = QLabel("healthy")
        head = QHBoxLayout()
        head.addWidget(title)
        head.addStretch(1)
        head.addWidget(self.health)
        grid.addLayout(head, 0, 0, 1, 4)
        self.facts.setWordWrap(True)
        grid.addWidget(self.facts, 1, 0, 1, 4)

        self.running_bar = _bar("running")
        self.waiting_bar = _bar("waiting")
        self.kv_bar = _bar("kv")
        self.cap_spin = QSpinBox(minimum=1, maximum=b.config.n_seq_max, value=b.cap)
        self.cap_spin.setToolTip("Concurrency cap: at most this many requests run at once on this "
                                 "backend. Applies at once; running ones finish.")
        self.cap_spin.valueChanged.connect(self._on_cap)
        grid.addWidget(_muted("Running"), 2, 0)
        grid.addWidget(self.running_bar, 2, 1)
        grid.addWidget(_muted("Cap"), 2, 2, Qt.AlignRight)
        grid.addWidget(self.cap_spin, 2, 3)
        grid.addWidget(_muted("Waiting"), 3, 0)
        grid.addWidget(self.waiting_bar, 3, 1, 1, 3)
        grid.addWidget(_muted("KV cells"), 4, 0)
        grid.addWidget(self.kv_bar, 4, 1, 1, 3)

        self.plot = pg.PlotWidget()
        self.plot.setFixedHeight(56)
        p = self.plot.getPlotItem()
        p.setMenuEnabled(False)
        p.setMouseEnabled(False, False)
        p.hideButtons()
        p.showGrid(y=True, alpha=0.15)
        p.getAxis("bottom").setStyle(showValues=False)
        p.getAxis("left").setWidth(28)
        p.setXRange(-HISTORY_S, 0, padding=0)
        self.running_curve = p.plot(pen=pg.mkPen(self.color, width=1.5), fillLevel=0,
                                    brush=qcolor(self.color, 70), name="running")
        self.waiting_curve = p.plot(pen=pg.mkPen("#c8ccd4", width=1.3, style=Qt.DashLine), name="waiting")
        self.plot.setToolTip("Last 30 s: running (filled) and waiting (dashed) requests")
        grid.addWidget(self.plot, 5, 0, 1, 4)

        self.hit_label = QLabel()
        self.cache_label = QLabel()
        self.cache_label.setObjectName("muted")
        self.speed_label = QLabel()
        self.rates_label = QLabel()
        self.rates_label.setObjectName("muted")
        for lab in (self.hit_label, self.cache_label, self.speed_label, self.rates_label):
            lab.setWordWrap(True)
        grid.addWidget(_muted("Prefix hits"), 6, 0)
        grid.addWidget(self.hit_label, 6, 1, 1, 3)
        grid.addWidget(self.cache_label, 7, 1, 1, 3)
        grid.addWidget(_muted("Observed"), 8, 0)
        grid.addWidget(self.speed_label, 8, 1, 1, 3)
        grid.addWidget(_muted("Priced at"), 9, 0)
        grid.addWidget(self.rates_label, 9, 1, 1, 3)

        buttons = QHBoxLayout()
        self.warm_button = QPushButton("Warm prefix")
        self.warm_button.setToolTip("Prefill the chat's system prompt into this backend's prefix cache, "
                                    "so requests that start with it skip that prefill")
        self.warm_button.clicked.connect(self.warm)
        self.flush_button = QPushButton("Flush cache")
        self.flush_button.setToolTip("Drop every cached prefix not pinned by a request and free its KV cells")
        self.flush_button.clicked.connect(self.flush)
        buttons.addWidget(self.warm_button)
        buttons.addWidget(self.flush_button)
        buttons.addStretch(1)
        grid.addLayout(buttons, 10, 0, 1, 4)
        grid.setColumnStretch(1, 1)

    # ---- actions ----

    def _on_cap(self, value: int) -> None:
        try:
            self.backend.set_cap(value)
            self.status_message.emit(f"{self.backend.name}: cap set to {value}")
        except EngineError as e:
            self.status_message.emit(str(e))

    def warm(self) -> None:
        tokens = self._warm_tokens() if self._warm_tokens else None
        if not tokens:
            self.status_message.emit("nothing to warm: the system prompt is empty")
            return
        try:
            self.backend.warm(tokens)  # runs on the backend's worker; the card sees it in the snapshot
            self.status_message.emit(f"{self.backend.name}: warming {len(tokens)} prefix tokens")
        except EngineError as e:
            self.status_message.emit(str(e))

    def flush(self) -> None:
        try:
            self.backend.flush()
            self.status_message.emit(f"{self.backend.name}: prefix cache flushed")
        except EngineError as e:
            self.status_message.emit(str(e))

    # ---- per tick ----

    def update_snapshot(self, snap, now: float) -> None:
        running = len(snap.running)
        waiting = len(snap.waiting)
        cap = snap.cap
        self.running_bar.setMaximum(max(cap, running, 1))
        self.running_bar.setValue(running)
        self.running_bar.setFormat(f"{running} / {cap}")
        self.waiting_bar.setMaximum(max(2 * cap, waiting, 1))
        self.waiting_bar.setValue(waiting)
        self.waiting_bar.setFormat(f"{waiting} queued")
        total = max(snap.kv_cells_total, 1)
        self.kv_bar.setMaximum(total)
        self.kv_bar.setValue(min(snap.kv_cells_used, total))
        self.kv_bar.setFormat(f"{snap.kv_cells_used} / {snap.kv_cells_total}  ({snap.kv_bytes / 2**20:.1f} MiB)")
        if not self.cap_spin.hasFocus() and self.cap_spin.value() != cap:
            self.cap_spin.blockSignals(True)
            self.cap_spin.setValue(cap)
            self.cap_spin.blockSignals(False)

        c = snap.cache
        if not c.enabled:
            self.hit_label.setText("cache off")
        else:
            self.hit_label.setText(f"<b>{c.hit_rate * 100:.1f} %</b>  ({c.hit_tokens:,} / {c.query_tokens:,} tokens)")
        self.cache_label.setText(f"{c.cached_tokens:,} cached · {c.pinned_tokens:,} pinned · {c.evictions} evicted")
        self.speed_label.setText(f"prefill {_rate(snap.prefill_tok_s)} · decode {_rate(snap.decode_tok_s)}")
        self.speed_label.setToolTip(f"{snap.steps:,} llama_decode steps so far")
        r = snap.rates
        self.rates_label.setText(f"prefill {r.prefill_tok_s:,.0f} · decode {r.decode_tok_s:,.1f} tok/s ({r.source})")
        self.health.setText("● healthy" if snap.healthy else "● failed")
        self.health.setStyleSheet(f"color:{'#7ed67e' if snap.healthy else '#ff6b6b'}")

        if self._t0 is None:
            self._t0 = now
        self._history.append(now, (running, waiting))
        x, y_run = self._history.view(0)
        _, y_wait = self._history.view(1)
        xs = x - now
        self.running_curve.setData(xs, y_run)
        self.waiting_curve.setData(xs, y_wait)
        top = max(float(np.nanmax(y_run)) if y_run.size else 0, float(np.nanmax(y_wait)) if y_wait.size else 0, cap)
        self.plot.getPlotItem().setYRange(0, top + 0.5, padding=0)


class BackendsPanel(QScrollArea):
    """The cards, stacked; updated from the bridge's tick."""

    status_message = Signal(str)

    def __init__(self, engine, bridge, warm_tokens=None, parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.NoFrame)
        inner = QWidget()
        lay = QGridLayout(inner)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.setSpacing(8)
        hz = max(1, round(1000 / bridge.interval_ms))
        columns = 2 if len(engine.backends) >= 2 else 1  # side by side: the dock is wide, not tall
        self.cards: dict[str, BackendCard] = {}
        for i, (name, backend) in enumerate(engine.backends.items()):
            card = BackendCard(backend, i, warm_tokens, hz)
            card.status_message.connect(self.status_message)
            self.cards[name] = card
            lay.addWidget(card, i // columns, i % columns, Qt.AlignTop)
        lay.setRowStretch(lay.rowCount(), 1)
        self.setMinimumWidth(min(columns * CARD_WIDTH + 24, 720))
        self.setWidget(inner)
        bridge.tick.connect(self.on_tick)

    def on_tick(self, tick) -> None:
        for snap in tick.snapshots:
            card = self.cards.get(snap.name)
            if card is not None:
                card.update_snapshot(snap, tick.time)


def _bar(name: str) -> QProgressBar:
    bar = QProgressBar()
    bar.setObjectName(name)
    bar.setTextVisible(True)
    bar.setMinimum(0)
    bar.setValue(0)
    return bar


def _muted(text: str) -> QLabel:
    lab = QLabel(text)
    lab.setObjectName("muted")
    return lab


def _rate(x: float) -> str:
    return f"{x:,.0f} tok/s" if x >= 100 else (f"{x:.1f} tok/s" if x > 0 else "–")
