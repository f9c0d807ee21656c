"""Teaching: the study's worked example replayed through the real router, step by step.

Part 1 builds the backend states the article describes at requests 7 and 8 as hand-made
`BackendSnapshot`s (GPU: 4 running with 124 then 122 tokens of budget left, 2 then 3 queued;
CPU idle; every request can reuse a 496-token cached prefix) and routes them with
`engine.router.Router` under `seed-score`. Every number on screen is read from the resulting
`RoutingDecision` (3.027 s stays on the GPU; 3.444 s > 3.118 s goes to the CPU), so editing a
rate or the cached prefix re-runs the router and the verdicts move.

Part 2 sends the same eight arrivals (516-token prompts sharing a warmed 496-token prefix,
128 tokens each, 50 ms apart) to this machine's backends and lists where each went next to
where the article's went.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QAbstractItemView, QDoubleSpinBox, QFormLayout, QGroupBox, QHBoxLayout, QHeaderView, QLabel,
    QProgressBar, QPushButton, QSpinBox, QSplitter, QTableWidget, QTableWidgetItem, QTextBrowser,
    QVBoxLayout, QWidget,
)

from engine.router import RouteQuery, Router
from engine.snapshot import BackendSnapshot, Rates, WorkItem

from .theme import LEGEND_BG, MUTED, backend_color, qcolor, scrollable, style_plot, wrap_label
from .workload import STUDY, WorkloadRun

# The article's rates (Apple M2, Qwen2.5-0.5B, profiled alone).
ARTICLE_RATES = {"gpu": Rates(2551.0, 293.0, source="article"), "cpu": Rates(73.0, 45.0, source="article")}
PROMPT, CACHED, MAX_TOKENS, CAP = 516, 496, 128, 4
# Where the article's eight requests went.
ARTICLE_CHOICES = ["gpu"] * 7 + ["cpu"]
GPU_COLOR, CPU_COLOR = backend_color(0), backend_color(1)


@dataclass(frozen=True)
class Arrival:
    """One arrival of the worked example: the states the router saw and what it decided."""

    number: int
    gpu_left: int  # decode budget left on each of the 4 running GPU requests
    gpu_queued: int
    query: RouteQuery
    snapshots: tuple
    decision: object  # RoutingDecision


def study_snapshots(gpu_left: int, gpu_queued: int, rates=ARTICLE_RATES, cached: int = CACHED,
                    prompt: int = PROMPT, max_tokens: int = MAX_TOKENS) -> tuple[BackendSnapshot, BackendSnapshot]:
    """The GPU with 4 running (`gpu_left` budget each) + `gpu_queued` queued; the CPU idle."""
    running = tuple(WorkItem(f"run-{i + 1}", True, prompt, cached, 0, gpu_left, max_tokens - gpu_left)
                    for i in range(CAP))
    queued = tuple(WorkItem(f"queued-{i + 1}", False, prompt, cached, prompt - cached, max_tokens)
                   for i in range(gpu_queued))
    gpu = BackendSnapshot("gpu", "gpu", CAP, 4096, rates["gpu"], running + queued)
    cpu = BackendSnapshot("cpu", "cpu", CAP, 4096, rates["cpu"], ())
    return gpu, cpu


def replay_arrival(number: int, gpu_left: int, gpu_queued: int, rates=ARTICLE_RATES, cached: int = CACHED) -> Arrival:
    """Route one arrival of the worked example through a fresh seed-score `Router`."""
    snaps = study_snapshots(gpu_left, gpu_queued, rates, cached)
    query = RouteQuery(f"request-{number}", PROMPT, MAX_TOKENS, {"gpu": cached, "cpu": cached})
    decision = Router("seed-score").route(query, snaps)
    return Arrival(number, gpu_left, gpu_queued, query, snaps, decision)


def study_arrivals(rates=ARTICLE_RATES, cached: int = CACHED) -> tuple[Arrival, Arrival]:
    """Requests 7 and 8 as the article describes them."""
    return (replay_arrival(7, 124, 2, rates, cached), replay_arrival(8, 122, 3, rates, cached))


def gpu_decode_to_keep(arrival: Arrival) -> float:
    """The GPU decode rate at which this arrival's GPU score would equal the CPU's."""
    gpu, cpu = arrival.decision.score_of("gpu"), arrival.decision.score_of("cpu")
    room = cpu.score_s - gpu.prefill_s
    return gpu.decode_tokens / room if room > 0 else math.inf


# ----------------------------------------------------------------------------------------
# Step texts
# ----------------------------------------------------------------------------------------


def _queue_html(arrival: Arrival) -> str:
    """The GPU's slots and queue as coloured cells (each waiting request: prompt tokens left + budget)."""
    left = arrival.query.prefill_on("gpu")
    cells = "".join(f"<td bgcolor='#24456e' align='center'>&nbsp;running&nbsp;<br><b>{arrival.gpu_left}</b> left&nbsp;</td>"
                    for _ in range(CAP))
    queue = "".join("<td bgcolor='#5c4318' align='center'>&nbsp;queued&nbsp;<br>{left} + <b>{MAX_TOKENS}</b>&nbsp;</td>"
                    for _ in range(arrival.gpu_queued))
    new = f"<td bgcolor='#2d4a33' align='center'>&nbsp;<b>new</b>&nbsp;<br>{left} + {MAX_TOKENS}&nbsp;</td>"
    return (f"<table cellspacing='4' cellpadding='3'><tr><td><b style='color:{GPU_COLOR}'>GPU</b>&nbsp;</td>"
            f"{cells}<td>&nbsp;|&nbsp;</td>{queue}<td>&nbsp;+&nbsp;</td>{new}</tr>"
            f"<tr><td><b style='color:{CPU_COLOR}'>CPU</b></td><td colspan='{CAP}' style='color:{MUTED}'>idle: "
            f"nothing running, nothing queued</td></tr></table>")


def _gpu_sum_html(a: Arrival) -> str:
    s = a.decision.score_of("gpu")
    q, left = a.gpu_queued, a.gpu_left
    new_prefill = a.query.prefill_on("gpu")
    return (
        f"<p><b style='color:{GPU_COLOR}'>GPU</b> prefill: {q} queued × {new_prefill} + new {new_prefill} = "
        f"<b>{s.prefill_tokens:.0f}</b> tokens → {s.prefill_tokens:.0f} / {s.rates.prefill_tok_s:g} = {s.prefill_s:.3f} s</p>"
        f"<p><b style='color:{GPU_COLOR}'>GPU</b> decode budget: {q} queued × {MAX_TOKENS} + {CAP} running × {left} + "
        f"new {MAX_TOKENS} = {q * MAX_TOKENS} + {CAP * left} + {MAX_TOKENS} = <b>{s.decode_tokens:.0f}</b> tokens → "
        f"{s.decode_tokens:.0f} / {s.rates.decode_tok_s:g} = {s.decode_s:.3f} s</p>"
        f"<p style='font-size:13pt'>GPU score = {s.prefill_tokens:.0f}/{s.rates.prefill_tok_s:g} + "
        f"{s.decode_tokens:.0f}/{s.rates.decode_tok_s:g} = <b>{s.score_s:.3f} s</b></p>"
    )


def _cpu_sum_html(a: Arrival) -> str:
    c = a.decision.score_of("cpu")
    return (f"<p style='font-size:13pt'><b style='color:{CPU_COLOR}'>CPU</b> (idle) score = "
            f"{c.prefill_tokens:.0f}/{c.rates.prefill_tok_s:g} + {c.decode_tokens:.0f}/{c.rates.decode_tok_s:g} = "
            f"{c.prefill_s:.3f} + {c.decode_s:.3f} = <b>{c.score_s:.3f} s</b></p>")


def _verdict_html(a: Arrival) -> str:
    d = a.decision
    g, c = d.score_of("gpu"), d.score_of("cpu")
    if d.backend == "gpu":
        rel = "&lt;" if g.score_s < c.score_s else "="
        text = f"{g.score_s:.3f} s {rel} {c.score_s:.3f} s: request {a.number} <b>stays on the GPU</b>"
        color = GPU_COLOR
    else:
        text = f"{g.score_s:.3f} s &gt; {c.score_s:.3f} s: the <b>CPU takes request {a.number}</b>"
        color = CPU_COLOR
    return (f"<p style='font-size:14pt;color:{color}'>{text}</p>"
            f"<p style='color:{MUTED}'>Router's record: {html.escape(d.reason)}</p>")


def teaching_steps(arrivals: tuple[Arrival, Arrival], rates, cached: int) -> list[tuple[str, str, int | None]]:
    """(title, HTML, index of the arrival the chart shows) for each step of the replay."""
    a7, a8 = arrivals
    g, c = rates["gpu"], rates["cpu"]
    setup = (
        f"<p>Two backends serve one model: a <b style='color:{GPU_COLOR}'>GPU</b> and a <b style='color:{CPU_COLOR}'>CPU</b>, "
        f"each with its own queue, a cap of {CAP} running requests and its own prefix cache.</p>"
        f"<p>Every request is a {PROMPT}-token prompt whose first {cached} tokens are already cached on both backends, "
        f"so only {PROMPT - cached} prompt tokens are left to compute; each generates {MAX_TOKENS} tokens. "
        "Requests arrive every 50 ms.</p>"
        "<p>The router sends each <i>whole</i> request to the backend with the lowest score:</p>"
        "<p style='font-size:12pt' align='center'><b>score = prefill tokens left / prefill rate + "
        "decode budget left / decode rate</b></p>"
        f"<p>Rates (each backend profiled alone): GPU prefill {g.prefill_tok_s:g} tok/s, decode {g.decode_tok_s:g} tok/s; "
        f"CPU prefill {c.prefill_tok_s:g} tok/s, decode {c.decode_tok_s:g} tok/s.</p>"
        "<p>The decode term counts the unused <i>budget</i> (max_tokens), not a guess of the real output length.</p>"
    )
    steps = [("The setup", setup, None)]
    for k, a in enumerate(arrivals):
        when = "" if k == 0 else " — 50 ms later"
        extra = ("<p>Since request 7, the 4 running requests have used 2 more tokens of budget each, "
                 "and the queue has grown by one.</p>" if k == 1 else "")
        steps.append((f"Request {a.number} arrives{when}",
                      f"<p>What the router sees when request {a.number} arrives:</p>{_queue_html(a)}{extra}"
                      f"<p>Each queued request still has {a.query.prefill_on('gpu')} prompt tokens to compute and its "
                      f"full {MAX_TOKENS}-token budget; each running one has {a.gpu_left} tokens of budget left.</p>", k))
        steps.append((f"Request {a.number}: the GPU's score", _queue_html(a) + _gpu_sum_html(a), k))
        steps.append((f"Request {a.number}: the CPU's score, and the verdict",
                      _gpu_sum_html(a) + _cpu_sum_html(a) + _verdict_html(a), k))
    keep = gpu_decode_to_keep(a8)
    boundary = (
        "<p>A full GPU (all 4 slots busy at request 7) was not enough to send work to the CPU: the cached prefix made "
        "the CPU's prefill cheap, and only when enough decode budget piled up on the GPU did its score pass the "
        "CPU's.</p>"
        f"<p>Request 8 would have stayed on the GPU if the GPU decoded at ≥ <b>{keep:.0f} tok/s</b> "
        f"(it is {g.decode_tok_s:g}).</p>"
        f"<p>Without the cached prefix the idle CPU would score {PROMPT}/{c.prefill_tok_s:g} + "
        f"{MAX_TOKENS}/{c.decode_tok_s:g} = <b>{PROMPT / c.prefill_tok_s + MAX_TOKENS / c.decode_tok_s:.3f} s</b>, "
        "and the GPU would keep everything.</p>"
        "<p>Change a rate or the cached prefix on the left and step again: every number here is recomputed by the "
        "real router. Then run the same eight arrivals on this machine below.</p>"
    )
    steps.append(("Where the boundary lies", boundary, 1))
    return steps


# ----------------------------------------------------------------------------------------
# The panel
# ----------------------------------------------------------------------------------------


class TeachingPanel(QWidget):
    status_message = Signal(str)

    def __init__(self, engine, bridge, parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        self.bridge = bridge
        self.step = 0
        self.run: WorkloadRun | None = None
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
        style_plot(p, "Score of the arriving request", "", "seconds")
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
        self.bar_labels = [pg.TextItem(anchor=(0.5, 1.0), color="#e6e9ef") for _ in range(2)]
        for t in self.bar_labels:
            p.addItem(t)
        self.cpu_line = pg.InfiniteLine(angle=0, pen=pg.mkPen(CPU_COLOR, width=1, style=Qt.DashLine))
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
        body = QSplitter(Qt.Horizontal)  # the step's text with its chart beside it (fits a short screen)
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
        self.live_progress = QProgressBar()
        self.live_progress.setMaximum(STUDY.n_requests)
        self.live_progress.setFormat("%v / %m done")
        self.live_progress.setMinimumWidth(70)
        row.addWidget(self.live_button)
        row.addWidget(self.article_rates_button)
        row.addWidget(self.live_progress, 1)
        lv2.addLayout(row)
        names = self.engine.backend_names
        self.live_table = QTableWidget(STUDY.n_requests, 3 + len(names))
        self.live_table.setHorizontalHeaderLabels(["article", "here", "cached", *names])
        for k, n in enumerate(names):
            self.live_table.horizontalHeaderItem(3 + k).setToolTip(f"{n}'s score for the request (seconds)")
        self.live_table.setVerticalHeaderLabels([f"req {i + 1}" for i in range(STUDY.n_requests)])
        self.live_table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.live_table.horizontalHeader().setSectionResizeMode(QHeaderView.Stretch)
        self.live_table.verticalHeader().setDefaultSectionSize(20)
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

        split = QSplitter(Qt.Horizontal)
        split.addWidget(scrollable(left, 240))
        split.addWidget(middle)
        split.addWidget(live)
        split.setSizes([230, 760, 400])
        outer = QVBoxLayout(self)
        outer.setContentsMargins(6, 6, 6, 6)
        outer.addWidget(split)

    # ---- article replay ----

    def rates(self) -> dict:
        return {"gpu": Rates(self.gpu_prefill.value(), self.gpu_decode.value(), source="article"),
                "cpu": Rates(self.cpu_prefill.value(), self.cpu_decode.value(), source="article")}

    def recompute(self) -> None:
        self.arrivals = study_arrivals(self.rates(), self.cached.value())
        self.steps = teaching_steps(self.arrivals, self.rates(), self.cached.value())
        self.go(min(self.step, len(self.steps) - 1))

    def reset_inputs(self) -> None:
        for w, v in ((self.gpu_prefill, 2551.0), (self.gpu_decode, 293.0), (self.cpu_prefill, 73.0),
                     (self.cpu_decode, 45.0), (self.cached, CACHED)):
            w.blockSignals(True)
            w.setValue(v)
            w.blockSignals(False)
        self.recompute()

    def go(self, step: int) -> None:
        self.step = max(0, min(step, len(self.steps) - 1))
        title, body, arrival = self.steps[self.step]
        self.step_title.setText(title)
        self.step_count.setText(f"step {self.step + 1} of {len(self.steps)}")
        self.text.setHtml(body)
        self.back_button.setEnabled(self.step > 0)
        self.next_button.setEnabled(self.step < len(self.steps) - 1)
        self._show_chart(arrival)

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

    def _show_chart(self, arrival: int | None) -> None:
        if arrival is None:
            heights_p = heights_d = [0.0, 0.0]
            labels = ["", ""]
            self.cpu_line.setVisible(False)
            self.chart.getPlotItem().setTitle("Score of the arriving request")
        else:
            d = self.arrivals[arrival].decision
            g, c = d.score_of("gpu"), d.score_of("cpu")
            heights_p = [g.prefill_s, c.prefill_s]
            heights_d = [g.decode_s, c.decode_s]
            labels = [f"{g.score_s:.3f} s", f"{c.score_s:.3f} s"]
            self.cpu_line.setPos(c.score_s)
            self.cpu_line.setVisible(True)
            self.chart.getPlotItem().setTitle(
                f"<span style='color:#d8dee9'>Request {self.arrivals[arrival].number} → {d.backend.upper()}</span>")
        self.bar_prefill.setOpts(height=heights_p)
        self.bar_decode.setOpts(y0=heights_p, height=heights_d)
        top = max([p + d for p, d in zip(heights_p, heights_d)] + [1.0])
        for i, t in enumerate(self.bar_labels):
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

    def run_live(self) -> None:
        if self.run is not None and self.run.running:
            self.run.stop()
            return
        self.run = WorkloadRun(self.engine, self.bridge, STUDY, label="teaching", parent=self)
        self.run.progress.connect(lambda done, total: self.live_progress.setValue(done))
        self.run.phase.connect(self._on_phase)
        self.live_progress.setValue(0)
        for r in range(self.live_table.rowCount()):
            for c in range(1, self.live_table.columnCount()):
                self.live_table.setItem(r, c, QTableWidgetItem(""))
        self._shown_live = -1
        self.run.start()

    def _on_phase(self, phase: str) -> None:
        running = phase in ("flushing", "warming", "running")
        self.live_button.setText("Stop" if running else "Run live")
        self.live_note.setText({"flushing": "Flushing the prefix caches…",
                                "warming": f"Warming the {STUDY.shared_tokens}-token prefix on every backend…",
                                "running": "Sending 8 requests, 50 ms apart…",
                                "done": self._live_summary(),
                                "stopped": "Stopped.",
                                "failed": f"Failed: {self.run.result.error if self.run else ''}"}.get(phase, phase))
        self._refresh_live()

    def _live_summary(self) -> str:
        if self.run is None:
            return ""
        counts: dict[str, int] = {}
        for d in self.run.result.ordered_decisions():
            counts[d.backend] = counts.get(d.backend, 0) + 1
        s = self.run.result.summary()
        where = ", ".join(f"{n} to {b}" for b, n in counts.items())
        return (f"Done in {s.makespan_s:.2f} s ({where}); policy {s.policy}. "
                "The article sent 7 to the GPU and 1 to the CPU.")

    def _on_tick(self, _tick) -> None:
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
                    item.setBackground(qcolor("#2d4a33"))
                self.live_table.setItem(i, 3 + k, item)


def _spin(value: float) -> QDoubleSpinBox:
    s = QDoubleSpinBox(decimals=1, minimum=0.1, maximum=1e6, value=value)
    s.setKeyboardTracking(False)
    return s

