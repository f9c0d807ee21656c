"""Experiments: run the study's workload (or a variant) under several policies and compare them.

With a `bench_runner` (the app passes `engine.experiment.experiment_runner`, the runner that
`tandem bench seed|grid` uses too), each run goes through that runner on a `ui.worker.Worker`,
one policy after another: fresh engine state per run (caches flushed, prefix re-warmed, router
cleared, caps and rates restored), the same workloads and the same metrics as the command line. Without one, runs are driven from the GUI thread by
`ui.live_run.WorkloadRun`. Either way the routing and latency views show the run live, a
progress bar counts requests (the line under it says how long the prefix's warming has left, then
how many arrivals were sent), and results (makespan, output tok/s, TTFT and end-to-end p50/p95,
requests per backend) fill a table that exports to CSV, JSON or PNG.

Above the results table, `ui.run_controls.RunControls` pauses and steps the live run in progress:
this panel's runs, or a demo run from the Run menu (`show_run`). A run through the benchmark
runner is driven through the `engine.sim.arrivals.ArrivalClock` handed to it (`BenchRun`). A paused
run's makespan (and so its output tok/s) leaves out the time it stood paused with nothing in
flight, so it compares with unpaused runs; time paused while requests still ran stays in. The
makespan and tok/s cells' tooltips say how much was left out, and the exports carry it
(`paused_s`). Stop resumes a paused run so that it ends.
"""

from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QFileDialog,
    QFormLayout,
    QGridLayout,
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
    QVBoxLayout,
    QWidget,
)

from engine.sim.arrivals import ArrivalClock
from engine.sim.benchmark import METRICS, RunSummary

from ..live_run import STUDY, WorkloadRun, WorkloadSpec, seed_workload
from ..model.formatting import fmt_seconds, warm_eta, warm_left_text
from ..theme import backend_color, qcolor, scrollable_column, style_plot, wrap_label
from ..worker import Worker
from .controls import policy_choices
from .run_controls import RunControls

COLUMNS = ["run", "policy", "requests", "makespan", "output tok/s", "TTFT p50", "TTFT p95",
           "E2E p50", "E2E p95", "per backend"]


class ExperimentsPanel(QWidget):
    status_message = Signal(str)
    run_finished = Signal(object)  # RunSummary

    def __init__(self, engine, bridge, bench_runner=None, parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        self.bridge = bridge
        self.bench_runner = bench_runner  # fn(spec, policy, run, on_done) -> RunSummary, blocking
        self._worker: Worker | None = None
        self.summaries: list[RunSummary] = []
        self._queue: list[str] = []
        self._run: WorkloadRun | None = None
        self._bench_run: BenchRun | None = None
        self._restore_policy: str | None = None
        self._total = 0
        self._done_before = 0
        bridge.tick.connect(self._on_tick)
        self._last_spec: WorkloadSpec | None = None
        self._build()

    def _build(self) -> None:
        wl = QGroupBox("Workload (the study's, by default)")
        f = QFormLayout(wl)
        self.n_requests = QSpinBox(minimum=1, maximum=1000, value=STUDY.n_requests)
        self.interval = QSpinBox(minimum=0, maximum=10000, value=round(STUDY.interval_s * 1000), suffix=" ms")
        self.prefix = QSpinBox(minimum=0, maximum=100000, value=STUDY.shared_tokens, suffix=" tokens")
        self.suffix = QSpinBox(minimum=1, maximum=100000, value=STUDY.prompt_tokens - STUDY.shared_tokens,
                               suffix=" tokens")
        self.max_tokens = QSpinBox(minimum=1, maximum=100000, value=STUDY.gen_tokens, suffix=" tokens")
        f.addRow("Requests", self.n_requests)
        f.addRow("Arrival every", self.interval)
        f.addRow("Shared, warmed prefix", self.prefix)
        f.addRow("Unique suffix", self.suffix)
        f.addRow("Generated per request", self.max_tokens)
        presets = QHBoxLayout()
        for n in (4, 8, 48):
            b = QPushButton(f"{n} requests")
            b.clicked.connect(lambda _=False, n=n: self.n_requests.setValue(n))
            presets.addWidget(b)
        f.addRow(presets)

        pol = QGroupBox("Policies to compare (one run each)")
        pv = QGridLayout(pol)
        self.policy_checks: dict[str, QCheckBox] = {}
        choices = policy_choices(self.engine)
        baseline = "gpu-only" if "gpu-only" in choices else f"only:{self.engine.backend_names[0]}"
        for i, name in enumerate(choices):
            cb = QCheckBox(name)
            cb.setChecked(name in ("seed-score", baseline))
            self.policy_checks[name] = cb
            pv.addWidget(cb, i // 2, i % 2)

        self.run_button = QPushButton("Run")
        self.run_button.setObjectName("primary")
        self.run_button.clicked.connect(self.toggle)
        self.progress = QProgressBar()
        self.progress.setFormat("%v / %m requests")
        self.phase_label = QLabel("idle")
        self.phase_label.setObjectName("muted")
        self.run_controls = RunControls()
        self.run_controls.status_message.connect(self.status_message.emit)
        left = QWidget()
        lv = QVBoxLayout(left)
        lv.setContentsMargins(0, 0, 0, 0)
        lv.addWidget(wl)
        lv.addWidget(pol)
        lv.addWidget(self.run_button)
        lv.addWidget(self.progress)
        lv.addWidget(self.phase_label)
        lv.addStretch(1)

        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setAlternatingRowColors(True)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)

        self.chart = pg.PlotWidget()
        p = self.chart.getPlotItem()
        style_plot(p, "Makespan per run (lower is better)", "", "seconds")
        p.setMouseEnabled(False, False)
        p.hideButtons()
        self.bars = pg.BarGraphItem(x=[], height=[], width=0.6, brush=qcolor(backend_color(0), 200))
        p.addItem(self.bars)

        exports = QHBoxLayout()
        self.csv_button = QPushButton("Export CSV…")
        self.json_button = QPushButton("Export JSON…")
        self.png_button = QPushButton("Export PNG…")
        self.clear_button = QPushButton("Clear")
        self.csv_button.clicked.connect(lambda: self._ask_export("csv"))
        self.json_button.clicked.connect(lambda: self._ask_export("json"))
        self.png_button.clicked.connect(lambda: self._ask_export("png"))
        self.clear_button.clicked.connect(self.clear)
        for b in (self.csv_button, self.json_button, self.png_button, self.clear_button):
            exports.addWidget(b)
        exports.addStretch(1)
        note = QLabel("Each run starts from a fresh engine state (caches flushed, the prefix re-warmed, the router "
                      "cleared). For repeated runs and HTTP peers use `tandem bench`.")
        note.setObjectName("muted")
        wrap_label(note)

        right_split = QSplitter(Qt.Orientation.Vertical)
        right_split.addWidget(self.table)
        right_split.addWidget(self.chart)
        right_split.setSizes([250, 200])
        right = QWidget()
        rv = QVBoxLayout(right)
        rv.setContentsMargins(0, 0, 0, 0)
        rv.addWidget(self.run_controls)  # above the table: in sight on a 720 px screen
        rv.addWidget(right_split, 1)
        rv.addLayout(exports)
        rv.addWidget(note)

        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(scrollable_column(left))
        split.addWidget(right)
        split.setSizes([340, 1100])
        outer = QGridLayout(self)
        outer.setContentsMargins(6, 6, 6, 6)
        outer.addWidget(split)
        self._update_exports()

    # ---- running ----

    def spec(self) -> WorkloadSpec:
        return seed_workload(self.n_requests.value(), prefix_tokens=self.prefix.value(),
                             suffix_tokens=self.suffix.value(), gen_tokens=self.max_tokens.value(),
                             interval_s=self.interval.value() / 1000.0)

    @property
    def running(self) -> bool:
        if self._worker is not None and self._worker.running:
            return True
        return (self._run is not None and self._run.running) or bool(self._queue)

    def toggle(self) -> None:
        if self.running:
            self.stop()
        else:
            self.start([n for n, cb in self.policy_checks.items() if cb.isChecked()])

    def start(self, policies: list[str]) -> bool:
        if self.running or not policies:
            return False
        self._restore_policy = self.engine.router.policy
        self._last_spec = self.spec()
        self._queue = list(policies)
        self._total = len(policies) * self.n_requests.value()
        self._done_before = 0
        self.progress.setMaximum(self._total)
        self.progress.setValue(0)
        self.run_button.setText("Stop")
        if self.bench_runner is not None:
            self.phase_label.setText(f"running {len(policies)} policies with the benchmark runner…")
            self._bench_next(0)
        else:
            self._next()
        return True

    def stop(self) -> None:
        self._queue = []
        if self._bench_run is not None:
            self._bench_run.resume()  # a paused run must reach its end to stop
        if self._worker is not None and self._worker.running:
            self.phase_label.setText("stopping after the current run…")
        if self._run is not None and self._run.running:
            self._run.stop()

    def show_run(self, run) -> None:
        """Let the Pause/Step row drive `run` (a demo started elsewhere), unless a run of this
        panel is in progress."""
        if not self.running:
            self.run_controls.attach(run)

    def wait(self, timeout: float | None = None) -> None:
        """Join the benchmark run's worker thread (tests, shutdown)."""
        if self._worker is not None:
            self._worker.join(timeout)

    # ---- the benchmark runner: one policy per worker, chained on the main thread ----

    def _bench_next(self, index: int) -> None:
        if not self._queue:
            self._end()
            return
        policy = self._queue.pop(0)
        spec = self._started_spec()
        run = self._bench_run = BenchRun(f"#{len(self.summaries) + 1} {policy}", spec.n_requests, spec.shared_tokens)
        worker = Worker(lambda: self.bench_runner(spec, policy, index, worker.report, clock=run.clock),
                        name="experiments", owner=self)
        worker.progress.connect(self._on_worker_progress)
        worker.returned.connect(lambda summary: self._on_worker_result(summary, index + 1))
        worker.errored.connect(self._on_worker_error)
        worker.finished.connect(run.finish)
        self.run_controls.attach(run)
        self._worker = worker.start()

    def _on_tick(self, _tick) -> None:
        """A benchmark run's phase, while it lasts: the warming with the time left, then the arrivals."""
        run = self._bench_run
        if run is None or not run.running:
            return
        if run.clock.started:
            text = f"{run.label}: {run.n_submitted}/{run.n_requests} sent" + (" · paused" if run.paused else "")
        else:
            names = self.engine.backend_names
            eta = warm_eta(run.prefix_tokens, [self.engine.rates(n).prefill_tok_s for n in names])
            text = (f"{run.label}: warming the {run.prefix_tokens}-token prefix, "
                    f"{warm_left_text(eta, time.monotonic() - run.t_start)}")
        if self.phase_label.text() != text:
            self.phase_label.setText(text)

    def _on_worker_progress(self, _value) -> None:
        self.progress.setValue(self.progress.value() + 1)

    def _on_worker_result(self, summary, next_index: int) -> None:
        summary = _numbered(summary, len(self.summaries) + 1)
        self.add_summary(summary)
        self.run_finished.emit(summary)
        self._bench_next(next_index)

    def _started_spec(self) -> WorkloadSpec:
        """The workload of the runs `start` began."""
        if self._last_spec is None:
            raise RuntimeError("no experiment has started")
        return self._last_spec

    def _on_worker_error(self, e: BaseException) -> None:
        self.status_message.emit(f"experiment run failed: {e}")
        self._queue = []
        self._end()

    def _next(self) -> None:
        if not self._queue:
            self._end()
            return
        policy = self._queue.pop(0)
        try:
            self.engine.router.set_policy(policy)
        except Exception as e:
            self.status_message.emit(f"policy {policy}: {e}")
            self._next()
            return
        label = f"#{len(self.summaries) + 1}"
        self._run = WorkloadRun(self.engine, self.bridge, self._started_spec(), label=label, parent=self)
        self._run.progress.connect(lambda done, _t: self.progress.setValue(self._done_before + done))
        self._run.phase.connect(lambda ph, p=policy: self.phase_label.setText(f"{p}: {ph}"))
        self._run.done.connect(self._on_done)
        self.run_controls.attach(self._run)
        self._run.start()

    def _on_done(self, result) -> None:
        self._done_before += result.spec.n_requests
        if result.error:
            self.status_message.emit(f"experiment run failed: {result.error}")
        elif result.records:
            summary = result.summary()
            self.add_summary(summary)
            self.run_finished.emit(summary)
        if self._queue and not result.error and len(result.records) == result.spec.n_requests:
            self._next()
        else:
            self._queue = []
            self._end()

    def _end(self) -> None:
        self._worker = None
        self._bench_run = None
        if self._restore_policy:
            self.engine.router.set_policy(self._restore_policy)
            self._restore_policy = None
        self.run_button.setText("Run")
        self.phase_label.setText("idle")

    # ---- results ----

    def add_summary(self, s: RunSummary) -> None:
        self.summaries.append(s)
        row = self.table.rowCount()
        self.table.insertRow(row)
        m = s.metrics
        cells = [s.label, s.policy, f"{m.completed}/{m.requests}", fmt_seconds(m.makespan_s), f"{m.output_tok_s:.1f}",
                 fmt_seconds(m.ttft_p50_s), fmt_seconds(m.ttft_p95_s), fmt_seconds(m.e2e_p50_s), fmt_seconds(m.e2e_p95_s),
                 ", ".join(f"{b}: {n}" for b, n in sorted(m.routed.items()))]
        paused = paused_note(m.paused_s)
        for col, text in enumerate(cells):
            item = QTableWidgetItem(text)
            if 2 <= col <= 8:
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            if paused and COLUMNS[col] in ("makespan", "output tok/s"):
                item.setToolTip(paused)
            self.table.setItem(row, col, item)
        self._update_chart()
        self._update_exports()

    def clear(self) -> None:
        self.summaries.clear()
        self.table.setRowCount(0)
        self._update_chart()
        self._update_exports()

    def _update_chart(self) -> None:
        xs = list(range(len(self.summaries)))
        hs = [s.metrics.makespan_s if math.isfinite(s.metrics.makespan_s) else 0.0 for s in self.summaries]
        self.bars.setOpts(x=xs, height=hs)
        self.chart.getPlotItem().getAxis("bottom").setTicks([[(i, f"{s.label} {s.policy}") for i, s in enumerate(self.summaries)]])
        if hs:
            self.chart.getPlotItem().setXRange(-0.6, len(hs) - 0.4, padding=0)
            self.chart.getPlotItem().setYRange(0, max(hs) * 1.15, padding=0)

    def _update_exports(self) -> None:
        has = bool(self.summaries)
        for b in (self.csv_button, self.json_button):
            b.setEnabled(has)

    # ---- export ----

    def export_csv(self, path: str | Path) -> Path:
        path = Path(path)
        backends = sorted({b for s in self.summaries for b in s.metrics.routed})
        columns = ["label", "policy", "requests", "completed", "failed", *METRICS, "output_tokens", "paused_s"]
        with path.open("w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(columns + [f"requests_{b}" for b in backends])
            for s in self.summaries:
                d = s.to_dict()
                w.writerow([d[k] for k in columns] + [s.metrics.routed.get(b, 0) for b in backends])
        return path

    def export_json(self, path: str | Path) -> Path:
        path = Path(path)
        spec = self._last_spec or self.spec()
        doc = {"workload": spec.to_dict(), "runs": [s.to_dict() for s in self.summaries]}
        path.write_text(json.dumps(doc, indent=2, default=_json_default), encoding="utf-8")
        return path

    def export_png(self, path: str | Path) -> Path:
        path = Path(path)
        self.grab().save(str(path))
        return path

    def _ask_export(self, kind: str) -> None:
        filters = {"csv": "CSV (*.csv)", "json": "JSON (*.json)", "png": "PNG image (*.png)"}
        path, _ = QFileDialog.getSaveFileName(self, f"Export {kind.upper()}", f"tandem-experiments.{kind}", filters[kind])
        if not path:
            return
        try:
            getattr(self, f"export_{kind}")(path)
            self.status_message.emit(f"exported {path}")
        except OSError as e:
            self.status_message.emit(f"export failed: {e}")


class BenchRun:
    """One benchmark-runner run as the Pause/Step row sees it: its arrival clock (the runner's
    thread waits on it) and how far it got. Main thread, except `clock` (any thread)."""

    def __init__(self, label: str, n_requests: int, prefix_tokens: int = 0):
        self.label = label
        self.n_requests = n_requests
        self.prefix_tokens = prefix_tokens  # warmed before the first arrival
        self.t_start = time.monotonic()
        self.clock = ArrivalClock()
        self.state = "running"

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def paused(self) -> bool:
        return self.clock.paused

    @property
    def n_submitted(self) -> int:
        return self.clock.taken

    def pause(self) -> bool:
        return self.running and self.clock.pause()

    def resume(self) -> bool:
        return self.clock.resume()

    def step(self) -> bool:
        if not self.running or self.clock.taken >= self.n_requests:
            return False
        self.clock.step()
        return True

    def finish(self) -> None:
        self.state = "done"
        self.clock.close()


def paused_note(paused_s: float) -> str:
    """What a results row says of the paused time left out of its makespan ("" for none)."""
    return f"paused {paused_s:.1f} s, not counted" if round(paused_s, 1) > 0 else ""


def _numbered(s: RunSummary, n: int) -> RunSummary:
    return replace(s, label=f"#{n}")


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)
