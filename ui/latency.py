"""The latency view: TTFT, end-to-end and inter-token step histograms per backend, with p50/p95
markers, and output throughput over time.

Histograms use fixed log-spaced edges (`ui.live_stats.EDGES`) and are drawn with
`stepMode="center"`, each backend's bar taking its own slice of the bin (`ui.axes.dodged_steps`)
so equal bins of two backends stand side by side; every curve and marker is created once and
only `setData`/`setPos` is called afterwards, from the bridge's tick (and only when a request
finished since the last redraw). Throughput comes from the decoded-token counts each tick
carries; its "total" line is drawn in the theme's text colour.

Axes fit their data: a histogram's x axis spans the bins in use (one bin of margin), its y axis
counts requests in whole numbers. An empty plot shows a sentence instead of made-up axes
(`ui.plot_marks.EmptyHint`); hovering a bin's point tells its count and range. Throughput is
timed from the view's first tick, with a mark wherever a cap, the policy or a backend's health
changed. A strip above the plots says which phase a demo is in (`ui.run_strip`).

The presenter view (`presenter_changed`) lays the four plots out two by two, with short axis
labels, a summary of one line per backend (the p95s in its tooltip) and tick labels thinned to
what the axis has room for.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QFont, QFontMetrics
from PySide6.QtWidgets import QGridLayout, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from .axes import count_axis_top, dodged_steps, log_ticks, occupied_log_range, thin_ticks
from .formatting import fmt_seconds
from .legend import add_legend
from .live_stats import EDGES, METRIC_TITLES, LatencyStore, RingSeries
from .plot_marks import LABEL_PT, ChangeMarks, ChangeTracker, EmptyHint, hover_tips
from .presenter import PLOT_PT, set_axis_labels
from .run_strip import RunStrip
from .theme import LEGEND_BG, backend_color, palette, qcolor, style_plot, wrap_label

THROUGHPUT_WINDOW_S = 120.0
SMOOTH_S = 2.0  # throughput is averaged over this many seconds
HIST_LABELS = ("log scale — p50 solid, p95 dashed", "requests")  # a histogram's x and y axis labels
TPUT_LABELS = ("time (s)", "tokens / s")
SHORT_HIST_LABELS = ("seconds, log scale", "requests")  # the presenter view's (p50/p95 in the summary)


class LatencyView(QWidget):
    def __init__(self, engine, bridge, parent: QWidget | None = None):
        super().__init__(parent)
        self.backends = engine.backend_names
        self.colors = {b: backend_color(i) for i, b in enumerate(self.backends)}
        self.store = LatencyStore(self.backends)
        self._drawn_version = -1
        hz = max(1, round(1000 / bridge.interval_ms))
        self._smooth = max(1, round(SMOOTH_S * hz))
        self._recent: dict[str, list[tuple[float, int]]] = {b: [] for b in self.backends}  # last `_smooth` ticks of (dt, tokens)
        self._series = RingSeries(int(THROUGHPUT_WINDOW_S * hz), len(self.backends) + 1)
        self._t0 = None
        self._router = engine.router
        self.changes = ChangeTracker()
        self.presenting = False
        self._build()
        bridge.finished.connect(self.add_record)
        bridge.tick.connect(self._on_tick)

    def _build(self) -> None:
        grid = QGridLayout()
        grid.setSpacing(6)
        self.hist_curves: dict[str, dict[str, pg.PlotDataItem]] = {}
        self.p_lines: dict[str, dict[str, tuple[pg.InfiniteLine, pg.InfiniteLine]]] = {}
        self.plots: dict[str, pg.PlotItem] = {}
        self.hints: dict[str, EmptyHint] = {}
        self.bin_points: dict[str, dict[str, pg.PlotDataItem]] = {}
        self.grid = grid
        self.plot_widgets: list[pg.PlotWidget] = []
        for metric in ("ttft", "e2e", "itl"):
            w = pg.PlotWidget()
            p = w.getPlotItem()
            style_plot(p, METRIC_TITLES[metric], *HIST_LABELS)
            p.setLogMode(x=True, y=False)
            add_legend(p, offset=(8, 8), labelTextSize="9pt", brush=LEGEND_BG)
            p.disableAutoRange()
            for axis in ("left", "bottom"):
                p.getAxis(axis).enableAutoSIPrefix(False)
            edges = EDGES[metric]
            self.plots[metric] = p
            self.hist_curves[metric] = {}
            self.p_lines[metric] = {}
            self.bin_points[metric] = {}
            zero = np.zeros(len(edges) - 1)
            for b in self.backends:
                c = self.colors[b]
                curve = p.plot(edges, zero, stepMode="center", fillLevel=0, brush=qcolor(c, 50),
                               pen=pg.mkPen(c, width=1.6), name=b)
                p50 = pg.InfiniteLine(angle=90, pen=pg.mkPen(c, width=1.3))
                p95 = pg.InfiniteLine(angle=90, pen=pg.mkPen(c, width=1.3, style=Qt.PenStyle.DashLine))
                for line in (p50, p95):
                    line.setVisible(False)
                    p.addItem(line, ignoreBounds=True)
                self.hist_curves[metric][b] = curve
                self.p_lines[metric][b] = (p50, p95)
                # one point on each bin in use, for its tooltip
                points = p.plot([], [], pen=None, symbol="o", symbolSize=6, symbolBrush=c, symbolPen=None)
                hover_tips(points.scatter, lambda _x, _y, data: data)
                self.bin_points[metric][b] = points
            self.hints[metric] = EmptyHint(p, "no request has finished yet")
            p.vb.sigResized.connect(lambda _vb, m=metric: self._fit_ticks(m))
            self.plot_widgets.append(w)

        w = pg.PlotWidget()
        p = self.throughput_plot = w.getPlotItem()
        style_plot(p, "Output throughput (2 s average)", *TPUT_LABELS)
        add_legend(p, offset=(8, 8), labelTextSize="9pt", brush=LEGEND_BG)
        p.enableAutoRange(x=True, y=False)
        for axis in ("left", "bottom"):
            p.getAxis(axis).enableAutoSIPrefix(False)
        self.tput_curves = []
        for b in self.backends:
            self.tput_curves.append(p.plot(pen=pg.mkPen(self.colors[b], width=1.6), name=b))
        self.tput_curves.append(p.plot(pen=_total_pen(), name="total"))
        self.tput_hint = EmptyHint(p, "no token decoded yet")
        self.marks = ChangeMarks(p)
        self.plot_widgets.append(w)
        self._place_plots(columns=4)
        self.run_strip = RunStrip()

        self.summary = wrap_label(QLabel())  # wraps rather than widening the window (the presenter's large type)
        self.summary.setTextFormat(Qt.TextFormat.RichText)
        self.clear_button = QPushButton("Clear")
        self.clear_button.setToolTip("Forget the latencies collected so far")
        self.clear_button.clicked.connect(self.clear)
        top = QHBoxLayout()
        top.addWidget(self.summary, 1)
        top.addWidget(self.clear_button, 0, Qt.AlignmentFlag.AlignTop)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(6, 6, 6, 6)
        outer.addWidget(self.run_strip)
        outer.addLayout(top)
        outer.addLayout(grid, 1)
        for metric in self.plots:
            self._fit_axes(metric, [])
        self.throughput_plot.setYRange(0, 1, padding=0)
        self._update_summary()

    # ---- data ----

    def add_record(self, record) -> None:
        if record.backend not in self.colors:
            return
        self.store.add(record)

    def clear(self) -> None:
        self.store.clear()

    def presenter_changed(self, on: bool) -> None:
        """The presenter view (ui.presenter): two plots by two, short axis labels, a one-line
        summary per backend, change labels in large type."""
        self.presenting = on
        self._place_plots(columns=2 if on else 4)
        for metric, p in self.plots.items():
            set_axis_labels(p, *(SHORT_HIST_LABELS if on else HIST_LABELS))
            self._fit_ticks(metric)
        self.marks.set_font_size(PLOT_PT if on else LABEL_PT)
        self._update_summary()

    def restyle(self) -> None:
        """The theme now in use: the "total" line in its text colour, the change labels."""
        self.tput_curves[-1].setPen(_total_pen())
        self.marks.restyle()

    def _place_plots(self, columns: int) -> None:
        for w in self.plot_widgets:
            self.grid.removeWidget(w)
        for k, w in enumerate(self.plot_widgets):
            self.grid.addWidget(w, k // columns, k % columns)

    def show_run(self, run) -> None:
        """Say which phase `run` (a live demo) is in, above the plots."""
        self.run_strip.attach(run)

    # ---- per tick ----

    def _on_tick(self, tick) -> None:
        if self._t0 is None:
            self._t0 = tick.time
        self.marks.add(tick.time - self._t0, self.changes.update(tick.snapshots, self._router.policy))
        totals = []
        for b in self.backends:
            r = self._recent[b]
            r.append((tick.dt, tick.decode_tokens.get(b, 0)))
            if len(r) > self._smooth:
                del r[0]
            secs = sum(x[0] for x in r)
            totals.append(sum(x[1] for x in r) / secs if secs > 0 else 0.0)
        self._series.append(tick.time - self._t0, (*totals, sum(totals)))
        for k, curve in enumerate(self.tput_curves):
            x, y = self._series.view(k)
            curve.setData(x, y)
        _, total = self._series.view(len(self.backends))
        peak = float(np.nanmax(total)) if total.size else 0.0
        if peak > 0:
            self.tput_hint.set_empty(False)
        self.throughput_plot.setYRange(0, max(peak * 1.15, 1.0), padding=0)
        if self.store.version != self._drawn_version:
            self._drawn_version = self.store.version
            self._redraw_histograms()

    def _redraw_histograms(self) -> None:
        for metric, curves in self.hist_curves.items():
            edges = EDGES[metric]
            hists = {b: self.store.histogram(metric, b) for b in curves}
            for k, (b, curve) in enumerate(curves.items()):
                x, y = dodged_steps(edges, hists[b], k, len(curves))
                curve.setData(x, y)
                used = np.flatnonzero(hists[b] > 0)
                lo, hi = (x[0::2], x[1::2]) if len(curves) > 1 else (edges[:-1], edges[1:])
                centres = np.sqrt(lo[used] * hi[used])  # geometric: the bar's middle on a log axis
                tips = [f"{b}: {int(hists[b][i])} request{'s' if hists[b][i] != 1 else ''} at "
                        f"{fmt_seconds(edges[i])} – {fmt_seconds(edges[i + 1])}" for i in used]
                self.bin_points[metric][b].setData(centres, hists[b][used], data=tips)
                p50, p95 = self.store.percentiles(metric, b)
                for line, v in zip(self.p_lines[metric][b], (p50, p95)):
                    if math.isfinite(v) and v > 0:
                        line.setPos(math.log10(v))  # the axis is log10(seconds)
                        line.setVisible(True)
                    else:
                        line.setVisible(False)
            self._fit_axes(metric, list(hists.values()))
        self._update_summary()

    def _fit_axes(self, metric: str, hists) -> None:
        p = self.plots[metric]
        span = occupied_log_range(hists, EDGES[metric])
        self.hints[metric].set_empty(span is None)
        if span is None:  # nothing yet: the hint says so, the axes are hidden
            span = (-3.0, 1.0)
        p.setXRange(*span, padding=0)
        self._fit_ticks(metric)
        top, step = count_axis_top(max((float(h.max()) for h in hists if len(h)), default=0.0))
        p.setYRange(0, top, padding=0)
        p.getAxis("left").setTickSpacing(step, step)

    def _fit_ticks(self, metric: str) -> None:
        """A histogram's time ticks: 1-2-5 steps, thinned until their labels stand apart."""
        p = self.plots[metric]
        (lo, hi), _ = p.viewRange()
        axis = p.getAxis("bottom")
        fm = QFontMetrics(axis.style.get("tickFont") or QFont())
        ticks = thin_ticks(log_ticks(lo, hi), lo, hi, axis.width(), fm.horizontalAdvance)
        axis.setTicks([ticks, []])

    def _update_summary(self) -> None:
        parts, tips = [], []
        for b in self.backends:
            n = self.store.finished.get(b, 0)
            bits = [f"<b style='color:{self.colors[b]}'>{b}</b> {n} done"]
            short_bits = list(bits)
            if self.store.failed.get(b):
                bits.append(f"{self.store.failed[b]} stopped/failed")
                short_bits.append(f"{self.store.failed[b]} failed")
            for metric, short in (("ttft", "TTFT"), ("e2e", "E2E"), ("itl", "ITL")):
                p50, p95 = self.store.percentiles(metric, b)
                bits.append(f"{short} p50 {fmt_seconds(p50)} / p95 {fmt_seconds(p95)}")
                short_bits.append(f"{short} p50 {fmt_seconds(p50)}")
            parts.append(" · ".join(short_bits if self.presenting else bits))
            tips.append(" · ".join(bits))
        self.summary.setText("<br>".join(parts))
        self.summary.setToolTip("<br>".join(tips) + "<br>p50: half the requests took less; p95: all but one in "
                                "twenty. In the plots: p50 solid, p95 dashed.")


def _total_pen():
    """The throughput's "total" line: dashed, in the theme's text colour (visible on both)."""
    return pg.mkPen(palette().text, width=1.6, style=Qt.PenStyle.DashLine)
