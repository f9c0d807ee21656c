"""Teaching: the study's worked example replayed through the real router, step by step.

Part 1 renders `engine.sim.teaching`: the backend states the article describes at requests 7 and 8,
routed by `engine.routing.Router` under `seed-score`, and every number the narration shows (3.027 s
stays on the GPU; 3.444 s > 3.118 s goes to the CPU). This module only turns those numbers into
HTML and a bar chart; editing a rate or the cached prefix re-runs the engine's replay and the
verdicts move.

Part 2 sends the same eight arrivals (516-token prompts sharing a warmed 496-token prefix,
128 tokens each, 50 ms apart) to this machine's backends and lists where each went next to
where the article's went (its warming says how long is left; a prefix already cached, as after a
lesson's load, is not warmed again). Pause / Step beside Run live (`ui.run_controls.RunControls`, the
same run methods as the Run menu's F6 / F7) hold back or send the live run's arrivals; they are
on only while the live run is under way.

Part 3, the "What if" tab (`ui/panels/whatif.py`), runs the study or a grid row on simulated hardware
(`engine.sim.simulate`) beside a live run on this machine.

Thread contract: main thread only (a widget); the live run reports through `WorkloadRun`'s signals.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Mapping

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from engine.core.snapshot import Rates
from engine.sim.teaching import (
    ARRIVAL_GAP_S,
    ARTICLE_CHOICES,
    ARTICLE_RATES,
    CACHED,
    CAP,
    MAX_TOKENS,
    PROMPT,
    Arrival,
    Step,
    boundary,
    gpu_sum,
    score_formula,
    study_arrivals,
    teaching_steps,
    verdict,
)

from ..live_run import STUDY, WorkloadRun
from ..model.formatting import warm_eta, warm_left_text
from ..theme import (
    LEGEND_BG,
    MUTED,
    WORKING,
    backend_color,
    palette,
    qcolor,
    scrollable_column,
    style_plot,
    wrap_label,
)
from .presenter import TITLE_PT
from .run_controls import RunControls
from .whatif import WhatIfPanel

GPU_COLOR, CPU_COLOR = backend_color(0), backend_color(1)


# ---- step texts ----


def _fill(color: str) -> str:
    """A cell fill: `color` at 35 % over the theme's background (text stays readable on both)."""
    c, bg = QColor(color), QColor(palette().plot_bg)
    return QColor(*(round(0.35 * x + 0.65 * y) for x, y in
                    zip((c.red(), c.green(), c.blue()), (bg.red(), bg.green(), bg.blue())))).name()


def _queue_html(a: Arrival) -> str:
    """The GPU's slots and queue as coloured cells (each waiting request: prompt tokens left + budget)."""
    left = a.prompt_left
    running, queued = _fill(GPU_COLOR), _fill(WORKING)
    cells = "".join(f"<td bgcolor='{running}' align='center'>&nbsp;running&nbsp;<br><b>{a.gpu_left}</b> left&nbsp;</td>"
                    for _ in range(CAP))
    queue = "".join(f"<td bgcolor='{queued}' align='center'>&nbsp;queued&nbsp;<br>{left} + <b>{MAX_TOKENS}</b>&nbsp;</td>"
                    for _ in range(a.gpu_queued))
    new = (f"<td bgcolor='{palette().chosen_bg}' align='center'>&nbsp;<b>new</b>&nbsp;<br>{left} + "
           f"{MAX_TOKENS}&nbsp;</td>")
    return (f"<table cellspacing='4' cellpadding='3'><tr><td><b style='color:{GPU_COLOR}'>GPU</b>&nbsp;</td>"
            f"{cells}<td>&nbsp;|&nbsp;</td>{queue}<td>&nbsp;+&nbsp;</td>{new}</tr>"
            f"<tr><td><b style='color:{CPU_COLOR}'>CPU</b></td><td colspan='{CAP}' style='color:{MUTED}'>idle: "
            f"nothing running, nothing queued</td></tr></table>")


def _gpu_sum_html(a: Arrival) -> str:
    t = gpu_sum(a)
    s = t.score
    return (
        f"<p><b style='color:{GPU_COLOR}'>GPU</b> prefill: {t.queued} queued × {t.prompt_left} + new {t.prompt_left} = "
        f"<b>{s.prefill_tokens:.0f}</b> tokens → {s.prefill_tokens:.0f} / {s.rates.prefill_tok_s:g} = {s.prefill_s:.3f} s</p>"
        f"<p><b style='color:{GPU_COLOR}'>GPU</b> decode budget: {t.queued} queued × {MAX_TOKENS} + {CAP} running × "
        f"{a.gpu_left} + new {MAX_TOKENS} = {t.queued_budget} + {t.running_budget} + {t.new_budget} = "
        f"<b>{s.decode_tokens:.0f}</b> tokens → {s.decode_tokens:.0f} / {s.rates.decode_tok_s:g} = {s.decode_s:.3f} s</p>"
        f"<p style='font-size:large'>GPU score = {score_formula(s)} = <b>{s.score_s:.3f} s</b></p>"
    )


def _cpu_sum_html(a: Arrival) -> str:
    c = a.cpu
    return (f"<p style='font-size:large'><b style='color:{CPU_COLOR}'>CPU</b> (idle) score = "
            f"{score_formula(c)} = {c.prefill_s:.3f} + {c.decode_s:.3f} = <b>{c.score_s:.3f} s</b></p>")


def _verdict_html(a: Arrival) -> str:
    v = verdict(a)
    if v.stays_on_gpu:
        rel = "&lt;" if v.relation == "<" else "="
        text = f"{v.gpu_s:.3f} s {rel} {v.cpu_s:.3f} s: request {v.number} <b>stays on the GPU</b>"
        color = GPU_COLOR
    else:
        text = f"{v.gpu_s:.3f} s &gt; {v.cpu_s:.3f} s: the <b>CPU takes request {v.number}</b>"
        color = CPU_COLOR
    return (f"<p style='font-size:x-large;color:{color}'>{text}</p>"
            f"<p style='color:{MUTED}'>Router's record: {html.escape(v.reason)}</p>")


def _setup_html(rates: Mapping[str, Rates], cached: int) -> str:
    g, c = rates["gpu"], rates["cpu"]
    return (
        f"<p>Two backends serve one model: a <b style='color:{GPU_COLOR}'>GPU</b> and a <b style='color:{CPU_COLOR}'>CPU</b>, "
        f"each with its own queue, a cap of {CAP} running requests and its own prefix cache.</p>"
        f"<p>Every request is a {PROMPT}-token prompt whose first {cached} tokens are already cached on both backends, "
        f"so only {PROMPT - cached} prompt tokens are left to compute; each generates {MAX_TOKENS} tokens. "
        f"Requests arrive every {ARRIVAL_GAP_S * 1000:.0f} ms.</p>"
        "<p>The router sends each <i>whole</i> request to the backend with the lowest score:</p>"
        "<p style='font-size:large' align='center'><b>score = prefill tokens left / prefill rate + "
        "decode budget left / decode rate</b></p>"
        f"<p>Rates (each backend profiled alone): GPU prefill {g.prefill_tok_s:g} tok/s, decode {g.decode_tok_s:g} tok/s; "
        f"CPU prefill {c.prefill_tok_s:g} tok/s, decode {c.decode_tok_s:g} tok/s.</p>"
        "<p>The decode term counts the unused <i>budget</i> (max_tokens), not a guess of the real output length.</p>"
    )


def _arrival_html(a: Arrival, later: bool) -> str:
    extra = ("<p>Since request 7, the 4 running requests have used 2 more tokens of budget each, "
             "and the queue has grown by one.</p>" if later else "")
    return (f"<p>What the router sees when request {a.number} arrives:</p>{_queue_html(a)}{extra}"
            f"<p>Each queued request still has {a.prompt_left} prompt tokens to compute and its "
            f"full {MAX_TOKENS}-token budget; each running one has {a.gpu_left} tokens of budget left.</p>")


def _boundary_html(arrivals: tuple[Arrival, Arrival], rates: Mapping[str, Rates]) -> str:
    b = boundary(arrivals, rates)
    return (
        "<p>A full GPU (all 4 slots busy at request 7) was not enough to send work to the CPU: the cached prefix made "
        "the CPU's prefill cheap, and only when enough decode budget piled up on the GPU did its score pass the "
        "CPU's.</p>"
        f"<p>Request 8 would have stayed on the GPU if the GPU decoded at ≥ <b>{b.keep_decode_tok_s:.0f} tok/s</b> "
        f"(it is {b.gpu_decode_tok_s:g}).</p>"
        f"<p>Without the cached prefix the idle CPU would score {b.uncached_cpu_formula} = "
        f"<b>{b.uncached_cpu_s:.3f} s</b>, and the GPU would keep everything.</p>"
        "<p>Change a rate or the cached prefix on the left and step again: every number here is recomputed by the "
        "real router. Then run the same eight arrivals on this machine below.</p>"
    )


def step_html(step: Step, arrivals: tuple[Arrival, Arrival], rates: Mapping[str, Rates], cached: int) -> str:
    """The HTML body of one step of `engine.sim.teaching.teaching_steps`."""
    if step.kind == "setup":
        return _setup_html(rates, cached)
    if step.kind == "boundary":
        return _boundary_html(arrivals, rates)
    assert step.arrival is not None
    a = arrivals[step.arrival]
    if step.kind == "arrival":
        return _arrival_html(a, later=step.arrival > 0)
    if step.kind == "gpu-score":
        return _queue_html(a) + _gpu_sum_html(a)
    if step.kind == "verdict":
        return _gpu_sum_html(a) + _cpu_sum_html(a) + _verdict_html(a)
    raise ValueError(f"unknown teaching step kind {step.kind!r}")


# ---- the panel ----


class TeachingPanel(QWidget):
    status_message = Signal(str)

    def __init__(self, engine, bridge, parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        self.bridge = bridge
        self.step = 0
        self.run: WorkloadRun | None = None
        self._warm_since: float | None = None  # monotonic, when the live run began flushing
        self._shown_live = -1
        self._play = QTimer(self)
        self._play.setInterval(2500)
        self._play.timeout.connect(self._auto_next)
        self._build()
        self.recompute()
        bridge.tick.connect(self._on_tick)

    # ---- layout ----

    def _build(self) -> None:
        # Inputs: the article's numbers, editable.
        inputs = QGroupBox("The article's numbers")
        inputs.setToolTip("Edit a rate or the cached prefix: every step is recomputed by the real router")
        f = QFormLayout(inputs)
        self.gpu_prefill = _spin(ARTICLE_RATES["gpu"].prefill_tok_s)
        self.gpu_decode = _spin(ARTICLE_RATES["gpu"].decode_tok_s)
        self.cpu_prefill = _spin(ARTICLE_RATES["cpu"].prefill_tok_s)
        self.cpu_decode = _spin(ARTICLE_RATES["cpu"].decode_tok_s)
        self.cached = QSpinBox(minimum=0, maximum=PROMPT - 1, value=CACHED)
        self.cached.setSuffix(f" of {PROMPT}")
        for w in (self.gpu_prefill, self.gpu_decode, self.cpu_prefill, self.cpu_decode, self.cached):
            w.valueChanged.connect(self.recompute)
        f.addRow(f"<span style='color:{GPU_COLOR}'>GPU</span> prefill tok/s", self.gpu_prefill)
        f.addRow(f"<span style='color:{GPU_COLOR}'>GPU</span> decode tok/s", self.gpu_decode)
        f.addRow(f"<span style='color:{CPU_COLOR}'>CPU</span> prefill tok/s", self.cpu_prefill)
        f.addRow(f"<span style='color:{CPU_COLOR}'>CPU</span> decode tok/s", self.cpu_decode)
        f.addRow("Cached prefix", self.cached)
        reset = QPushButton("Article's values")
        reset.clicked.connect(self.reset_inputs)
        f.addRow(reset)

        self.chart = pg.PlotWidget()
        p = self.chart.getPlotItem()
        style_plot(p, "The new request's score", "", "seconds")
        p.setMouseEnabled(False, False)
        p.hideButtons()
        p.getAxis("bottom").setTicks([[(0, "GPU"), (1, "CPU")]])
        p.setXRange(-0.6, 1.6, padding=0)
        # Stacked bars: prefill (light) under decode (strong); created once, updated with setOpts.
        self.bar_prefill = pg.BarGraphItem(x=[0, 1], height=[0, 0], width=0.55,
                                           brushes=[qcolor(GPU_COLOR, 110), qcolor(CPU_COLOR, 110)], pen=None)
        self.bar_decode = pg.BarGraphItem(x=[0, 1], y0=[0, 0], height=[0, 0], width=0.55,
                                          brushes=[qcolor(GPU_COLOR, 230), qcolor(CPU_COLOR, 230)], pen=None)
        p.addItem(self.bar_prefill)
        p.addItem(self.bar_decode)
        # The bars' colours are per backend: the legend explains the light/strong halves.
        legend = p.addLegend(offset=(6, 4), labelTextSize="8pt", brush=LEGEND_BG, colCount=2)  # one row, top left
        for name, alpha in (("prefill", 110), ("decode", 230)):
            legend.addItem(pg.BarGraphItem(x=[0], height=[0], width=1, brush=qcolor("#c8ccd4", alpha), pen=None),
                           name)
        self.bar_labels = [pg.TextItem(anchor=(0.5, 1.0), color=palette().text) for _ in range(2)]
        for t in self.bar_labels:
            p.addItem(t)
        self.cpu_line = pg.InfiniteLine(angle=0, pen=pg.mkPen(CPU_COLOR, width=1, style=Qt.PenStyle.DashLine))
        p.addItem(self.cpu_line)

        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(0, 0, 0, 0)
        lv.addWidget(inputs)
        lv.addStretch(1)
        self.chart.setMinimumSize(200, 150)

        # The steps.
        self.step_title = QLabel()
        self.step_title.setObjectName("big")
        self.step_count = QLabel()
        self.step_count.setObjectName("muted")
        self.text = QTextBrowser()
        self.back_button = QPushButton("◀ Back")
        self.back_button.clicked.connect(self.back)
        self.next_button = QPushButton("Next ▶")
        self.next_button.setObjectName("primary")
        self.next_button.clicked.connect(self.next)
        self.play_button = QPushButton("▶ Play")
        self.play_button.setCheckable(True)
        self.play_button.toggled.connect(self._toggle_play)
        self.restart_button = QPushButton("⟲ Restart")
        self.restart_button.clicked.connect(lambda: self.go(0))
        nav = QHBoxLayout()
        nav.addWidget(self.restart_button)
        nav.addWidget(self.play_button)
        nav.addStretch(1)
        nav.addWidget(self.step_count)
        nav.addWidget(self.back_button)
        nav.addWidget(self.next_button)
        wrap_label(self.step_title)
        middle = QWidget()
        mv = QVBoxLayout(middle)
        mv.setContentsMargins(0, 0, 0, 0)
        mv.addWidget(self.step_title)
        body = QSplitter(Qt.Orientation.Horizontal)  # the step's text with its chart beside it (fits a short screen)
        body.addWidget(self.text)
        body.addWidget(self.chart)
        body.setStretchFactor(0, 3)
        body.setStretchFactor(1, 2)
        body.setSizes([440, 260])
        body.setChildrenCollapsible(False)
        mv.addWidget(body, 1)
        mv.addLayout(nav)

        # Live: the same eight arrivals on this machine.
        live = QGroupBox("The same 8 arrivals on this machine's backends")
        lv2 = QVBoxLayout(live)
        row = QHBoxLayout()
        self.live_button = QPushButton("Run live")
        self.live_button.setObjectName("primary")
        self.live_button.setToolTip("Warm a 496-token prefix on every backend, then send 8 requests of "
                                    "516 tokens (128 generated each), 50 ms apart, with the current policy and rates")
        self.live_button.clicked.connect(self.run_live)
        self.article_rates_button = QPushButton("Price with the article's rates")
        self.article_rates_button.setToolTip("Give this machine's backends the article's rates (a GPU backend, or "
                                             "the first one, gets the GPU's; the others the CPU's) so the router "
                                             "prices work as in the article while the queues are real")
        self.article_rates_button.clicked.connect(self.use_article_rates)
        # A narrow row: the tooltips say the rest, the progress bar and the note the state.
        self.run_controls = RunControls(pause_text="Pause", state=False)
        self.run_controls.status_message.connect(self.status_message.emit)
        self.live_progress = QProgressBar()
        self.live_progress.setMaximum(STUDY.n_requests)
        self.live_progress.setFormat("%v / %m done")
        self.live_progress.setMinimumWidth(70)
        row.addWidget(self.live_button)
        row.addWidget(self.article_rates_button)
        row.addWidget(self.run_controls, 1)
        row.addWidget(self.live_progress, 1)
        lv2.addLayout(row)
        names = self.engine.backend_names
        self.live_table = QTableWidget(STUDY.n_requests, 3 + len(names))
        self.live_table.setHorizontalHeaderLabels(["article", "here", "cached", *names])
        for k, n in enumerate(names):
            if (header := self.live_table.horizontalHeaderItem(3 + k)) is not None:
                header.setToolTip(f"{n}'s score for the request (seconds)")
        self.live_table.setVerticalHeaderLabels([f"req {i + 1}" for i in range(STUDY.n_requests)])
        self.live_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.live_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.live_table.verticalHeader().setDefaultSectionSize(18)
        for i, b in enumerate(ARTICLE_CHOICES):
            item = QTableWidgetItem(f"{b.upper()}")
            item.setForeground(qcolor(GPU_COLOR if b == "gpu" else CPU_COLOR))
            self.live_table.setItem(i, 0, item)
        self.live_note = QLabel("Change caps, rates or the policy in Controls, then run again to see where "
                                "the boundary falls here.")
        self.live_note.setObjectName("muted")
        wrap_label(self.live_note)
        lv2.addWidget(self.live_table, 1)
        lv2.addWidget(self.live_note)

        split = self.split = QSplitter(Qt.Orientation.Horizontal)
        self.inputs_area = scrollable_column(left)
        split.addWidget(self.inputs_area)
        split.addWidget(middle)
        split.addWidget(live)
        split.setSizes([250, 600, 430])
        # Two tabs: the article's worked example, and what if the hardware were different.
        self.whatif = WhatIfPanel(self.engine, self.bridge, self)
        self.whatif.status_message.connect(self.status_message)
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)  # no frame: the live table keeps its 8 rows at 1280x720
        self.tabs.addTab(split, "The article")
        self.tabs.addTab(self.whatif, "What if")
        outer = QVBoxLayout(self)
        outer.setContentsMargins(2, 2, 2, 2)
        outer.addWidget(self.tabs)

    # ---- article replay ----

    def rates(self) -> dict:
        return {"gpu": Rates(self.gpu_prefill.value(), self.gpu_decode.value(), source="article"),
                "cpu": Rates(self.cpu_prefill.value(), self.cpu_decode.value(), source="article")}

    def recompute(self) -> None:
        rates, cached = self.rates(), self.cached.value()
        self.arrivals = study_arrivals(rates, cached)
        self.steps = teaching_steps(self.arrivals)
        self.bodies = [step_html(s, self.arrivals, rates, cached) for s in self.steps]
        self.go(min(self.step, len(self.steps) - 1))

    def reset_inputs(self) -> None:
        g, c = ARTICLE_RATES["gpu"], ARTICLE_RATES["cpu"]
        rates = ((self.gpu_prefill, g.prefill_tok_s), (self.gpu_decode, g.decode_tok_s),
                 (self.cpu_prefill, c.prefill_tok_s), (self.cpu_decode, c.decode_tok_s))
        for w, v in rates:
            w.blockSignals(True)
            w.setValue(v)
            w.blockSignals(False)
        self.cached.blockSignals(True)
        self.cached.setValue(CACHED)
        self.cached.blockSignals(False)
        self.recompute()

    def go(self, step: int) -> None:
        self.step = max(0, min(step, len(self.steps) - 1))
        shown = self.steps[self.step]
        self.step_title.setText(shown.title)
        self.step_count.setText(f"step {self.step + 1} of {len(self.steps)}")
        self.text.setHtml(self.bodies[self.step])
        self.back_button.setEnabled(self.step > 0)
        self.next_button.setEnabled(self.step < len(self.steps) - 1)
        self._show_chart(shown.arrival)

    def restyle(self) -> None:
        """Paint the steps, the chart's labels and the live table's chosen cells in the theme in use."""
        self.recompute()
        self._refresh_live()

    def next(self) -> None:
        self.go(self.step + 1)

    def back(self) -> None:
        self.go(self.step - 1)

    def shown_text(self) -> str:
        return self.text.toPlainText()

    def _toggle_play(self, on: bool) -> None:
        if on:
            if self.step >= len(self.steps) - 1:
                self.go(0)
            self._play.start()
            self.play_button.setText("❚❚ Pause")
        else:
            self._play.stop()
            self.play_button.setText("▶ Play")

    def _auto_next(self) -> None:
        if self.step >= len(self.steps) - 1:
            self.play_button.setChecked(False)
        else:
            self.next()

    def presenter_changed(self, on: bool) -> None:
        """The presenter view (ui.presenter): the steps and the live table get the room; the
        article's numbers (inputs) come back afterwards."""
        self.inputs_area.setVisible(not on)
        self.live_table.verticalHeader().setDefaultSectionSize(30 if on else 18)  # rows as tall as the type
        if on:
            self._sizes = self.split.sizes()
            h, fm = self.live_table.horizontalHeader(), self.live_table.fontMetrics()  # the live table as wide
            name = max(self.engine.backend_names, key=fm.horizontalAdvance)  # as its large type needs
            cells = ["GPU", name, "0000 tok"] + ["00.000 s"] * (h.count() - 3)
            need = sum(max(h.sectionSizeFromContents(i).width(), fm.horizontalAdvance(t) + 24) for i, t in enumerate(cells))
            need += self.live_table.verticalHeader().sizeHint().width() + 40
            self.split.setSizes([0, 1280 - max(500, need), max(500, need)])
        elif getattr(self, "_sizes", None):
            self.split.setSizes(self._sizes)
        if self.chart.getPlotItem().titleLabel.text:
            self._chart_title(self.chart.getPlotItem().titleLabel.text)

    def _chart_title(self, text: str) -> None:
        """The chart's title, in the presenter view's size while it is on (`ui.presenter`)."""
        size = f"{TITLE_PT}pt" if self.property("presenter") else "10pt"
        self.chart.getPlotItem().setTitle(text, color=palette().text, size=size)

    def _show_chart(self, arrival: int | None) -> None:
        if arrival is None:
            heights_p = heights_d = [0.0, 0.0]
            labels = ["", ""]
            self.cpu_line.setVisible(False)
            self._chart_title("The new request's score")
        else:
            a = self.arrivals[arrival]
            d, g, c = a.decision, a.gpu, a.cpu
            heights_p = [g.prefill_s, c.prefill_s]
            heights_d = [g.decode_s, c.decode_s]
            labels = [f"{g.score_s:.3f} s", f"{c.score_s:.3f} s"]
            self.cpu_line.setPos(c.score_s)
            self.cpu_line.setVisible(True)
            self._chart_title(f"Request {self.arrivals[arrival].number} → {d.backend.upper()}")
        self.bar_prefill.setOpts(height=heights_p)
        self.bar_decode.setOpts(y0=heights_p, height=heights_d)
        top = max([p + d for p, d in zip(heights_p, heights_d)] + [1.0])
        for i, t in enumerate(self.bar_labels):
            t.setColor(palette().text)
            t.setText(labels[i])
            t.setPos(i, heights_p[i] + heights_d[i])
        self.chart.getPlotItem().setYRange(0, top * 1.55, padding=0)  # headroom: labels and the legend above the bars

    # ---- live ----

    def use_article_rates(self) -> None:
        devices = self.engine.devices
        gpus = [name for name, d in devices.items() if d != "cpu"]
        gpu_role = gpus[0] if gpus else next(iter(devices))
        for name in devices:
            self.engine.set_rates(name, ARTICLE_RATES["gpu"] if name == gpu_role else ARTICLE_RATES["cpu"])
        self.status_message.emit(f"{gpu_role} priced as the article's GPU, the others as its CPU")

    def stop(self) -> None:
        """Stop the replay's timer and cancel a live run (the panel is going away)."""
        self._play.stop()
        if self.run is not None and self.run.running:
            self.run.stop()
        if self.whatif.live is not None and self.whatif.live.running:
            self.whatif.live.stop()

    def run_live(self) -> None:
        if self.run is not None and self.run.running:
            self.run.stop()
            return
        self.run = WorkloadRun(self.engine, self.bridge, STUDY, label="teaching", parent=self, reuse_warm=True)
        self.run.progress.connect(lambda done, total: self.live_progress.setValue(done))
        self.run.phase.connect(self._on_phase)
        self.live_progress.setValue(0)
        for r in range(self.live_table.rowCount()):
            for c in range(1, self.live_table.columnCount()):
                self.live_table.setItem(r, c, QTableWidgetItem(""))
        self._shown_live = -1
        self.run_controls.attach(self.run)
        self.run.start()

    def _on_phase(self, phase: str) -> None:
        running = phase in ("flushing", "warming", "running")
        self.live_button.setText("Stop" if running else "Run live")
        if phase == "flushing":
            self._warm_since = time.monotonic()
        self.live_note.setText({"flushing": "Flushing the prefix caches…",
                                "warming": self._warming_text(),
                                "running": "Sending 8 requests, 50 ms apart…",
                                "done": self._live_summary(),
                                "stopped": "Stopped.",
                                "failed": f"Failed: {self.run.result.error if self.run else ''}"}.get(phase, phase))
        self._refresh_live()

    def _warming_text(self) -> str:
        """The warming under way, with the time left (the prefix over the slowest measured prefill)."""
        elapsed = time.monotonic() - (self._warm_since or time.monotonic())
        eta = warm_eta(STUDY.shared_tokens, [self.engine.rates(n).prefill_tok_s for n in self.engine.backend_names])
        return (f"Warming the {STUDY.shared_tokens}-token prefix on every backend: {warm_left_text(eta, elapsed)}. "
                "The requests are sent once it is cached.")

    def _live_summary(self) -> str:
        if self.run is None:
            return ""
        counts: dict[str, int] = {}
        for d in self.run.result.ordered_decisions():
            counts[d.backend] = counts.get(d.backend, 0) + 1
        s = self.run.result.summary()
        where = ", ".join(f"{n} to {b}" for b, n in counts.items())
        return (f"Done in {s.metrics.makespan_s:.2f} s ({where}); policy {s.policy}. "
                "The article sent 7 to the GPU and 1 to the CPU.")

    def _on_tick(self, _tick) -> None:
        if self.run is not None and self.run.state == "warming":
            self.live_note.setText(self._warming_text())  # the time left, counting down
        if self.run is not None and len(self.run.result.decisions) != self._shown_live:
            self._refresh_live()

    def _refresh_live(self) -> None:
        if self.run is None:
            return
        names = self.engine.backend_names
        decisions = self.run.result.ordered_decisions()
        self._shown_live = len(self.run.result.decisions)
        for i, d in enumerate(decisions):
            here = QTableWidgetItem(d.backend)
            here.setForeground(qcolor(backend_color(names.index(d.backend)) if d.backend in names else "#ffffff"))
            self.live_table.setItem(i, 1, here)
            self.live_table.setItem(i, 2, QTableWidgetItem(f"{d.chosen.cached_tokens} tok"))
            for k, n in enumerate(names):
                try:
                    s = d.score_of(n)
                except KeyError:
                    continue
                item = QTableWidgetItem("∞" if not math.isfinite(s.score_s) else f"{s.score_s:.3f} s")
                if n == d.backend:
                    item.setBackground(qcolor(palette().chosen_bg))
                self.live_table.setItem(i, 3 + k, item)


def _spin(value: float) -> QDoubleSpinBox:
    s = QDoubleSpinBox(decimals=1, minimum=0.1, maximum=1e6, value=value)
    s.setKeyboardTracking(False)
    return s

