"""The adaptive concurrency limiter (engine/sched/limiter.py): its rules on scripted steps, and a
replay of the H200's measured step times through the real scheduler (no model, a virtual
clock), where the limit must land near the best fixed cap in hindsight.

The replay's step model, each figure from a committed GPU run (Qwen2.5-0.5B shape, Q8_0):
  - decode step at batch b without its attention part: 1.16 / 1.66 / 2.15 / 3.80 / 4.40 ms
    at b = 1 / 4 / 8 / 16 / 32 (`docs/results/gpu/speed10/overhead_gpu.txt`: 858 / 2,357 /
    3,557 / 3,916 / 6,016 tok/s after a 516-token prompt, less the attention term below),
    then +0.094 ms per sequence (the 8 → 32 slope);
  - attention: 4 ns per decoded token per KV cell in use, the value that gives the long-prompt
    workload's measured cap 16 / cap 32 makespan ratio (7.14 / 6.15 s = 0.86);
  - prefill: 53,514 tok/s (`docs/results/gpu/rates.json`).
"""

from __future__ import annotations

import math
import random

import pytest

from engine.core.request import Request, SamplingParams
from engine.sched.limiter import CEILING, START, ConcurrencyLimiter
from engine.sched.scheduler import Scheduler, SchedulerConfig, SeqState

# ---- the rules, on scripted steps ----


def feed(lim: ConcurrencyLimiter, steps: int, *, batch: int, step_s: float, waiting: int,
         running: int | None = None, kv_free: int = 1 << 20, per_seq: int = 100) -> None:
    """`steps` decode-only steps of `batch` sequences taking `step_s` each."""
    for _ in range(steps):
        run = lim.limit if running is None else running
        if lim.observe(min(batch, run), 0, step_s, run, waiting):
            lim.decide(kv_free, per_seq)


def test_the_limit_grows_while_requests_wait():
    lim = ConcurrencyLimiter(64, initial=8)
    feed(lim, 4, batch=8, step_s=0.002, waiting=5)
    assert lim.limit == 16
    assert "waiting" in lim.reason


def test_the_limit_holds_without_a_queue():
    lim = ConcurrencyLimiter(64, initial=8)
    feed(lim, 200, batch=8, step_s=0.002, waiting=0, running=8)
    assert lim.limit == 8


def test_a_step_up_that_slowed_decode_is_taken_back():
    lim = ConcurrencyLimiter(64, initial=16, window=8)
    feed(lim, 16, batch=16, step_s=0.004, waiting=0, running=16)  # 4,000 tok/s at 16
    feed(lim, 2, batch=16, step_s=0.004, waiting=9, running=16)
    assert lim.limit == 24
    feed(lim, 16, batch=24, step_s=0.012, waiting=9)  # 2,000 tok/s at 24: worse
    assert lim.limit == 16
    assert lim.reason.startswith("decode fell")


def test_one_slow_window_after_a_step_up_does_not_take_it_back():
    lim = ConcurrencyLimiter(64, initial=8, window=8)
    feed(lim, 16, batch=8, step_s=0.002, waiting=0, running=8)  # 4,000 tok/s at 8
    feed(lim, 2, batch=8, step_s=0.002, waiting=9, running=8)
    assert lim.limit == 16
    feed(lim, 8, batch=16, step_s=0.008, waiting=9)  # one window at 2,000 tok/s (a hiccup)
    feed(lim, 16, batch=16, step_s=0.003, waiting=9)  # then 5,300 tok/s
    assert lim.limit >= 16
    assert "fell" not in lim.reason


def test_a_half_filled_step_up_is_not_judged():
    lim = ConcurrencyLimiter(64, initial=8, window=8)
    feed(lim, 16, batch=8, step_s=0.002, waiting=0, running=8)  # 4,000 tok/s at 8
    feed(lim, 2, batch=8, step_s=0.002, waiting=9, running=8)
    assert lim.limit == 16
    feed(lim, 64, batch=12, step_s=0.004, waiting=0, running=12)  # 3,000 tok/s at 12: a bump below 16
    assert lim.limit == 16


def test_a_step_up_that_kept_the_rate_stays():
    lim = ConcurrencyLimiter(64, initial=16, window=8)
    feed(lim, 16, batch=16, step_s=0.004, waiting=0, running=16)
    feed(lim, 2, batch=16, step_s=0.004, waiting=9, running=16)
    feed(lim, 16, batch=24, step_s=0.0061, waiting=0, running=24)  # the same tok/s
    assert lim.limit == 24


def test_kv_room_bounds_a_step_up():
    lim = ConcurrencyLimiter(64, initial=8)
    feed(lim, 4, batch=8, step_s=0.002, waiting=20, kv_free=600, per_seq=100)
    assert lim.limit == 11  # room for 3 more at twice their footprint


def test_a_preemption_cuts_the_limit_to_what_still_runs():
    lim = ConcurrencyLimiter(64, initial=32)
    assert lim.kv_full(running=20)
    assert lim.limit == 20
    assert lim.reason.startswith("KV full")


def test_a_light_load_lets_the_limit_fall_back_to_its_start():
    lim = ConcurrencyLimiter(64, initial=8)
    lim.set_ceiling(64, start=8)
    feed(lim, 4, batch=8, step_s=0.002, waiting=30)
    feed(lim, 16, batch=16, step_s=0.003, waiting=30)
    assert lim.limit == 24  # 8 → 16 → 24: doubling up to 16, half again above
    feed(lim, 16 * 10, batch=3, step_s=0.002, waiting=0, running=3)
    assert lim.limit == 8
    assert "at most 3" in lim.reason


def test_a_user_cap_is_not_decayed_below():
    lim = ConcurrencyLimiter(24)
    feed(lim, 16 * 16, batch=3, step_s=0.002, waiting=0, running=3)
    assert lim.limit == 24


def test_the_ceiling_bounds_the_limit():
    lim = ConcurrencyLimiter(12, initial=8)
    feed(lim, 64, batch=12, step_s=0.002, waiting=50)
    assert lim.limit == 12


def test_a_fixed_limit_never_moves():
    lim = ConcurrencyLimiter(8, adaptive=False)
    feed(lim, 64, batch=8, step_s=0.002, waiting=50)
    assert not lim.kv_full(running=2)
    assert lim.limit == 8


# ---- the scheduler drives it ----


class _Handle:
    def _deliver_text(self, delta: str) -> None:
        pass


def _seq(prompt, t: float, out: int, n_ctx: int) -> SeqState:
    sp = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0)
    return SeqState(Request(tuple(prompt), sp), _Handle(), None, 0, t, n_ctx_seq=n_ctx)


def test_the_scheduler_admits_up_to_the_limiters_value():
    lim = ConcurrencyLimiter(32, initial=4)
    sched = Scheduler(SchedulerConfig(cap=1, n_ctx=8192, n_ctx_seq=8192, n_seq_max=40, n_batch=512), limiter=lim,
                      piece=lambda t: b"x")
    for i in range(20):
        sched.add(_seq([1, 2, 3 + i], 0.0, 64, 8192))
    seen = []
    for _ in range(12):
        plan = sched.schedule()
        sched.take_ops()
        seen.append(len(sched.running))
        sched.update_from_output(plan, [5] * (len(plan.decode) + sum(1 for c in plan.chunks if c[3])), seconds=0.002)
        sched.take_ops()
        sched.take_finished()
    assert seen[0] == 4
    assert max(seen) == sched.cap == 8


def test_a_user_cap_on_the_scheduler_is_the_limiters_ceiling():
    lim = ConcurrencyLimiter(32, initial=8)
    sched = Scheduler(SchedulerConfig(cap=1, n_ctx=1024, n_ctx_seq=1024, n_seq_max=40, n_batch=64), limiter=lim)
    sched.set_cap(6)
    assert (sched.cap, lim.ceiling) == (6, 6)


def test_a_preemption_in_the_scheduler_lowers_the_limit():
    lim = ConcurrencyLimiter(8, initial=8)
    sched = Scheduler(SchedulerConfig(cap=1, n_ctx=64, n_ctx_seq=64, n_seq_max=16, n_batch=64), limiter=lim,
                      piece=lambda t: b"x")
    for i in range(4):
        sched.add(_seq([1, 2, 3 + i], 0.0, 60, 64))
    for _ in range(40):
        if sched.preemptions:
            break
        plan = sched.schedule()
        sched.take_ops()
        sched.take_unplaced()
        sched.update_from_output(plan, [5] * (len(plan.decode) + sum(1 for c in plan.chunks if c[3])), seconds=0.002)
        sched.take_ops()
        sched.take_finished()
    assert sched.preemptions
    assert sched.cap < 4


# ---- a replay of the H200's step table ----

_BASE_MS = {1: 1.16, 4: 1.66, 8: 2.15, 16: 3.80, 32: 4.40}
_ATTN_S = 4e-9
_PREFILL = 53514.0


def _step_s(b: int, n_prefill: int, cells: int) -> float:
    if b <= 0:
        base = 1.0
    elif b >= 32:
        base = _BASE_MS[32] + 0.094 * (b - 32)
    else:
        lo = max(k for k in _BASE_MS if k <= b)
        hi = min(k for k in _BASE_MS if k >= b)
        base = _BASE_MS[lo] if lo == hi else _BASE_MS[lo] + (_BASE_MS[hi] - _BASE_MS[lo]) * (b - lo) / (hi - lo)
    return base * 1e-3 + n_prefill / _PREFILL + _ATTN_S * max(b, 1) * cells


def _replay(reqs, prefix, cap: int | None, ceiling: int = 64, n_ctx: int = 65536,
            noise: float = 0.0, seed: int = 0) -> tuple[float, float]:
    """Makespan and TTFT p95 of `reqs` (arrival, prompt, output tokens) on a simulated H200.
    `noise`: each step's time is scaled by a log-normal factor of that sigma, and one step in
    50 takes 3× (a host hiccup: a GC pass, another process), as a shared machine's steps do."""
    now = [0.0]
    rng = random.Random(seed)
    lim = ConcurrencyLimiter(ceiling, initial=8) if cap is None else None
    sched = Scheduler(SchedulerConfig(cap=cap or 1, n_ctx=n_ctx, n_ctx_seq=n_ctx, n_seq_max=(cap or ceiling) + 8,
                                      n_batch=512), lambda: now[0], limiter=lim, piece=lambda t: b"x")

    def step(plan) -> None:
        sched.take_ops()
        sched.take_unplaced()
        dt = _step_s(len(plan.decode), plan.n_tokens - len(plan.decode), sched.kv_cells_used())
        if noise:
            dt *= rng.lognormvariate(0.0, noise) * (3.0 if rng.random() < 0.02 else 1.0)
        now[0] += dt
        sched.update_from_output(plan, [5] * (len(plan.decode) + sum(1 for c in plan.chunks if c[3])), seconds=dt)
        sched.take_ops()
        sched.take_finished()
        sched.take_unplaced()

    if prefix:  # warmed before the run, as the benchmark does
        sched.add(SeqState(Request(tuple(prefix), SamplingParams(max_tokens=1)), _Handle(), None, 0, 0.0,
                           warm=True, n_ctx_seq=n_ctx))
        while sched.running or sched.waiting:
            step(sched.schedule())
    now[0] = 0.0
    seqs, i = [], 0
    while i < len(reqs) or sched.running or sched.waiting:
        while i < len(reqs) and reqs[i][0] <= now[0]:
            seqs.append(_seq(reqs[i][1], reqs[i][0], reqs[i][2], n_ctx))
            sched.add(seqs[-1])
            i += 1
        plan = sched.schedule()
        if plan.empty:
            assert i < len(reqs), "the scheduler stopped with work left"
            sched.take_ops()
            now[0] = reqs[i][0]
            continue
        step(plan)
    ttft = sorted(s.t_first - s.t_submit for s in seqs)
    return now[0], ttft[math.ceil(0.95 * len(ttft)) - 1]


def _workload(n, prompt, shared, outputs, arrival, rate, seed):
    rng = random.Random(seed)
    prefix = [1000 + k for k in range(shared)]
    t, reqs = 0.0, []
    for _ in range(n):
        out = outputs if isinstance(outputs, int) else rng.randint(*outputs)
        reqs.append((t, prefix + [rng.randrange(100, 30000) for _ in range(prompt - shared)], out))
        t += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
    return reqs, prefix


WORKLOADS = {
    # the study: 516-token prompts sharing 496, 128 tokens out, one every 50 ms
    "study N=48": (48, 516, 496, 128, "interval"),
    # 1,516-token prompts sharing 1,000, outputs 32-512, Poisson 20/s
    "long prompts N=64": (64, 1516, 1000, (32, 512), "poisson"),
    # the grid's unconstrained rows: shared 0 / 50 %, outputs 128 or 16-256, interval or Poisson
    "grid shared 0 %, out 128, interval": (48, 516, 0, 128, "interval"),
    "grid shared 0 %, out 16-256, Poisson": (48, 516, 0, (16, 256), "poisson"),
    "grid shared 50 %, out 128, Poisson": (48, 516, 258, 128, "poisson"),
    "grid shared 50 %, out 16-256, interval": (48, 516, 258, (16, 256), "interval"),
}


@pytest.mark.parametrize("name", WORKLOADS)
def test_replayed_h200_steps_land_near_the_best_fixed_cap(name):
    n, prompt, shared, outputs, arrival = WORKLOADS[name]
    reqs, prefix = _workload(n, prompt, shared, outputs, arrival, 20.0, seed=1)
    fixed = {cap: _replay(reqs, prefix, cap) for cap in (4, 8, 16, 32, 48)}
    best = min(fixed, key=lambda c: fixed[c][0])
    makespan, ttft_p95 = _replay(reqs, prefix, None)
    assert makespan <= 1.05 * fixed[best][0], (name, best, fixed, makespan)
    assert ttft_p95 <= 1.1 * fixed[best][1] + 0.02, (name, best, fixed, ttft_p95)


@pytest.mark.parametrize("seed", range(6))
def test_noisy_steps_do_not_pull_the_limit_down_on_the_study(seed):
    """The study's N=48 with noisy step times: TTFT p95 stays near the best fixed cap's (a
    noise-driven revert to the start held requests 0.15-0.37 s in the queue on the H200)."""
    n, prompt, shared, outputs, arrival = WORKLOADS["study N=48"]
    reqs, prefix = _workload(n, prompt, shared, outputs, arrival, 20.0, seed=1)
    fixed = {cap: _replay(reqs, prefix, cap, noise=0.15, seed=seed) for cap in (8, 16, 32)}
    best = min(fixed, key=lambda c: fixed[c][0])
    makespan, ttft_p95 = _replay(reqs, prefix, None, noise=0.15, seed=seed)
    assert makespan <= 1.05 * fixed[best][0], (best, fixed, makespan)
    assert ttft_p95 <= 1.1 * fixed[best][1] + 0.02, (best, fixed, ttft_p95)


def test_with_the_default_ceiling_the_limit_climbs_from_its_start_while_the_h200_steps_still_pay():
    """No cap given on a GPU: from START the limit climbs while requests wait and decode tok/s
    at the new batch holds (the H200's step table), step by step up to CEILING, not stopping
    where a fixed cap of 32 sits."""
    lim = ConcurrencyLimiter(CEILING["gpu"], initial=START["gpu"])
    seen = [lim.limit]
    for _ in range(40):
        feed(lim, 16, batch=lim.limit, step_s=_step_s(lim.limit, 0, 0), waiting=50)
        if lim.limit != seen[-1]:
            seen.append(lim.limit)
    assert seen[0] == START["gpu"] and seen[-1] == CEILING["gpu"] > 32
    assert len(seen) >= 3  # a step between: each was judged before the next


def test_a_finished_request_names_the_live_cap_at_its_admission(make_backend, tiny_model):
    """Each finish record carries the cap the request was admitted under and why the limiter
    had it there, so a benchmark's requests.csv shows the cap over a run."""
    b = make_backend(tiny_model, cap=3)
    handles = [b.enqueue(Request((5, 6, 7, 8), SamplingParams(temperature=0.0, max_tokens=4))) for _ in range(2)]
    records = [h.result(60) for h in handles]
    assert [r.cap_at_admit for r in records] == [3, 3]
    assert all(r.cap_reason == "start" for r in records)
