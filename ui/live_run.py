"""The study's workload, run live on the current engine without blocking the GUI thread.

Prompts, lengths and arrival times come from `engine.sim.workload` (the same workloads `tandem
bench` runs): by default the study's, a 496-token prefix shared by every prompt plus 20 tokens
of its own, 128 generated tokens each (end-of-sequence ignored), one request every 50 ms.

`WorkloadRun` is a small state machine driven by Qt timers and the bridge's signals: flush the
caches, warm the shared prefix on every backend, submit each request at its arrival time
without waiting, collect each `FinishRecord` from `bridge.finished`, and emit `done` with the
records and the routing decisions. Warm and flush run on the backends' workers and are polled
once per tick, so nothing here blocks.

With `reuse_warm` (a demo, the Teaching panel's live run: runs to watch, not to measure) a run
whose shared prefix every backend already holds (warmed while a lesson's model loaded, or by an
earlier run) skips the flush and the warming and sends its first arrival at once; the
Experiments panel's runs start from a fresh state.

`pause()` stops new arrivals being submitted (what the engine already holds keeps running);
`step()` submits the next arrival at once (pausing first); `resume()` goes on with the remaining
arrivals at their original spacing. Arrival times run on the run's `engine.sim.arrivals.ArrivalClock`,
which stands still while paused, so a pause shifts the arrivals still to come instead of
releasing them in a burst. The run keeps each request's submit time and the clock's pauses,
so its summary's makespan leaves out the time it stood paused with nothing in flight (time
paused while requests ran stays in; `ui.live_stats.summarize`).

Thread contract: main thread only (a QObject driven by Qt timers and the bridge's signals).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from PySide6.QtCore import QObject, Qt, QTimer, Signal

from engine.core.handle import RequestHandle
from engine.core.request import Request, SamplingParams
from engine.lesson import cached_everywhere
from engine.sim.arrivals import ArrivalClock
from engine.sim.benchmark import RunSummary
from engine.sim.workload import TOKEN_HIGH, WorkloadSpec, build_workload, seed_workload, with_requests

from .model.live_stats import summarize

STUDY = seed_workload(8)

__all__ = ["STUDY", "RunResult", "WorkloadRun", "WorkloadSpec", "seed_workload", "with_requests"]


@dataclass
class RunResult:
    label: str
    policy: str
    spec: WorkloadSpec
    t_start: float = 0.0
    t_end: float = 0.0
    request_ids: list[str] = field(default_factory=list)
    submitted: dict = field(default_factory=dict)  # request id -> monotonic time it was submitted
    pauses: list = field(default_factory=list)  # the arrival clock's pauses, read when the run ends
    records: dict = field(default_factory=dict)  # request id -> FinishRecord
    decisions: dict = field(default_factory=dict)  # request id -> RoutingDecision
    error: str | None = None

    def ordered_records(self) -> list:
        return [self.records[r] for r in self.request_ids if r in self.records]

    def ordered_decisions(self) -> list:
        return [self.decisions[r] for r in self.request_ids if r in self.decisions]

    def summary(self) -> RunSummary:
        return summarize(self.label, self.policy, self.ordered_records(), self.t_start, self.t_end or time.monotonic(),
                         submitted=self.submitted, pauses=self.pauses)


class WorkloadRun(QObject):
    """One live run. Create, connect `progress`/`done`, call `start()`; `stop()` cancels."""

    phase = Signal(str)  # "flushing", "warming", "running", "done", "stopped", "failed"
    progress = Signal(int, int)  # finished requests, total
    paused_changed = Signal(bool)
    submitted = Signal(int, int)  # submitted requests, total
    done = Signal(object)  # RunResult

    def __init__(self, engine, bridge, spec: WorkloadSpec = STUDY, label: str = "run", run: int = 0,
                 parent: QObject | None = None, reuse_warm: bool = False):
        super().__init__(parent)
        self.engine = engine
        self.bridge = bridge
        self.spec = spec
        self.reuse_warm = reuse_warm
        self.result = RunResult(label, engine.router.policy, spec)
        self.state = "idle"
        self._handles: dict[str, RequestHandle] = {}
        self._pending: list[Future | RequestHandle] = []  # futures / warm handles we wait for
        self._next = 0
        self.clock = ArrivalClock()  # arrival times; stands still while paused
        vocab = min(engine.n_vocab or TOKEN_HIGH, TOKEN_HIGH)
        self.workload = build_workload(replace(spec, vocab_size=vocab), run)
        self._submit_timer = QTimer(self)
        self._submit_timer.setSingleShot(True)
        self._submit_timer.setTimerType(Qt.TimerType.PreciseTimer)
        self._submit_timer.timeout.connect(self._submit_due)
        bridge.tick.connect(self._on_tick)
        bridge.finished.connect(self._on_finished)

    @property
    def running(self) -> bool:
        return self.state in ("flushing", "warming", "running")

    @property
    def paused(self) -> bool:
        return self.clock.paused

    @property
    def n_submitted(self) -> int:
        return self._next

    @property
    def n_requests(self) -> int:
        return len(self.workload.requests)

    @property
    def label(self) -> str:
        return self.result.label

    def pause(self) -> bool:
        """Stop submitting arrivals; the requests already submitted run on. False if not running."""
        if not self.running or not self.clock.pause():
            return False
        self._submit_timer.stop()
        self.paused_changed.emit(True)
        return True

    def resume(self) -> bool:
        """Submit the remaining arrivals again, keeping their spacing from where the clock stopped."""
        if not self.clock.resume():
            return False
        self.paused_changed.emit(False)
        if self.state == "running":
            self._submit_due()
        return True

    def step(self) -> bool:
        """Submit the next arrival now and stay paused (pausing first). False if there is none to
        submit: the run is over, every arrival is in, or it is still flushing or warming."""
        if self.state != "running" or self._next >= len(self.workload.requests):
            return False
        was_paused = self.clock.paused
        self.clock.step()
        self._submit_timer.stop()
        if not was_paused:
            self.paused_changed.emit(True)
        self._submit_due()
        return True

    def start(self) -> None:
        if self.state != "idle":
            raise RuntimeError("a WorkloadRun runs once")
        try:
            if self.reuse_warm and self.workload.prefix and cached_everywhere(self.engine, self.workload.prefix):
                self._start_submitting()  # warmed ahead (a lesson's load): nothing to wait for
                return
            self._pending = self.engine.flush(wait=False)
            self._set("flushing")
        except Exception as e:  # shown to the user, the app goes on
            self._fail(str(e))

    def stop(self) -> None:
        """Cancel every request of this run (they finish as cancelled)."""
        if not self.running:
            return
        self._submit_timer.stop()
        for h in self._handles.values():
            h.cancel()
        self._finish("stopped")

    # ---- state machine ----

    def _set(self, state: str) -> None:
        self.state = state
        self.phase.emit(state)

    def _start_warm(self) -> None:
        if self.workload.prefix:
            self._pending = self.engine.warm(self.workload.prefix, wait=False)
            self._set("warming")
        else:
            self._start_submitting()

    def _start_submitting(self) -> None:
        self._pending = []
        self._set("running")
        self.result.policy = self.engine.router.policy
        self.result.t_start = time.monotonic()
        self.clock.start()
        self._submit_due()

    def _submit_due(self) -> None:
        """Submit every request whose arrival time has come, then sleep until the next one."""
        requests = self.workload.requests
        while self.state == "running" and self._next < len(requests) and self.clock.take(requests[self._next].arrival_s):
            if not self._submit_next():
                return
        if self.state == "running" and not self.clock.paused and self._next < len(requests):
            wait = requests[self._next].arrival_s - self.clock.now()
            self._submit_timer.start(max(0, round(wait * 1000)))

    def _submit_next(self) -> bool:
        spec = self.workload.requests[self._next]
        self._next += 1
        sampling = SamplingParams(temperature=0.0, max_tokens=spec.output_tokens, ignore_eos=True)
        t_submit = time.monotonic()  # just before the engine's own: a request's end is t_submit + e2e_s
        try:
            handle = self.engine.submit(Request(spec.prompt, sampling, source="workload"))
        except Exception as e:  # shown to the user, the app goes on
            self._fail(f"submitting request {self._next}: {e}")
            return False
        self.result.request_ids.append(handle.id)
        self.result.submitted[handle.id] = t_submit
        self.result.decisions[handle.id] = handle.decision
        self._handles[handle.id] = handle
        self.submitted.emit(self._next, len(self.workload.requests))
        return True

    def _on_tick(self, _tick) -> None:
        if self.state not in ("flushing", "warming"):
            return
        if not all(p.done() if isinstance(p, Future) else p.done for p in self._pending):
            return
        if self.state == "flushing":
            self._start_warm()
        else:
            errors = [p.result(0).error for p in self._pending if p.result(0).error]
            if errors:
                self._fail(f"warming failed: {errors[0]}")
            else:
                self._start_submitting()

    def _on_finished(self, record) -> None:
        if record.request_id not in self._handles or record.request_id in self.result.records:
            return
        self.result.records[record.request_id] = record
        self.progress.emit(len(self.result.records), self.spec.n_requests)
        if self.state == "running" and len(self.result.records) == len(self.workload.requests):
            self._finish("done")

    def _fail(self, why: str) -> None:
        self.result.error = why
        self._submit_timer.stop()
        for h in self._handles.values():
            h.cancel()
        self._finish("failed")

    def _finish(self, state: str) -> None:
        self.clock.close()
        self.result.t_end = time.monotonic()
        self.result.pauses = self.clock.pauses()
        self.bridge.tick.disconnect(self._on_tick)
        self.bridge.finished.disconnect(self._on_finished)
        self._set(state)
        self.done.emit(self.result)

