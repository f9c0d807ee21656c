"""The Teaching panel's "What if" tab: the study, or a grid row, on simulated hardware.

Pick a profile (`engine.sim.simulate.PROFILES`, or this machine's backends as they are configured
now), edit it in the table (cap, KV cells, the rates the router is told, how much faster the
device really is), pick a workload, and simulate it under the hybrid policies and the first
backend alone. Beside the simulated rows, "Run live" sends the same workload to this machine's
backends with the current policy, and the row "sim: this machine" predicts that run.

The simulation runs the real router and schedulers (`engine.sim.simulate`): it takes from under a
second (the study) to a few seconds (N in the hundreds), so it runs on a `Worker` thread and
the results come back on the main thread.

Thread contract: main thread only (a widget). The simulation's callable captures immutable
values (a `Profile`, a `WorkloadSpec`) and touches no widget; `Worker` delivers its result on
the main thread.
"""

from __future__ import annotations

import math
from dataclasses import replace

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.core.snapshot import Rates
from engine.sim.benchmark import run_metrics
from engine.sim.simulate import PROFILES, Profile, profile_from_snapshots, simulate
from engine.sim.workload import WorkloadSpec, build_workload, seed_workload, shared_tokens_for

from .live_run import WorkloadRun
from .theme import wrap_label
from .worker import Worker

THIS_MACHINE = "this machine (as configured)"
PROFILE_COLUMNS = ("backend", "device", "cap", "KV cells", "prefill/s", "decode/s", "speed ×")
RESULT_COLUMNS = ("run", "policy", "makespan s", "TTFT p50 s", "TTFT p95 s", "routed")
WORKLOADS = {
    "the study (shared 96 %, out 128, every 50 ms)": (96, "fixed", "interval"),
    "grid: shared 0 %, out 128, every 50 ms": (0, "fixed", "interval"),
    "grid: shared 50 %, out 16-256, Poisson 20/s": (50, "uniform", "poisson"),
    "grid: shared 96 %, out 16-256, Poisson 20/s": (96, "uniform", "poisson"),
}


def workload_spec(name: str, n: int) -> WorkloadSpec:
    """The named workload with `n` requests (the study's is `seed_workload`)."""
    shared, output, arrival = WORKLOADS[name]
    if name.startswith("the study"):
        return seed_workload(n)
    return WorkloadSpec(n, 516, shared_tokens_for(shared / 100, 516), output=output, arrival=arrival).validate()


def simulate_rows(profile: Profile, spec: WorkloadSpec, policies: list[str], run_label: str) -> list[dict]:
    """One row per policy: the simulated run's metrics (runs on a worker thread)."""
    wl = build_workload(spec, 0)
    rows = []
    for policy in policies:
        m = run_metrics(simulate(profile, wl, policy).records)
        rows.append({"run": run_label, "policy": policy, "makespan": m.makespan_s, "ttft50": m.ttft_p50_s,
                     "ttft95": m.ttft_p95_s, "routed": m.routed})
    return rows


class WhatIfPanel(QWidget):
    status_message = Signal(str)
    simulated = Signal()  # the result table was refilled from a simulation

    def __init__(self, engine, bridge, parent: QWidget | None = None):
        super().__init__(parent)
        self.engine = engine
        self.bridge = bridge
        self.worker: Worker | None = None
        self.live: WorkloadRun | None = None
        self.rows: list[dict] = []
        self._build()
        self.load_profile(self.profile_box.currentText())

    # ---- layout ----

    def _build(self) -> None:
        left = QGroupBox("Hardware profile")
        lv = QVBoxLayout(left)
        self.profile_box = QComboBox()
        self.profile_box.addItems([*PROFILES, THIS_MACHINE])
        self.profile_box.currentTextChanged.connect(self.load_profile)
        self.description = QLabel()
        self.description.setObjectName("muted")
        wrap_label(self.description)
        self.table = QTableWidget(0, len(PROFILE_COLUMNS))
        self.table.setHorizontalHeaderLabels(PROFILE_COLUMNS)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.table.verticalHeader().setVisible(False)
        self.table.setToolTip("Edit a cell: caps, KV room and the router's rates; 'speed ×' makes the "
                              "simulated device faster or slower than the rates the router is told")
        self.table.verticalHeader().setDefaultSectionSize(22)
        self.workload_box = QComboBox()
        self.workload_box.addItems(list(WORKLOADS))
        self.n_box = QSpinBox(minimum=1, maximum=2000, value=8)
        form = QFormLayout()
        form.addRow("Profile", self.profile_box)
        form.addRow("Workload", self.workload_box)
        form.addRow("Requests", self.n_box)
        lv.addLayout(form)
        lv.addWidget(self.table)
        lv.addWidget(self.description)
        lv.addStretch(1)
        buttons = QHBoxLayout()
        self.simulate_button = QPushButton("Simulate")
        self.simulate_button.setObjectName("primary")
        self.simulate_button.clicked.connect(self.simulate)
        self.live_button = QPushButton("Run live on this machine")
        self.live_button.setToolTip("The same workload on this machine's backends with the current policy, "
                                    "beside its simulation on 'this machine (as configured)'")
        self.live_button.clicked.connect(self.run_live)
        buttons.addWidget(self.simulate_button)
        buttons.addWidget(self.live_button)
        lv.addLayout(buttons)

        right = QGroupBox("Simulated and live, side by side")
        rv = QVBoxLayout(right)
        self.results = QTableWidget(0, len(RESULT_COLUMNS))
        self.results.setHorizontalHeaderLabels(RESULT_COLUMNS)
        self.results.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.results.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.results.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.ResizeToContents)
        self.results.verticalHeader().setDefaultSectionSize(22)
        self.results.verticalHeader().setVisible(False)
        self.note = QLabel("Simulate to see where each policy sends the work on this profile; the real router "
                           "and schedulers run on a virtual clock.")
        self.note.setObjectName("muted")
        wrap_label(self.note)
        rv.addWidget(self.results, 1)
        rv.addWidget(self.note)

        split = QSplitter()
        split.addWidget(left)
        split.addWidget(right)
        split.setSizes([560, 640])
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(split)

    # ---- the profile ----

    def base_profile(self, name: str) -> Profile:
        if name == THIS_MACHINE:
            return profile_from_snapshots("this-machine", self.engine.snapshot(),
                                          "this machine's backends, rates, caps and contexts as configured now")
        return PROFILES[name]

    def load_profile(self, name: str) -> None:
        p = self.base_profile(name)
        self.description.setText(p.description)
        self.table.setRowCount(len(p.backends))
        self.table.setFixedHeight(self.table.horizontalHeader().sizeHint().height() + 22 * len(p.backends) + 4)
        for i, b in enumerate(p.backends):
            speed = b.hw.decode_tok_s / b.rates.decode_tok_s if b.rates.decode_tok_s else 1.0
            values = (b.name, b.device, b.cap, b.kv_cells, b.rates.prefill_tok_s, b.rates.decode_tok_s, speed)
            for k, v in enumerate(values):
                item = QTableWidgetItem(f"{v:g}" if isinstance(v, float) else str(v))
                self.table.setItem(i, k, item)

    def profile(self) -> Profile:
        """The profile as edited in the table; ValueError names a bad cell."""
        base = self.base_profile(self.profile_box.currentText())
        backends = []
        for i, b in enumerate(base.backends):
            cell = [it.text() if (it := self.table.item(i, k)) is not None else "" for k in range(len(PROFILE_COLUMNS))]
            try:
                cap, kv = int(cell[2]), int(cell[3])
                prefill, decode, speed = float(cell[4]), float(cell[5]), float(cell[6])
            except ValueError:
                raise ValueError(f"{b.name}: every cell must be a number") from None
            if cap < 1 or kv < 0 or prefill <= 0 or decode <= 0 or speed <= 0:
                raise ValueError(f"{b.name}: cap ≥ 1, KV cells ≥ 0, rates and speed > 0")
            rates = b.rates
            if (prefill, decode) != (rates.prefill_tok_s, rates.decode_tok_s):
                keep_steps = decode == rates.decode_tok_s
                rates = Rates(prefill, decode, rates.step_alpha_s if keep_steps else 0.0,
                              rates.step_beta_s if keep_steps else 0.0, "edited",
                              rates.step_table if keep_steps else ())
            hw_base = b.hw if (prefill, decode) == (b.rates.prefill_tok_s, b.rates.decode_tok_s) else rates
            old_speed = b.hw.decode_tok_s / b.rates.decode_tok_s if b.rates.decode_tok_s else 1.0
            factor = speed / old_speed if hw_base is b.hw else speed
            alpha, beta, table = hw_base.scaled(1.0 / factor)
            hw = Rates(hw_base.prefill_tok_s * factor, hw_base.decode_tok_s * factor, alpha, beta, "edited", table)
            backends.append(replace(b, cap=cap, kv_cells=kv, rates=rates,
                                    hardware=None if math.isclose(factor, 1.0) and hw_base is rates else hw))
        return replace(base, backends=tuple(backends))

    # ---- simulate ----

    def simulate(self) -> None:
        try:
            profile = self.profile()
        except ValueError as e:
            self.note.setText(f"Not simulated: {e}")
            return
        spec = workload_spec(self.workload_box.currentText(), self.n_box.value())
        single = next((f"only:{b.name}" for b in profile.backends), "gpu-only")
        policies = ["seed-score", "predicted-finish", "cache-aware", single]
        label = f"sim: {profile.name}"
        self._start_worker(lambda: simulate_rows(profile, spec, policies, label), replace_rows=True)

    def _start_worker(self, fn, replace_rows: bool) -> None:
        if self.worker is not None and self.worker.running:
            return
        self.simulate_button.setEnabled(False)
        self.note.setText("Simulating…")
        self.worker = Worker(fn, name="what-if", owner=self)
        self.worker.returned.connect(lambda rows: self._show(rows, replace_rows))
        self.worker.errored.connect(lambda e: self.note.setText(f"Simulation failed: {e}"))
        self.worker.finished.connect(lambda: self.simulate_button.setEnabled(True))
        self.worker.start()

    def _show(self, rows: list[dict], replace_rows: bool) -> None:
        self.rows = rows if replace_rows else [r for r in self.rows if not r["run"].startswith("sim: this")] + rows
        self.results.setRowCount(len(self.rows))
        for i, r in enumerate(self.rows):
            routed = ", ".join(f"{b} {n}" for b, n in sorted(r["routed"].items()))
            cells = (r["run"], r["policy"], _num(r["makespan"]), _num(r["ttft50"]), _num(r["ttft95"]), routed)
            for k, v in enumerate(cells):
                self.results.setItem(i, k, QTableWidgetItem(v))
        best_single = min((r["makespan"] for r in self.rows if r["policy"].startswith("only:")), default=math.nan)
        hybrid = [r for r in self.rows if r["run"].startswith("sim:") and not r["policy"].startswith("only:")]
        if hybrid and math.isfinite(best_single):
            best = min(hybrid, key=lambda r: r["makespan"])
            self.note.setText(compare_text(best["policy"], best["makespan"], best_single))
        self.simulated.emit()

    # ---- live ----

    def run_live(self) -> None:
        if self.live is not None and self.live.running:
            self.live.stop()
            return
        spec = workload_spec(self.workload_box.currentText(), self.n_box.value())
        self.live = WorkloadRun(self.engine, self.bridge, spec, label="what-if", parent=self)
        self.live.phase.connect(self._on_live_phase)
        self.live.start()

    def _on_live_phase(self, phase: str) -> None:
        running = phase in ("flushing", "warming", "running")
        self.live_button.setText("Stop" if running else "Run live on this machine")
        if phase != "done" or self.live is None:
            self.note.setText(f"Live run: {phase}")
            return
        m = self.live.result.summary().metrics
        policy = self.live.result.policy
        row = {"run": "live: this machine", "policy": policy, "makespan": m.makespan_s, "ttft50": m.ttft_p50_s,
               "ttft95": m.ttft_p95_s, "routed": m.routed}
        profile = profile_from_snapshots("this-machine", self.engine.snapshot())
        spec = self.live.spec
        self.rows = [r for r in self.rows if not r["run"].startswith("live")] + [row]
        self._start_worker(lambda: simulate_rows(profile, spec, [policy], "sim: this machine"),
                           replace_rows=False)


def compare_text(policy: str, makespan_s: float, alone_s: float) -> str:
    """The best hybrid policy against the first backend alone, in words: 'sooner' for a shorter
    makespan, 'later' for a longer one, the two times after."""
    if not (math.isfinite(makespan_s) and math.isfinite(alone_s) and alone_s > 0):
        return f"Best hybrid policy: {policy}."
    change = makespan_s / alone_s - 1
    if abs(change) < 0.0005:
        how = "as soon as"
    else:
        how = f"{abs(change) * 100:.1f} % {'sooner' if change < 0 else 'later'} than"
    return (f"Best hybrid policy: {policy}. It finishes the work {how} the first backend alone "
            f"({makespan_s:.3f} s against {alone_s:.3f} s).")


def _num(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) else "—"
