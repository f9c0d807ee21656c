"""The experiment runner: one workload driven through a loaded `Engine` and recorded, from a
fresh engine state. `tandem bench seed|grid` (`bench/study.py`) and the desktop app's
Experiments panel (`ui/experiments.py`, through `experiment_runner`) both run through it, so
the command line and the GUI measure the same way.

Fresh state per run, without reloading the model (`EngineRunner._fresh_state`): the routing
policy set, the router's history and policy state cleared, caps and rates restored to those the
engine was loaded with (or the variant's cap on the swept backend), every backend's prefix
cache flushed (its KV freed), then the workload's shared prefix (and, with `warm_tenants`, every
tenant's prefix) warmed on every backend. Timing starts at the first submission.

Arrivals follow the wall clock, or an `engine.sim.arrivals.ArrivalClock` that a person can pause and
step (the app); a closed clock submits nothing more, and what was submitted is still waited for
and recorded. The clock's pauses come back with the records (`Collected.pauses`), so the run's
makespan leaves out the time it stood paused with nothing in flight (`run_metrics(records,
pauses)`); time paused while requests still ran stays in. A request the engine refuses, or one that outlives `timeout`, is a failed record,
not an exception: a failure is data.

Thread contract: `EngineRunner.run` blocks until every submitted request has finished (or
timed out) and must run on one thread at a time per runner (it resets the engine's shared
state); it is never the GUI thread (the app calls it on a `ui.worker.Worker`). `on_done` is
called on that thread, once per request. `close()` detaches the online rate refresh and may be
called from any thread once `run` has returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine.core.errors import EngineError
from engine.core.handle import RequestHandle
from engine.core.request import Request, RequestStatus, SamplingParams
from engine.rates.refresh import OnlineRefresh
from engine.sim.arrivals import ArrivalClock
from engine.sim.benchmark import RequestRecord, RunSummary, decision_line, run_metrics
from engine.sim.workload import TOKEN_HIGH, RequestSpec, Workload, WorkloadSpec, build_workload

from .engine import Engine

SINGLE_POLICIES = ("gpu-only", "cpu-only")


@dataclass(frozen=True)
class Variant:
    """One row of the results: a routing policy, optionally with the swept backend's cap changed
    (`gpu-only@cap=8`; cap 0: its adaptive cap), or an HTTP peer the bench runs instead
    (`target`, a `bench.target.Target`; the engine runner never reads it)."""

    label: str
    policy: str | None = None  # engine routing policy
    cap: int | None = None  # cap of the swept backend for this variant
    target: object = None

    @property
    def single(self) -> bool:
        """Everything on one engine backend."""
        return self.policy is not None and (self.policy in SINGLE_POLICIES or self.policy.startswith("only:"))


@dataclass
class Collected:
    """One run's per-request records, the router's decisions (as `decisions.jsonl` lines) and
    when its arrivals were paused (seconds on the records' clock; end None: still paused)."""

    records: list[RequestRecord] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    pauses: list[tuple[float, float | None]] = field(default_factory=list)


class EngineRunner:
    """Runs one workload under one variant on a loaded engine, from a fresh state."""

    def __init__(self, eng: Engine, *, sweep_backend: str | None, budget: str, online: bool,
                 timeout: float, warm_tenants: bool = False):
        self.eng = eng
        self.warm_tenants = warm_tenants
        self.sweep_backend = sweep_backend
        self.timeout = timeout
        # Each backend's cap as loaded: (cap, adaptive), cap 0 for `auto`.
        loaded = {n: b.cap_state() for n, b in eng.backends.items()}
        self.caps = {n: (0 if s.auto else s.cap, s.adaptive) for n, s in loaded.items()}
        self.rates = {n: b.rates for n, b in eng.backends.items()}
        eng.router.set_budget(budget)
        self.online = OnlineRefresh(eng).attach() if online else None

    def run(self, workload: Workload, variant: Variant, on_done: Callable[[], object] | None = None,
            clock: ArrivalClock | None = None) -> Collected:
        """`clock` (the app's experiments) times the arrivals instead of the wall clock, so a
        person can pause and step them; a closed clock sends no more."""
        eng = self.eng
        self._fresh_state(workload, variant)
        submitted: list[tuple[RequestSpec, float, RequestHandle | None, str | None]] = []
        t0 = time.monotonic()
        if clock is not None:
            clock.start()
        for spec in workload.requests:
            # The budget the router sees; a shorter drawn length ends the request early, unseen.
            sp = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
            if clock is not None:
                if not clock.wait_for(spec.arrival_s):
                    break
            elif (delay := t0 + spec.arrival_s - time.monotonic()) > 0:
                time.sleep(delay)
            t_submit = time.monotonic() - t0
            try:
                stop = spec.output_tokens if spec.output_tokens < spec.max_tokens else None
                submitted.append((spec, t_submit, eng.submit(Request(spec.prompt, sp, source="bench", stop_after=stop)),
                                  None))
            except EngineError as e:  # a failure is data
                submitted.append((spec, t_submit, None, str(e)))
        out = Collected()
        name = workload.spec.name()
        for spec, t_submit, handle, error in submitted:
            record = None
            if handle is not None:
                try:
                    record = handle.result(self.timeout)
                except TimeoutError as e:
                    handle.cancel()
                    error = str(e)
            out.records.append(_engine_record(name, variant.label, workload, spec, t_submit, handle, record, error))
            if handle is not None and handle.decision is not None:
                out.decisions.append(decision_line(handle.decision, t0, workload=name, run=workload.run,
                                                   requests=len(workload.requests), label=variant.label))
            if on_done is not None:
                on_done()
        if clock is not None:
            out.pauses = [(a - t0, None if b is None else b - t0) for a, b in clock.pauses()]
        return out

    def _fresh_state(self, workload: Workload, variant: Variant) -> None:
        eng = self.eng
        if variant.policy is None:
            raise ValueError(f"variant {variant.label!r} names no routing policy: the engine runner cannot run it")
        eng.router.set_policy(variant.policy)
        eng.router.clear()
        for n, b in eng.backends.items():
            if variant.cap is not None and n == self.sweep_backend:  # a fixed cap, or 0: adaptive
                cap, adaptive = variant.cap, variant.cap == 0
            else:
                cap, adaptive = self.caps[n]
            b.set_cap(cap or None, adaptive=adaptive)  # every run starts an adaptive limit afresh
        if self.online is not None:
            self.online.reset(self.rates)
        else:
            for n, r in self.rates.items():
                eng.set_rates(n, r)
        eng.flush(timeout=self.timeout)
        if workload.prefix:
            eng.warm(workload.prefix, timeout=self.timeout)
        if self.warm_tenants:
            for prefix in workload.prefixes:
                eng.warm(prefix, timeout=self.timeout)

    def close(self) -> None:
        if self.online is not None:
            self.online.detach()


def experiment_runner(eng: Engine) -> Callable[..., RunSummary]:
    """The desktop app's experiments run through this runner: fn(spec, policy, run, on_done) -> RunSummary.

    Blocking; the experiments panel calls it on a worker thread. Fresh engine state per run
    (caches flushed, prefix re-warmed, router cleared, caps and rates restored). `clock` (an
    `engine.sim.arrivals.ArrivalClock`) lets the panel pause and step the arrivals; the makespan
    leaves out its pauses' idle part (`RunMetrics.paused_s`).
    """
    def run(spec: WorkloadSpec, policy: str, run_index: int, on_done: Callable[..., object] | None,
            clock: ArrivalClock | None = None) -> RunSummary:
        runner = EngineRunner(eng, sweep_backend=None, budget=eng.router.budget, online=False, timeout=600.0)
        try:
            workload = build_workload(replace(spec, vocab_size=min(eng.n_vocab, TOKEN_HIGH)), run_index)
            collected = runner.run(workload, Variant(label=policy, policy=policy), on_done=on_done, clock=clock)
        finally:
            runner.close()
        return RunSummary(policy, policy, run_metrics(collected.records, collected.pauses))

    return run


def _engine_record(name, label, workload, spec, t_submit, handle, record, error) -> RequestRecord:
    """A request's record from its finish record, or a failed one from `error`."""
    common = dict(workload=name, policy=label, run=workload.run, requests=len(workload.requests),
                  index=spec.index, t_submit_s=t_submit)
    if record is None:
        return RequestRecord(**common, request_id=handle.id if handle else f"unsubmitted-{spec.index}",
                             backend=(handle.backend if handle else None) or "", success=False,
                             finish_reason="error", prompt_tokens=len(spec.prompt), cached_tokens=-1,
                             output_tokens=0, queue_s=None, ttft_s=None, e2e_s=None, itl_s=None, error=error)
    ok = record.error is None and record.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
    return RequestRecord(**common, request_id=record.request_id, backend=record.backend, success=ok,
                         finish_reason=record.finish_reason, prompt_tokens=record.prompt_tokens,
                         cached_tokens=record.cached_tokens, output_tokens=record.output_tokens,
                         queue_s=record.queue_s, ttft_s=record.ttft_s, e2e_s=record.e2e_s, itl_s=record.itl_s,
                         error=record.error, cap=record.cap_at_admit, cap_reason=record.cap_reason)
