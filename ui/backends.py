"""One card per backend: running vs waiting, cap, KV cells, prefix-cache hits, speeds.

Cards update from the bridge's tick (a `BackendSnapshot` each) and write only through the
backend's thread-safe controls: `set_cap` (applies at once), `warm` and `flush` (both run on
the backend's worker; the card never waits for them).

A backend that failed (a device error, a crashed worker) shows why in red and a Restart
button. `Engine.restart(name)` joins the dead worker and builds a
fresh llama.cpp context, so it runs on a `ui.worker.Worker` that reports back on the main
thread; the next tick shows the backend healthy again.
"""

from __future__ import annotations

import logging

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFont, QFontMetrics
from PySide6.QtWidgets import (
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QWidget,
)

from engine.core.errors import EngineError

from .advice import advise
from .axes import count_axis_top
from .formatting import CAP_HELP, cap_reason_detail, fmt_rate, live_cap_text, rates_source_text
from .legend import add_legend
from .live_stats import RingSeries
from .plot_marks import ChangeMarks, ChangeTracker
from .theme import FAILED, HEALTHY, LEGEND_BG, MUTED, WORKING, backend_color, palette, qcolor, wrap_label
from .worker import Worker

log = logging.getLogger(__name__)

HISTORY_S = 30.0
SPARK_PT = {False: 7, True: 11}  # the history's type: as a card has room for / in the presenter view
SPARK_HEIGHT = {False: 76, True: 130}
CARD_WIDTH = 330  # narrowest a card stays readable (with Warm/Flush in its header)


class BackendCard(QFrame):
    """A live view of one backend, named `name` in `engine`; its controls are the engine's.
    `warm_tokens()` gives the prefix the Warm button fills; Restart (`Engine.restart`, blocking,
    run on a worker thread) brings a failed backend back."""

    status_message = Signal(str)

    def __init__(self, engine, name: str, index: int, warm_tokens=None, hz: int = 15,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        self.name = name
        self.index = index
        self.color = backend_color(index)
        self._warm_tokens = warm_tokens
        self._restart = engine.restart
        self._restart_worker: Worker | None = None
        self._restart_error: str | None = None
        self._t0: float | None = None
        self._history = RingSeries(int(HISTORY_S * hz) + 1, 2)
        self.setObjectName("card")
        self.setMinimumWidth(CARD_WIDTH)
        self._build()

    def _build(self) -> None:
        b = self.engine.info(self.name)
        snap = self.engine.backend_snapshot(self.name)
        grid = QGridLayout(self)
        grid.setContentsMargins(10, 8, 10, 8)
        grid.setHorizontalSpacing(8)
        grid.setVerticalSpacing(4)

        title = QLabel(f"<span style='color:{self.color}'>■</span> <b>{b.name}</b>")
        title.setObjectName("title")
        threads = b.threads
        if b.url:  # an engine elsewhere: where it is and what it serves
            self.facts = QLabel(f"REMOTE · {snap.url.removeprefix('http://')} · {snap.model or '?'}")
            self.facts.setToolTip(f"an OpenAI-compatible engine at {snap.url}; Tandem sends it at most "
                                  f"{snap.cap} requests at a time and predicts its prefix cache")
        else:
            self.facts = QLabel(f"{b.device.upper()} · {threads} thread{'s' if threads != 1 else ''} · "
                                f"ctx {b.n_ctx} · {b.n_seq_max} seqs")
            self.facts.setToolTip(f"{b.model} on {b.device}; n_batch {b.n_batch}, "
                                  f"flash attention {b.flash_attn}, unified KV {b.kv_unified}")
        self.facts.setObjectName("muted")
        self.health = QLabel("healthy")
        self.warm_button = QPushButton("Warm prefix")
        self.warm_button.setToolTip("Prefill the chat's system prompt into this backend's prefix cache, "
                                    "so requests that start with it skip that prefill")
        self.warm_button.clicked.connect(self.warm)
        self.flush_button = QPushButton("Flush cache")
        self.flush_button.setToolTip("Drop every cached prefix not pinned by a request and free its KV cells")
        self.flush_button.clicked.connect(self.flush)
        head = QHBoxLayout()
        head.addWidget(title)
        head.addStretch(1)
        head.addWidget(self.health)
        head.addSpacing(6)
        head.addWidget(self.warm_button)
        head.addWidget(self.flush_button)
        grid.addLayout(head, 0, 0, 1, 4)
        self.facts.setWordWrap(True)
        grid.addWidget(self.facts, 1, 0, 1, 4)

        # Shown only while the backend is down: why, and the way back.
        self.problem = QWidget()
        self.problem.setObjectName("problem")
        self.problem.setStyleSheet("QWidget#problem { background: transparent; }")  # the card's colour
        problem = QHBoxLayout(self.problem)
        problem.setContentsMargins(0, 2, 0, 2)
        self.error_label = wrap_label(QLabel())
        self.error_label.setStyleSheet(f"color:{FAILED}")
        self.error_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.restart_button = QPushButton("Restart")
        self.restart_button.setObjectName("danger")
        self.restart_button.setToolTip("Throw this backend's context away and start it again with a fresh one "
                                       "(and an empty prefix cache); it serves again afterwards")
        self.restart_button.clicked.connect(self.restart)
        self.restart_button.setEnabled(self._restart is not None)
        problem.addWidget(self.error_label, 1)
        problem.addWidget(self.restart_button, 0, Qt.AlignmentFlag.AlignTop)
        self.problem.setVisible(False)
        grid.addWidget(self.problem, 2, 0, 1, 4)

        self.running_bar = _bar("running")
        self.waiting_bar = _bar("waiting")
        self.kv_bar = _bar("kv")
        self.cap_spin = QSpinBox(minimum=1, maximum=b.n_seq_max, value=snap.cap_ceiling or snap.cap)
        self.cap_spin.setToolTip(CAP_HELP + " Applies at once; running ones finish.")
        self.cap_spin.valueChanged.connect(self._on_cap)
        self.running_bar.setToolTip("Requests running now / the live cap")
        grid.addWidget(_muted("Running"), 3, 0)
        grid.addWidget(self.running_bar, 3, 1)
        ceiling_label = _muted("Ceiling")
        ceiling_label.setToolTip(CAP_HELP)
        grid.addWidget(ceiling_label, 3, 2, Qt.AlignmentFlag.AlignRight)
        grid.addWidget(self.cap_spin, 3, 3)
        grid.addWidget(_muted("Waiting"), 4, 0)
        grid.addWidget(self.waiting_bar, 4, 1, 1, 3)
        grid.addWidget(_muted("KV cells"), 5, 0)
        grid.addWidget(self.kv_bar, 5, 1, 1, 3)

        self.plot = pg.PlotWidget()
        self.plot.setProperty("sparkline", True)  # keeps its small type in the presenter view (ui.presenter)
        self.plot.setFixedHeight(SPARK_HEIGHT[False])
        p = self.plot.getPlotItem()
        p.setMouseEnabled(False, False)
        p.hideButtons()
        p.showGrid(x=True, y=True, alpha=0.15)
        # a time axis: seconds before now
        small = QFont()
        small.setPointSize(SPARK_PT[False])
        bottom = p.getAxis("bottom")
        bottom.setStyle(tickFont=small, tickLength=3, tickTextOffset=1)
        bottom.setHeight(16)
        bottom.setTicks([[(-25, "−25 s"), (-15, "−15 s"), (-5, "−5 s")], []])  # inside the edges
        p.getAxis("left").setWidth(28)
        p.setXRange(-HISTORY_S, 0, padding=0)
        self.marks = ChangeMarks(p, relative_window_s=HISTORY_S, labels=False)
        self.changes = ChangeTracker()
        p.getAxis("left").enableAutoSIPrefix(False)
        self.legend = add_legend(p, offset=(30, 0), labelTextSize="7pt", colCount=2, brush=LEGEND_BG,
                                 verSpacing=-6, horSpacing=10)
        self.running_curve = p.plot(pen=pg.mkPen(self.color, width=1.5), fillLevel=0,
                                    brush=qcolor(self.color, 70), name="running")
        self.waiting_curve = p.plot(pen=_waiting_pen(), name="waiting")
        self.plot.setToolTip("Last 30 s: running (filled) and waiting (dashed) requests; an orange dashed line "
                             "marks a change of this backend's cap or health, or of the policy")
        grid.addWidget(self.plot, 6, 0, 1, 4)

        self.hit_label = QLabel()
        self.cache_label = QLabel()
        self.cache_label.setObjectName("muted")
        self.cache_label.setToolTip("KV cells the prefix cache holds, those queued requests hold, how many cached "
                                    "sequences were evicted, and how many prompt tokens came back after their "
                                    "eviction and were computed again (a pool that keeps too little)")
        self.speed_label = QLabel()
        self.rates_label = QLabel()
        self.rates_label.setObjectName("muted")
        # Where the rates the router prices this backend at came from: a placeholder ("default")
        # is flagged, since every score is rough until it is measured.
        self.rates_source_label = QLabel()
        for lab in (self.hit_label, self.cache_label, self.speed_label, self.rates_label, self.rates_source_label):
            lab.setWordWrap(True)
        grid.addWidget(_muted("Prefix hits"), 7, 0)
        grid.addWidget(self.hit_label, 7, 1, 1, 3)
        grid.addWidget(self.cache_label, 8, 1, 1, 3)
        grid.addWidget(_muted("Observed"), 9, 0)
        grid.addWidget(self.speed_label, 9, 1, 1, 3)
        grid.addWidget(_muted("Priced at"), 10, 0)
        grid.addWidget(self.rates_label, 10, 1, 1, 3)
        grid.addWidget(self.rates_source_label, 11, 1, 1, 3)  # under the rates, as the cache's figures under the hits
        # The adaptive cap's live value and why it last moved (engine/sched/limiter.py).
        self.limit_label = _muted("")
        self.limit_label.setWordWrap(True)
        grid.addWidget(_muted("Cap"), 12, 0)
        grid.addWidget(self.limit_label, 12, 1, 1, 3)

        grid.setColumnStretch(1, 1)

    # ---- actions ----

    def _on_cap(self, value: int) -> None:
        try:
            self.engine.set_cap(self.name, value)
            self.status_message.emit(f"{self.name}: ceiling set to {value}")
        except EngineError as e:
            self.status_message.emit(str(e))

    def warm(self) -> None:
        tokens = self._warm_tokens() if self._warm_tokens else None
        if not tokens:
            self.status_message.emit("nothing to warm: the system prompt is empty")
            return
        try:
            # runs on the backend's worker; the card sees it in the snapshot
            self.engine.warm(tokens, backend=self.name, wait=False)
            self.status_message.emit(f"{self.name}: warming {len(tokens)} prefix tokens")
        except EngineError as e:
            self.status_message.emit(str(e))

    def flush(self) -> None:
        try:
            self.engine.flush(self.name, wait=False)
            self.status_message.emit(f"{self.name}: prefix cache flushed")
        except EngineError as e:
            self.status_message.emit(str(e))

    @property
    def restarting(self) -> bool:
        return self._restart_worker is not None and self._restart_worker.running

    def restart(self) -> None:
        if self._restart is None or self.restarting:
            return
        self.restart_button.setEnabled(False)
        self.restart_button.setText("Restarting…")
        self.status_message.emit(f"{self.name}: restarting")
        worker = Worker(self._restart, self.name, name=f"restart-{self.name}", owner=self)
        worker.returned.connect(lambda _: self._on_restart_done(""))
        worker.errored.connect(self._on_restart_failed)
        self._restart_worker = worker.start()

    def _on_restart_failed(self, e: BaseException) -> None:
        log.error("restarting %s failed", self.name, exc_info=e)
        self._on_restart_done(str(e) or type(e).__name__)

    def _on_restart_done(self, error: str) -> None:
        self._restart_worker = None
        self._restart_error = error or None
        self.restart_button.setEnabled(True)
        self.restart_button.setText("Restart")
        name = self.name
        self.status_message.emit(f"{name}: restart failed: {error}" if error
                                 else f"{name}: restarted with a fresh context")

    # ---- per tick ----

    def update_snapshot(self, snap, now: float) -> None:
        running = len(snap.running)
        waiting = len(snap.waiting)
        cap = snap.cap
        self.running_bar.setMaximum(max(cap, running, 1))
        self.running_bar.setValue(running)
        self.running_bar.setFormat(f"{running} / live cap {cap}")
        self.waiting_bar.setMaximum(max(2 * cap, waiting, 1))
        self.waiting_bar.setValue(waiting)
        self.waiting_bar.setFormat(f"{waiting} queued")
        total = max(snap.kv_cells_total, 1)
        self.kv_bar.setMaximum(total)
        self.kv_bar.setValue(min(snap.kv_cells_used, total))
        self.kv_bar.setFormat(f"{snap.kv_cells_used} / {snap.kv_cells_total}  ({snap.kv_bytes / 2**20:.1f} MiB)")
        ceiling = snap.cap_ceiling or cap
        if not self.cap_spin.hasFocus() and self.cap_spin.value() != ceiling:
            self.cap_spin.blockSignals(True)
            self.cap_spin.setValue(ceiling)
            self.cap_spin.blockSignals(False)
        live = live_cap_text(snap)
        if self.limit_label.text() != live:
            self.limit_label.setText(live)
            self.limit_label.setToolTip(cap_reason_detail(snap))  # the engine's figures, on demand

        c = snap.cache
        if not c.enabled:
            self.hit_label.setText("cache off")
        else:
            self.hit_label.setText(f"<b>{c.hit_rate * 100:.1f} %</b>  ({c.hit_tokens:,} / {c.query_tokens:,} tokens)")
        self.cache_label.setText(f"{c.cached_tokens:,} cached · {c.pinned_tokens:,} pinned · {c.evictions} evicted, "
                                 f"{c.lost_tokens:,} tok asked for again")
        self.speed_label.setText(f"prefill {_rate(snap.prefill_tok_s)} · decode {_rate(snap.decode_tok_s)}")
        self.speed_label.setToolTip(f"{snap.steps:,} llama_decode steps so far")
        r = snap.rates
        self.rates_label.setText(f"prefill {fmt_rate(r.prefill_tok_s)} · decode {fmt_rate(r.decode_tok_s)}")
        self._show_rates_source(r)
        self._show_health(snap.healthy, snap.error)

        if self._t0 is None:
            self._t0 = now
        self.marks.add(now, self.changes.update([snap], self.engine.router.policy))
        self.marks.scroll(now)
        self._history.append(now, (running, waiting))
        x, y_run = self._history.view(0)
        _, y_wait = self._history.view(1)
        xs = x - now
        self.running_curve.setData(xs, y_run)
        self.waiting_curve.setData(xs, y_wait)
        top = max(float(np.nanmax(y_run)) if y_run.size else 0, float(np.nanmax(y_wait)) if y_wait.size else 0, cap)
        axis_top, step = count_axis_top(top)
        self.plot.getPlotItem().setYRange(0, axis_top, padding=0)
        self.plot.getPlotItem().getAxis("left").setTickSpacing(step, step)

    def restyle(self) -> None:
        """The theme now in use: the waiting line in its text colour."""
        self.waiting_curve.setPen(_waiting_pen())

    def presenter_changed(self, on: bool) -> None:
        """The presenter view: a taller history with type a room can read."""
        p = self.plot.getPlotItem()
        font = QFont()
        font.setPointSize(SPARK_PT[on])
        bottom = p.getAxis("bottom")
        bottom.setStyle(tickFont=font)
        bottom.setHeight(QFontMetrics(font).height() + 2 if on else 16)
        left = p.getAxis("left")
        left.setStyle(tickFont=font)
        left.setWidth(QFontMetrics(font).horizontalAdvance("000") + 8 if on else 28)
        self.legend.setLabelTextSize(f"{SPARK_PT[on]}pt")
        for _sample, label in self.legend.items:
            label.setText(label.text, size=f"{SPARK_PT[on]}pt")
        self.plot.setFixedHeight(SPARK_HEIGHT[on])

    def _show_rates_source(self, rates) -> None:
        """Where the router's rates came from (`Rates.origin`); a placeholder is flagged."""
        placeholder = rates.placeholder
        text = "⚠ placeholder rates, not measured" if placeholder else f"rates: {rates.origin}"
        if self.rates_source_label.text() != text:
            self.rates_source_label.setText(text)
            self.rates_source_label.setStyleSheet(f"color:{WORKING if placeholder else MUTED}")
            self.rates_source_label.setToolTip(rates_source_text(rates.source))

    def _show_health(self, healthy: bool, error: str | None) -> None:
        # `error` is set before the backend is marked unhealthy, so a failed snapshot has it
        if self.restarting:
            text, color = "● restarting…", WORKING
        elif healthy:
            text, color = "● healthy", HEALTHY
        else:
            text, color = ("● failed", FAILED) if error else ("● stopped", FAILED)
        if self.health.text() != text:
            self.health.setText(text)
            self.health.setStyleSheet(f"color:{color}")
        if healthy:
            self._restart_error = None
        down = not healthy and (error is not None or self.restarting)
        self.problem.setVisible(down)
        if down and error:
            advice = advise(error, "engine")  # plain words; the engine's own in the tooltip
            text = advice.text + (f"\nRestart failed: {advise(self._restart_error, 'engine').text}"
                                  if self._restart_error else "")
            if self.error_label.text() != text:
                self.error_label.setText(text)
                self.error_label.setToolTip(error if advice.text != error else "")


class BackendsPanel(QScrollArea):
    """The cards, stacked; updated from the bridge's tick."""

    status_message = Signal(str)

    def __init__(self, engine, bridge, warm_tokens=None, parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        inner = QWidget()
        lay = QGridLayout(inner)
        lay.setContentsMargins(6, 6, 6, 6)
        lay.setSpacing(8)
        hz = max(1, round(1000 / bridge.interval_ms))
        names = engine.backend_names
        self._grid = lay
        self._columns = 0
        self._card_width = CARD_WIDTH  # the narrowest a card stays readable (wider in large type)
        self.cards: dict[str, BackendCard] = {}
        for i, name in enumerate(names):
            card = BackendCard(engine, name, i, warm_tokens, hz)
            card.status_message.connect(self.status_message)
            self.cards[name] = card
        self._reflow(2 if len(self.cards) >= 2 else 1)
        self.setMinimumWidth(CARD_WIDTH + 24)  # one column when narrow; side by side when there is room
        self.setWidget(inner)
        bridge.tick.connect(self.on_tick)

    def _reflow(self, columns: int) -> None:
        columns = max(1, min(columns, len(self.cards)))
        if columns == self._columns:
            return
        self._columns = columns
        for card in self.cards.values():
            self._grid.removeWidget(card)
        for i, card in enumerate(self.cards.values()):
            self._grid.addWidget(card, i // columns, i % columns, Qt.AlignmentFlag.AlignTop)
        for r in range(self._grid.rowCount()):
            self._grid.setRowStretch(r, 0)
        self._grid.setRowStretch((len(self.cards) + columns - 1) // columns, 1)

    @property
    def columns(self) -> int:
        return self._columns

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._reflow(self._fit_columns())

    def restyle(self) -> None:
        for card in self.cards.values():
            card.restyle()

    def presenter_changed(self, on: bool) -> None:
        """Large type: each card's history grows, and the cards get the width their text needs
        (fewer side by side)."""
        for card in self.cards.values():
            card.presenter_changed(on)
            if (grid := card.layout()) is not None:
                grid.activate()  # its minimum width for the new type, now
        self._card_width = max([CARD_WIDTH] + [c.minimumSizeHint().width() for c in self.cards.values()]) \
            if on else CARD_WIDTH
        for card in self.cards.values():
            card.setMinimumWidth(self._card_width)
        self._reflow(self._fit_columns())

    def _fit_columns(self) -> int:
        return (self.viewport().width() - 12) // (self._card_width + 8)

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
    return fmt_rate(x)


def _waiting_pen():
    """The sparkline's waiting line: dashed, in the theme's muted text colour (visible on both)."""
    return pg.mkPen(palette().transcript.muted, width=1.3, style=Qt.PenStyle.DashLine)
