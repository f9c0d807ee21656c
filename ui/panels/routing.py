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
from PySide6.QtGui import QBrush, QColor, QFont, QFontMetrics
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

from ..model.axes import count_axis_top
from ..model.changes import ChangeTracker
from ..model.formatting import fmt_rate
from ..plots.legend import add_legend
from ..theme import LEGEND_BG, MUTED, backend_color, palette, style_plot
from .plot_marks import LABEL_PT, ChangeMarks, EmptyHint, hover_tips
from .presenter import PLOT_PT, PRESENTER_PT, set_axis_labels
from .run_strip import RunStrip

# Per backend: the score's terms. The rates it priced them at are in each cell's tooltip, the
# explanation and the CSV (a column of them pushed the table past a 1080p window's width).
TERMS = ("cached", "prefill", "decode", "score")
UNITS = {"cached": "tok", "prefill": "tok", "decode": "tok", "rates": "tok/s", "score": "s"}
FIXED = ("#", "t", "chosen")  # the request's id is the row's tooltip (and in the CSV)
BACKEND_COLUMN = FIXED.index("chosen")
ROW_PT = 10  # the table's type outside the presenter view (the app's style sheet)
CELL_PAD = 20  # px a cell's text needs beside it: the item's margins and the grid line
AXIS_LABELS = ("request # (table row)", "score (s)")  # the score plot's x and y axes
MAX_ROWS = 5000
DETAILS_LINK = "#arithmetic"  # the explanation's link to the whole arithmetic (the presenter view's)


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

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation != Qt.Orientation.Horizontal:
            return None
        if role == Qt.ItemDataRole.DisplayRole:
            if section < len(FIXED):
                return FIXED[section]
            b, t = divmod(section - len(FIXED), len(TERMS))
            return f"{self.backends[b]}\n{TERMS[t]}\n{UNITS[TERMS[t]]}"
        if role == Qt.ItemDataRole.ForegroundRole and section >= len(FIXED):
            b = (section - len(FIXED)) // len(TERMS)
            return QBrush(_text_color(self._colors[self.backends[b]]))
        if role == Qt.ItemDataRole.ToolTipRole and section >= len(FIXED):
            t = TERMS[(section - len(FIXED)) % len(TERMS)]
            return {
                "cached": "prompt tokens of the new request already in this backend's prefix cache",
                "prefill": "prompt tokens left to compute: queued + running + the new request (minus cached)",
                "decode": "decode-token budget: unused max_tokens of every request there + the new one",
                "score": "prefill/rate + decode/rate in seconds; lower wins (a cell's tooltip has the rates)",
            }[t]
        return None

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        d = self.decisions[index.row()]
        col = index.column()
        if col < len(FIXED):
            if role == Qt.ItemDataRole.DisplayRole:
                return [
                    str(self._first_number + index.row()),
                    f"{d.time - self.t0:.2f} s",
                    d.backend + (" (pinned)" if d.pinned else "") + (" · embedding" if d.kind == "embedding" else ""),
                ][col]
            if role == Qt.ItemDataRole.ForegroundRole and col == BACKEND_COLUMN and d.backend in self._colors:
                return QBrush(_text_color(self._colors[d.backend]))
            if role == Qt.ItemDataRole.ToolTipRole:
                return f"{d.request_id} · {d.policy}: {d.reason}"
            if role == Qt.ItemDataRole.TextAlignmentRole and col in (0, 1):
                return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            return None
        b, t = divmod(col - len(FIXED), len(TERMS))
        name = self.backends[b]
        try:
            s = d.score_of(name)
        except KeyError:
            return None
        if role == Qt.ItemDataRole.DisplayRole:
            return score_term(s, TERMS[t])
        if role == Qt.ItemDataRole.BackgroundRole and name == d.backend:
            return QBrush(QColor(palette().chosen_bg))  # the theme in use
        if role == Qt.ItemDataRole.TextAlignmentRole:
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        if role == Qt.ItemDataRole.ToolTipRole:
            return explain_score(s)
        return None


def presenter_column(col: int) -> bool:
    """Whether the presenter view shows column `col`: #, the chosen backend, each score."""
    if col < len(FIXED):
        return FIXED[col] != "t"
    return TERMS[(col - len(FIXED)) % len(TERMS)] == "score"


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


def explain_decision(d, colors: dict | None = None, details: bool = True, number: int | None = None) -> str:
    """The selected decision in words (HTML), in the theme in use's text colours (`colors`: each
    backend's plot colour): who won and by how much in a sentence, the work queued on each;
    then, with `details` (else behind a "Show the arithmetic" link, `DETAILS_LINK`), every
    backend's sum, the policy, the decode budget and the router's own record. `number`: the
    row's number in the table, which names the request there (the engine's id is the row's
    tooltip)."""
    pal = palette()
    colors = {name: pal.transcript.backend(c) for name, c in (colors or {}).items()}
    muted, plain = pal.transcript.muted, pal.text

    def name(s: str) -> str:
        return f"<b style='color:{colors.get(s, plain)}'>{html.escape(s)}</b>"

    request = f"#{number}" if number is not None else html.escape(d.request_id)
    head = f"<b>{request}</b> → {name(d.backend)}"
    out = f"<p style='font-size:large'>{head}</p><p>{decision_sentence(d, name)}</p>"
    if not details:
        return out + f"<p><a href='{DETAILS_LINK}' style='color:{pal.transcript.user}'>Show the arithmetic</a></p>"
    budget = d.budget + (f", new_token_ratio {d.new_token_ratio:.2f}" if d.new_token_ratio is not None else "")
    rows = "".join(f"<li><span style='color:{colors.get(s.name, plain)}'>■</span> {html.escape(explain_score(s))}</li>"
                   for s in d.scores)
    return (out + f"<p style='color:{muted}'>policy {html.escape(d.policy)} · decode budget {html.escape(budget)}</p>"
            f"<ul style='margin-left:-20px'>{rows}</ul>"
            f"<p style='color:{muted}'>Router's record: {html.escape(d.reason)}</p>")


def decision_sentence(d, name=html.escape) -> str:
    """Why `d` went where it went, in a sentence or two (HTML; `name(backend)` writes a name):
    the winner's score against the others' (lower wins), then the work queued on each."""
    chosen = d.chosen
    others = sorted((s for s in d.scores if s.name != d.backend), key=lambda s: s.score_s)
    if d.pinned:
        return f"The request named {name(d.backend)} itself: the policy was not asked."
    if not others:
        return f"{name(d.backend)} is the only backend: it takes every request."
    tie = others[0].score_s == chosen.score_s
    against = ", ".join(f"{name(o.name)} {_secs(o.score_s)}" for o in others)
    verdict = (f"{name(d.backend)} and {name(others[0].name)} score the same, {_secs(chosen.score_s)}; "
               f"{name(d.backend)} takes it." if tie and len(others) == 1 else
               f"{name(d.backend)} scores {_secs(chosen.score_s)} against {against}: the lower score wins.")
    queued = "; ".join(f"{name(s.name)} {_tok(s.prefill_tokens)} + {_tok(s.decode_tokens)}"
                       for s in [chosen, *others])
    return f"{verdict} Tokens to prefill + decode there: {queued}."


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
        self._explain_newest = False
        self._to_bottom = False
        self._presenting = False
        self._pinned_seen = False  # a row says "(pinned)": the chosen column makes room for it
        self._build()
        for d in engine.router.recent():  # decisions made before the view existed
            if d.time >= self.t0 - 3600:
                self.add_decision(d)
        bridge.routed.connect(self.add_decision)
        bridge.tick.connect(self._on_tick)

    def _build(self) -> None:
        self._build_table()
        self._build_plot()

        self.explain = QTextBrowser()
        self.explain.setOpenLinks(False)
        self.explain.anchorClicked.connect(self._on_link)
        self._details = True  # the whole arithmetic under the sentence (the presenter view folds it)
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
        right = self.right_split = QSplitter(Qt.Orientation.Vertical)
        right.addWidget(self.plot_widget)
        right.addWidget(self.explain)
        right.setSizes([260, 170])
        split = self.split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(left)
        split.addWidget(right)
        split.setSizes([900, 600])
        outer = QVBoxLayout(self)
        outer.setContentsMargins(6, 6, 6, 6)
        outer.addWidget(split)

    def _build_table(self) -> None:
        """The decisions, one row each, every column sharing the table's width."""
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

    def _build_plot(self) -> None:
        """Each backend's score per request, the chosen one marked, the selected row's line."""
        self.plot_widget = pg.PlotWidget()
        p = self.plot = self.plot_widget.getPlotItem()
        # x is the row number: arrivals evenly spaced however far apart in time (a chat long before a run).
        style_plot(p, "Each backend's score per request (lower wins)", *AXIS_LABELS)
        add_legend(p, offset=(8, 8), labelTextSize="9pt", brush=LEGEND_BG)
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

    # ---- updates ----

    def add_decision(self, decision) -> None:
        self._pinned_seen = self._pinned_seen or decision.pinned
        self.model.add(decision)
        self._plot_dirty = True

    def clear(self) -> None:
        self._pinned_seen = False
        self.model.clear()
        self._plot_dirty = True
        self._show_hint()

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
        if not self.table.selectionModel().hasSelection():
            if bar.value() >= bar.maximum() - 2:
                self.table.scrollToBottom()
                self._to_bottom = True  # again on the tick, once the view has laid the new row out
            self._explain_newest = True  # the explanation follows the newest row (drawn on the tick)
        if self._presenting:
            self._fit_fixed_columns()  # a row number with one more digit

    def presenter_changed(self, on: bool) -> None:
        """The presenter view (ui.panels.presenter): the table shows #, the chosen backend and each
        backend's score (the rest is in each cell's tooltip and the explanation), rows as tall as
        the large type, the explanation a sentence with the arithmetic behind a link and tall
        enough to read whole; the row count and Export make way."""
        self.count_label.setVisible(not on)
        self.export_button.setVisible(not on)
        for col in range(self.model.columnCount()):
            self.table.setColumnHidden(col, on and not presenter_column(col))
        self._presenting = on
        font = QFont(self.table.font())
        font.setPointSize(PRESENTER_PT if on else ROW_PT)
        self._fit_fixed_columns()
        self.table.verticalHeader().setDefaultSectionSize(max(22, QFontMetrics(font).height() + 8) if on else 22)
        self.table.setTextElideMode(Qt.TextElideMode.ElideNone if on else Qt.TextElideMode.ElideMiddle)
        self._details = not on
        self.change_marks.set_font_size(PLOT_PT if on else LABEL_PT)
        set_axis_labels(self.plot, *(("request #", "score (s)") if on else AXIS_LABELS))
        self._refresh_explanation()
        if on:  # the table as wide as its few columns, the explanation as tall as a few lines
            fm = QFontMetrics(font)
            need = sum(self._fixed_widths()) + len(self.backends) * (fm.horizontalAdvance("00000.0") + CELL_PAD) + 24
            total = max(self.split.width(), 1200)
            self.split.setSizes([min(need, total // 2), total - min(need, total // 2)])
            lines = fm.lineSpacing()
            height = max(self.right_split.height(), 560)
            text = min(height // 2, 7 * lines + 24)
            self.right_split.setSizes([height - text, text])
        else:
            self.split.setSizes([900, 600])
            self.right_split.setSizes([260, 170])

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
        if self._explain_newest:
            self._explain_newest = False
            if not self.table.selectionModel().hasSelection():
                self._refresh_explanation()
                if self._to_bottom:
                    self.table.scrollToBottom()
            self._to_bottom = False
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
        self._refresh_explanation()

    def _show_hint(self) -> None:
        self.explain.setHtml(f"<p style='color:{palette().transcript.muted}'>Select a row to see why the request "
                             "went where it went.</p>")

    def _on_row(self, current, _previous) -> None:
        if not current.isValid() or current.row() >= len(self.model.decisions):
            return
        d = self.model.decisions[current.row()]
        number = self.model._first_number + current.row()
        self.explain.setHtml(explain_decision(d, self.colors, self._details, number))
        self.selected_line.setPos(self.model._first_number + current.row())
        self.selected_line.setVisible(True)

    def _fixed_widths(self) -> tuple[int, int]:
        """The presenter view's widths of # and chosen in its large type: the largest row number
        (at least 4 digits), the longest backend name ("(pinned)" added once a row has it), or
        their headings if wider."""
        font = QFont(self.table.font())
        font.setPointSize(PRESENTER_PT)
        fm = QFontMetrics(font)
        digits = max(4, len(str(self.model._first_number + max(len(self.model.decisions), 1) - 1)))
        pinned = " (pinned)" if self._pinned_seen else ""
        name = max((b + pinned for b in self.backends), key=fm.horizontalAdvance)
        h = self.table.horizontalHeader()
        return (max(fm.horizontalAdvance("0" * digits) + CELL_PAD, h.sectionSizeFromContents(0).width()),
                max(fm.horizontalAdvance(name) + CELL_PAD, h.sectionSizeFromContents(BACKEND_COLUMN).width()))

    def _fit_fixed_columns(self) -> None:
        """# and chosen: as wide as their text in the presenter view, a share of the width else."""
        h = self.table.horizontalHeader()
        mode = QHeaderView.ResizeMode.Fixed if self._presenting else QHeaderView.ResizeMode.Stretch
        for col, width in zip((0, BACKEND_COLUMN), self._fixed_widths()):
            h.setSectionResizeMode(col, mode)
            if self._presenting and h.sectionSize(col) != width:
                h.resizeSection(col, width)

    def _refresh_explanation(self) -> None:
        """The explanation again: the selected row's, else the newest row's, else the hint."""
        current = self.table.selectionModel().currentIndex()
        if current.isValid() and current.row() < len(self.model.decisions):
            self._on_row(current, None)
        elif self.model.decisions:
            d = self.model.decisions[-1]
            number = self.model._first_number + len(self.model.decisions) - 1
            self.explain.setHtml(explain_decision(d, self.colors, self._details, number))
        else:
            self._show_hint()

    def _on_link(self, url) -> None:
        """The explanation's "Show the arithmetic" link: the whole of it, until the view changes."""
        if url.toString() == DETAILS_LINK:
            self._details = True
            self._refresh_explanation()

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

