"""The study's workload, run live on the current engine from the GUI thread.

`study_prompts()` builds the study's requests for any model: a shared prefix of
`prefix_tokens` (warmed into every backend's cache first) followed by a unique suffix, so each
request can reuse exactly the warmed prefix (the study: 496 cached + 20 new = 516 tokens), and
a fixed `max_tokens` with end-of-sequence ignored (every request generates exactly that many).

`WorkloadRun` is a small state machine driven by Qt timers and the bridge's signals: optionally
flush the caches, warm the prefix on every backend, submit one request every `interval_s`
without waiting, collect each `FinishRecord` from `bridge.finished`, and emit `done` with the
records and the routing decisions. Nothing blocks the GUI thread: warm and flush run on the
backends' workers and are polled each tick.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from PySide6.QtCore import QObject, QTimer, Signal

from engine.request import Request, SamplingParams

from .metrics import RunSummary, summarize

_TEXT = (
    "Tandem runs one language model on two devices at once. Each request goes, whole, to the "
    "backend whose queue would finish it soonest by a simple score: prompt tokens left to compute "
    "divided by the prefill rate, plus the decode budget divided by the decode rate. The study this "
    "project re-creates found that a CPU backend can take a few requests while the GPU queue is "
    "deep and the prompts reuse a cached prefix, and the whole batch finishes earlier. "
)


@dataclass(frozen=True)
class WorkloadSpec:
    n_requests: int = 8
    prefix_tokens: int = 496
    suffix_tokens: int = 20
    max_tokens: int = 128
    interval_s: float = 0.05
    flush_first: bool = True
    warm: bool = True

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + self.suffix_tokens


STUDY = WorkloadSpec()


def study_prompts(model, spec: WorkloadSpec) -> tuple[list[int], list[tuple[int, ...]]]:
    """(shared prefix, one prompt per request): prompts are prefix + a unique suffix."""
    prefix: list[int] = []
    while len(prefix) < spec.prefix_tokens:
        prefix = model.tokenize(_TEXT * (1 + len(prefix) // 40 + spec.prefix_tokens // 60))
    prefix = prefix[: spec.prefix_tokens]
    filler = model.tokenize(" Please answer in one short paragraph, with an example.", add_special=False)
    prompts = []
    for i in range(spec.n_requests):
        suffix = model.tokenize(f" Request {i + 1}:", add_special=False)
        while len(suffix) < spec.suffix_tokens:
            suffix += filler
        prompts.append(tuple(prefix + suffix[: spec.suffix_tokens]))
    return prefix, prompts


@dataclass
class RunResult:
    label: str
    policy: str
    spec: WorkloadSpec
    t_start: float = 0.0
    t_end: float = 0.0
    request_ids: list[str] = field(default_factory=list)
    records: dict = field(default_factory=dict)  # request id -> FinishRecord
    decisions: dict = field(default_factory=dict)  # request id -> RoutingDecision
    error: str | None = None

    def ordered_records(self) -> list:
        return [self.records[r] for r in self.request_ids if r in self.records]

    def ordered_decisions(self) -> list:
        return [self.decisions[r] for r in self.request_ids if r in self.decisions]

    def summary(self) -> RunSummary:
        return summarize(self.label, self.policy, self.ordered_records(), self.t_start, self.t_end or time.monotonic())


class WorkloadRun(QObject):
    """One live run. Create, connect `progress`/`done`, call `start()`; `stop()` cancels."""

    phase = Signal(str)  # "flushing", "warming", "running", "done", "stopped", "failed"
    progress = Signal(int, int)  # finished requests, total
    done = Signal(object)  # RunResult

    def __init__(self, engine, bridge, spec: WorkloadSpec = STUDY, label: str = "run",
                 parent: QObject | None = None):
        super().__init__(parent)
        self.engine = engine
        self.bridge = bridge
        self.spec = spec
        self.result = RunResult(label, engine.router.policy, spec)
        self.state = "idle"
        self._handles = {}
        self._pending = []  # futures / warm handles we wait for
        self._next = 0
        self._prefix, self._prompts = study_prompts(engine.model, spec)
        self._submit_timer = QTimer(self)
        self._submit_timer.setInterval(max(1, round(spec.interval_s * 1000)))
        self._submit_timer.timeout.connect(self._submit_next)
        bridge.tick.connect(self._on_tick)
        bridge.finished.connect(self._on_finished)

    @property
    def running(self) -> bool:
        return self.state in ("flushing", "warming", "running")

    def start(self) -> None:
        if self.state != "idle":
            raise RuntimeError("a WorkloadRun runs once")
        try:
            if self.spec.flush_first:
                self._pending = [b.flush() for b in self.engine.backends.values()]
                self._set("flushing")
            else:
                self._start_warm()
        except Exception as e:  # noqa: BLE001  (shown to the user, the app goes on)
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
        if self.spec.warm and self.spec.prefix_tokens > 0:
            self._pending = [b.warm(self._prefix) for b in self.engine.backends.values()]
            self._set("warming")
        else:
            self._start_submitting()

    def _start_submitting(self) -> None:
        self._pending = []
        self._set("running")
        self.result.policy = self.engine.router.policy
        self.result.t_start = time.monotonic()
        self._submit_next()
        if self._next < len(self._prompts):
            self._submit_timer.start()

    def _submit_next(self) -> None:
        if self._next >= len(self._prompts) or self.state != "running":
            self._submit_timer.stop()
            return
        sampling = SamplingParams(temperature=0.0, max_tokens=self.spec.max_tokens, ignore_eos=True)
        request = Request(self._prompts[self._next], sampling, source="workload")
        self._next += 1
        try:
            handle = self.engine.submit(request)
        except Exception as e:  # noqa: BLE001
            self._fail(f"submitting request {self._next}: {e}")
            return
        self.result.request_ids.append(handle.id)
        self.result.decisions[handle.id] = handle.decision
        self._handles[handle.id] = handle
        if self._next >= len(self._prompts):
            self._submit_timer.stop()

    def _on_tick(self, _tick) -> None:
        if self.state not in ("flushing", "warming"):
            return
        if not all(p.done() if hasattr(p, "add_done_callback") else p.done for p in self._pending):
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
        if self.state == "running" and len(self.result.records) == self.spec.n_requests:
            self._finish("done")

    def _fail(self, why: str) -> None:
        self.result.error = why
        self._submit_timer.stop()
        for h in self._handles.values():
            h.cancel()
        self._finish("failed")

    def _finish(self, state: str) -> None:
        self.result.t_end = time.monotonic()
        self.bridge.tick.disconnect(self._on_tick)
        self.bridge.finished.disconnect(self._on_finished)
        self._set(state)
        self.done.emit(self.result)


def with_requests(spec: WorkloadSpec, n: int) -> WorkloadSpec:
    return replace(spec, n_requests=n)
