"""The routing view: every decision with each backend's score terms, a score plot, the why.

`RoutingTableModel` keeps the `RoutingDecision`s the bridge delivers (one row per arriving
request) and shows, per backend, the cached tokens, the prefill and decode tokens the score
counted, the rates it used and the score, with the chosen backend's cells highlighted.
`RoutingView` adds a plot of each backend's score over time with the decisions marked, and
explains the selected row in words with its arithmetic.

Rows are numbered from 1 and timed from the first decision the view shows (both restart on
Clear), so a run reads "#1 at 0.00 s" whatever happened before it. `export_csv(path)` writes
every row with raw numbers (tokens, tok/s, seconds) for a spreadsheet.
"""

from __future__ import annotations

import csv
import html
import math
import time
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QSplitter,
    QTableView,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from engine.routing import DEFAULT_POLICY

from .axes import count_axis_top
from .formatting import fmt_rate
from .plot_marks import ChangeMarks, ChangeTracker, EmptyHint, hover_tips
from .run_strip import RunStrip
from .theme import LEGEND_BG, MUTED, backend_color, palette, style_plot

# Per backend: the score's terms. The rates it priced them at are in each cell's tooltip, the
# explanation and the CSV (a column of them pushed the table past a 1080p window's width).
TERMS = ("cached", "prefill", "decode", "score")
UNITS = {"cached": "tok", "prefill": "tok", "decode": "tok", "rates": "tok/s", "score": "s"}
FIXED = ("#", "t", "chosen")  # the request's id is the row's tooltip (and in the CSV)
BACKEND_COLUMN = FIXED.index("chosen")
MAX_ROWS = 5000


class RoutingTableModel(QAbstractTableModel):
    """Decisions, oldest first; at most `MAX_ROWS` (the oldest drop off). `t0` is the time of the
    first decision since the last clear (None while empty)."""

    def __init__(self, backends: list[str], parent=None):
        super().__init__(parent)
        self.backends = list(backends)
        self.t0: float | None = None
        self.decisions: list = []
        self.count = 0  # decisions added since the last clear (row numbers keep counting after drops)
        self._first_number = 1
        self._colors = {b: backend_color(i) for i, b in enumerate(self.backends)}  # as plotted

    # ---- data ----

    def add(self, decision) -> None:
        if len(self.decisions) >= MAX_ROWS:
            self.beginRemoveRows(QModelIndex(), 0, 0)
            self.decisions.pop(0)
            self._first_number += 1
            self.endRemoveRows()
        if self.t0 is None:
            self.t0 = decision.time
        row = len(self.decisions)
        self.beginInsertRows(QModelIndex(), row, row)
        self.decisions.append(decision)
        self.count += 1
        self.endInsertRows()

    def clear(self) -> None:
        self.beginResetModel()
        self.decisions.clear()
        self.count = 0
        self._first_number = 1
        self.t0 = None
        self.endResetModel()

    def column_of(self, backend: str, term: str) -> int:
        return len(FIXED) + self.backends.index(backend) * len(TERMS) + TERMS.index(term)

    # ---- Qt model ----

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.decisions)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(FIXED) + len(TERMS) * len(self.backends)

    def headerData(self, section, orientation, role=Qt.DisplayRole):
        if orientation != Qt.Horizontal:
            return None
        if role == Qt.DisplayRole:
            if section < len(FIXED):
                return FIXED[section]
            b, t = divmod(section - len(FIXED), len(TERMS))
            return f"{self.backends[b]}\n{TERMS[t]}\n{UNITS[TERMS[t]]}"
        if role == Qt.ForegroundRole and section >= len(FIXED):
            b = (section - len(FIXED)) // len(TERMS)
            return QBrush(_text_color(self._colors[self.backends[b]]))
        if role == Qt.ToolTipRole and section >= len(FIXED):
            t = TERMS[(section - len(FIXED)) % len(TERMS)]
            return {
                "cached": "prompt tokens of the new request already in this backend's prefix cache",
                "prefill": "prompt tokens left to compute: queued + running + the new request (minus cached)",
                "decode": "decode-token budget: unused max_tokens of every request there + the new one",
                "score": "prefill/rate + decode/rate in seconds; lower wins (a cell's tooltip has the rates)",
            }[t]
        return None

    def data(self, index, role=Qt.DisplayRole):
        if not index.isValid():
            return None
        d = self.decisions[index.row()]
        col = index.column()
        if col < len(FIXED):
            if role == Qt.DisplayRole:
                return [
                    str(self._first_number + index.row()),
                    f"{d.time - self.t0:.2f} s",
                    d.backend + (" (pinned)" if d.pinned else ""),
                ][col]
            if role == Qt.ForegroundRole and col == BACKEND_COLUMN and d.backend in self._colors:
                return QBrush(_text_color(self._colors[d.backend]))
            if role == Qt.ToolTipRole:
                return f"{d.request_id} · {d.policy}: {d.reason}"
            if role == Qt.TextAlignmentRole and col in (0, 1):
                return int(Qt.AlignRight | Qt.AlignVCenter)
            return None
        b, t = divmod(col - len(FIXED), len(TERMS))
        name = self.backends[b]
        try:
            s = d.score_of(name)
        except KeyError:
            return None
        if role == Qt.DisplayRole:
            return score_term(s, TERMS[t])
        if role == Qt.BackgroundRole and name == d.backend:
            return QBrush(QColor(palette().chosen_bg))  # the theme in use
        if role == Qt.TextAlignmentRole:
            return int(Qt.AlignRight | Qt.AlignVCenter)
        if role == Qt.ToolTipRole:
            return explain_score(s)
        return None


def score_term(s, term: str) -> str:
    """A `BackendScore` term as the table shows it."""
    if term == "cached":
        return str(s.cached_tokens)
    if term == "prefill":
        return _tok(s.prefill_tokens)
    if term == "decode":
        return _tok(s.decode_tokens)
    if term == "rates":  # the unit is in the column's heading
        return f"{_num_rate(s.rates.prefill_tok_s)} / {_num_rate(s.rates.decode_tok_s)}"
    if term == "score":  # at most 7 characters, what the column has room for (the tooltip has the rest)
        x = s.score_s
        return "∞" if not math.isfinite(x) else f"{x:.3f}" if abs(x) < 1000 else f"{x:.1f}" if abs(x) < 1e5 else f"{x:.0f}"
    raise KeyError(term)


def explain_score(s) -> str:
    """One backend's arithmetic in words."""
    state = f"{s.n_running} running, {s.n_waiting} queued, cap {s.cap}, {s.cached_tokens} cached"
    if not s.eligible:
        return f"{s.name}: unhealthy ({state})"
    return (f"{s.name}: {_tok(s.prefill_tokens)} prefill tok / {fmt_rate(s.rates.prefill_tok_s)} = {s.prefill_s:.3f} s"
            f"  +  {_tok(s.decode_tokens)} decode tok / {fmt_rate(s.rates.decode_tok_s)} = {s.decode_s:.3f} s"
            f"  →  {_secs(s.score_s)}   ({state}; {s.rates.source} rates)")


def _text_color(plotted: str) -> QColor:
    """A backend's plot colour as text on the theme in use (deeper on the light one)."""
    return QColor(palette().transcript.backend(plotted))


def explain_decision(d, colors: dict | None = None, number: int | None = None) -> str:
    """The selected decision in words (HTML): who won, by how much, and every backend's sum, in
    the theme in use's text colours (`colors`: each backend's plot colour). `number`: the row's
    number in the table, which names the request there (the engine's id is the row's tooltip)."""
    pal = palette()
    colors = {name: pal.transcript.backend(c) for name, c in (colors or {}).items()}
    muted, plain = pal.transcript.muted, pal.text
    chosen = d.chosen
    others = sorted((s for s in d.scores if s.name != d.backend), key=lambda s: s.score_s)
    name = f"#{number}" if number is not None else html.escape(d.request_id)
    head = f"<b>{name}</b> → <b style='color:{colors.get(d.backend, plain)}'>{html.escape(d.backend)}</b>"
    if d.pinned:
        line = "Pinned by the request: the policy was bypassed."
    elif others:
        o = others[0]
        rel = ">" if o.score_s > chosen.score_s else ("=" if o.score_s == chosen.score_s else "<")
        line = (f"{html.escape(o.name)} {_secs(o.score_s)} {html.escape(rel)} {html.escape(chosen.name)} {_secs(chosen.score_s)}: "
                f"{_tok(o.prefill_tokens)} prefill + {_tok(o.decode_tokens)} decode tokens queued on {html.escape(o.name)}, "
                f"{_tok(chosen.prefill_tokens)} + {_tok(chosen.decode_tokens)} on {html.escape(chosen.name)}.")
    else:
        line = "The only backend."
    budget = d.budget + (f", new_token_ratio {d.new_token_ratio:.2f}" if d.new_token_ratio is not None else "")
    rows = "".join(f"<li><span style='color:{colors.get(s.name, plain)}'>■</span> {html.escape(explain_score(s))}</li>"
                   for s in d.scores)
    return (f"<p style='font-size:large'>{head} &nbsp; <span style='color:{muted}'>policy {html.escape(d.policy)} · "
            f"decode budget {html.escape(budget)}</span></p>"
            f"<p>{line}</p><ul style='margin-left:-20px'>{rows}</ul>"
            f"<p style='color:{muted}'>Router's record: {html.escape(d.reason)}</p>")


class RoutingView(QWidget):
    """Table + score plot + explanation; decisions arrive via `bridge.routed`."""

    def __init__(self, engine, bridge, parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        self.backends = engine.backend_names
        self.colors = {b: backend_color(i) for i, b in enumerate(self.backends)}
        self.t0 = time.monotonic()  # decisions older than the view by an hour are not shown
        self.model = RoutingTableModel(self.backends, self)
        self._plot_dirty = False
        self._build()
        for d in engine.router.recent():  # decisions made before the view existed
            if d.time >= self.t0 - 3600:
                self.add_decision(d)
        bridge.routed.connect(self.add_decision)
        bridge.tick.connect(self._on_tick)

    def _build(self) -> None:
        self.table = QTableView()
        self.table.setModel(self.model)
        self.table.setAlternatingRowColors(True)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.verticalHeader().setVisible(False)
        self.table.verticalHeader().setDefaultSectionSize(22)
        # Every column shares the table's width (no sideways scrolling): the id moved to the
        # row's tooltip, units to the headings, so the cells are short numbers.
        h = self.table.horizontalHeader()
        h.setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        h.setMinimumSectionSize(36)
        self.table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.table.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.table.selectionModel().currentRowChanged.connect(self._on_row)
        self.model.rowsInserted.connect(self._follow)

        self.plot_widget = pg.PlotWidget()
        p = self.plot = self.plot_widget.getPlotItem()
        # x is the row number: arrivals evenly spaced however far apart in time (a chat long before a run).
        style_plot(p, "Each backend's score per request (lower wins)", "request # (table row)",
                   "score (s)")
        p.addLegend(offset=(8, 8), labelTextSize="9pt", brush=LEGEND_BG)
        for axis in ("left", "bottom"):
            p.getAxis(axis).enableAutoSIPrefix(False)  # seconds stay seconds, no "(x0.001)"
        self.curves = {}
        for b in self.backends:
            c = self.colors[b]
            self.curves[b] = p.plot(pen=pg.mkPen(c, width=1.5), symbol="o", symbolSize=4, symbolBrush=c,
                                    symbolPen=None, name=f"{b} score", connect="finite")
        self.marks = pg.ScatterPlotItem(size=11, pen=pg.mkPen("w", width=1.2))
        hover_tips(self.marks, lambda _x, _y, data: data)
        p.addItem(self.marks)
        self.hint = EmptyHint(p, "no request routed yet")
        self.changes = ChangeTracker()
        self.change_marks = ChangeMarks(p)  # x is the row: a change is marked before the next arrival
        self.selected_line = pg.InfiniteLine(angle=90, pen=pg.mkPen(MUTED, width=1.5, style=Qt.PenStyle.DotLine))  # reads on both themes
        self.selected_line.setVisible(False)
        p.addItem(self.selected_line)

        self.explain = QTextBrowser()
        self._show_hint()

        self.clear_button = QPushButton("Clear")
        self.clear_button.setToolTip("Forget the rows shown here (the router keeps its own record)")
        self.clear_button.clicked.connect(self.clear)
        self.export_button = QPushButton("Export CSV…")
        self.export_button.setToolTip("Save every row (raw tokens, tok/s and seconds) as a CSV file")
        self.export_button.clicked.connect(self._ask_export)
        self.count_label = QLabel()
        self.count_label.setObjectName("muted")
        bar = QHBoxLayout()
        title = QLabel("<b>Decisions</b>")
        title.setToolTip("One row per arriving request: each backend's score terms, the chosen one's cells green")
        title.setMinimumWidth(40)
        self.run_strip = RunStrip()
        bar.addWidget(title, 1)
        bar.addWidget(self.count_label)
        bar.addWidget(self.export_button)
        bar.addWidget(self.clear_button)

        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(0, 0, 0, 0)
        lv.addWidget(self.run_strip)
        lv.addLayout(bar)
        lv.addWidget(self.table, 1)
        right = QSplitter(Qt.Orientation.Vertical)
        right.addWidget(self.plot_widget)
        right.addWidget(self.explain)
        right.setSizes([260, 170])
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(left)
        split.addWidget(right)
        split.setSizes([900, 600])
        outer = QVBoxLayout(self)
        outer.setContentsMargins(6, 6, 6, 6)
        outer.addWidget(split)

    # ---- updates ----

    def add_decision(self, decision) -> None:
        self.model.add(decision)
        self._plot_dirty = True

    def clear(self) -> None:
        self.model.clear()
        self._plot_dirty = True
        self.explain.clear()

    def export_csv(self, path: str | Path) -> Path:
        """Write the rows shown, with raw numbers, as CSV."""
        path = Path(path)
        m = self.model
        head = ["number", "t_s", "request", "backend", "pinned", "policy", "budget"]
        for b in self.backends:
            head += [f"{b}_{k}" for k in ("cached_tokens", "prefill_tokens", "decode_tokens", "prefill_tok_s",
                                          "decode_tok_s", "rates_source", "score_s")]
        with path.open("w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(head)
            for row, d in enumerate(m.decisions):
                out = [m._first_number + row, f"{d.time - m.t0:.4f}", d.request_id, d.backend, int(d.pinned),
                       d.policy, d.budget]
                for b in self.backends:
                    try:
                        s = d.score_of(b)
                    except KeyError:
                        out += [""] * 7
                        continue
                    out += [s.cached_tokens, s.prefill_tokens, s.decode_tokens, s.rates.prefill_tok_s,
                            s.rates.decode_tok_s, s.rates.source, s.score_s]
                w.writerow(out)
        return path

    def _ask_export(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export routing decisions", "routing.csv", "CSV (*.csv)")
        if path:
            self.export_csv(path)

    def _follow(self, *_):
        bar = self.table.verticalScrollBar()
        if bar.value() >= bar.maximum() - 2 and not self.table.selectionModel().hasSelection():
            self.table.scrollToBottom()

    def presenter_changed(self, on: bool) -> None:
        """The presenter view (ui.presenter): the row count and Export make way for large type."""
        self.count_label.setVisible(not on)
        self.export_button.setVisible(not on)

    def show_run(self, run) -> None:
        """Say which phase `run` (a live demo) is in, above the table."""
        self.run_strip.attach(run)

    def _on_tick(self, tick) -> None:
        n = len(self.model.decisions)
        policy = self.engine.router.policy
        default = " (the default)" if policy == DEFAULT_POLICY else ""
        self.count_label.setText(f"{n} row{'s' if n != 1 else ''} · {policy}{default}" if n
                                 else f"no request yet · {policy}{default}")
        self.count_label.setToolTip(f"Rows shown; the routing policy in use is {policy}")
        self.change_marks.add(self.model._first_number + n - 0.5, self.changes.update(tick.snapshots, policy))
        if self._plot_dirty:
            self._plot_dirty = False
            self._redraw()

    def _redraw(self) -> None:
        ds = self.model.decisions
        t = np.arange(self.model._first_number, self.model._first_number + len(ds), dtype=float)
        self.plot.getAxis("bottom").setTickSpacing(*([count_axis_top(len(ds))[1]] * 2))
        for b, curve in self.curves.items():
            ys = np.array([_finite(_score_or_nan(d, b)) for d in ds], dtype=float)
            curve.setData(t, ys)
        spots = []
        for d, x in zip(ds, t):
            y = _finite(d.chosen.score_s)
            if math.isfinite(y):
                others = ", ".join(f"{s.name} {_secs(s.score_s)}" for s in d.scores if s.name != d.backend)
                tip = f"#{x:.0f} → {d.backend}: score {_secs(y)}" + (f" (beat {others})" if others else "")
                spots.append({"pos": (x, y), "brush": pg.mkBrush(self.colors.get(d.backend, "#fff")), "data": tip})
        self.marks.setData(spots)
        self.hint.set_empty(not spots)

    def restyle(self) -> None:
        """Repaint the text colours for the theme now in use: the table's backend names and the
        explanation (the plot follows the palette by itself)."""
        m = self.model
        if m.decisions:
            m.dataChanged.emit(m.index(0, 0), m.index(len(m.decisions) - 1, m.columnCount() - 1))
        m.headerDataChanged.emit(Qt.Orientation.Horizontal, 0, m.columnCount() - 1)
        current = self.table.selectionModel().currentIndex()
        if current.isValid() and current.row() < len(m.decisions):
            self._on_row(current, None)
        else:
            self._show_hint()

    def _show_hint(self) -> None:
        self.explain.setHtml(f"<p style='color:{palette().transcript.muted}'>Select a row to see why the request "
                             "went where it went.</p>")

    def _on_row(self, current, _previous) -> None:
        if not current.isValid() or current.row() >= len(self.model.decisions):
            return
        d = self.model.decisions[current.row()]
        self.explain.setHtml(explain_decision(d, self.colors, self.model._first_number + current.row()))
        self.selected_line.setPos(self.model._first_number + current.row())
        self.selected_line.setVisible(True)

    def select_row(self, row: int) -> None:
        self.table.selectRow(row)


def _score_or_nan(d, backend: str) -> float:
    try:
        return d.score_of(backend).score_s
    except KeyError:
        return math.nan


def _finite(x: float) -> float:
    return x if math.isfinite(x) else math.nan


def _tok(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _num_rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _secs(x: float) -> str:
    return "∞ s" if not math.isfinite(x) else f"{x:.3f} s"

