"""Adaptive concurrency: how many sequences a backend runs at once, learned from its steps.

Pure (no llama.cpp, no threads, no clock): the scheduler (engine/sched/scheduler.py) feeds it each
decoded step (`observe`) and, when a window of steps is complete, the KV room it has
(`decide`); the limiter answers with the cap the next admissions use, and says why it last
moved (`reason`), which the backend's snapshot, `/v1/backends` and the app's cards show.

What says "more concurrency helps": a decode step costs about α + β·b for a batch of b, so
decode tok/s = b / step(b) rises with b while α dominates and flattens once β·b does. The
limiter climbs that gradient the way TCP's congestion windows do (Netflix concurrency-limits'
Gradient2 and Vegas; here a batch's "RTT" is its step time, and the question is whether tok/s
rose when the window did):

  - **Grow under backlog** (Gradient2's "app limited" rule): only when requests have waited
    at the limit for `patience` steps in a row. With no backlog the load, not the limit, sets
    the batch, and nothing would be learned about larger batches.
  - **Step up at once, judge it after** (TCP slow start, with a check): below `slow_start`
    (16) a step up doubles the limit, above it adds half. Once a window's mean decode batch
    fills at least three quarters of the step (a half-filled step sits in the step table's
    bumps, where a batch of 12 may be slower per token than 8 and says nothing about 16),
    decode tok/s there is compared with the rate at the old limit; if it fell by more than
    `tolerance` in `confirm` such windows in a row, the limit goes back to the value before
    that step up (never lower) and holds there for `reprobe_windows` windows. One slow window
    is not enough: a limit knocked back to its start by one noisy window left every later
    request waiting in the queue. Coarse steps pass over the bumps of a real step table (a
    kernel shape changes at some batch sizes), where +1 hill-climbing stops. A flat rate is
    kept, not reverted: a larger limit still admits sooner, and tok/s drifts down as contexts
    grow, which a stricter test would read as a loss.
  - **KV room bounds growth** (vLLM's token budget, in cells): a step up needs free cells
    (idle cached prefixes count as free: they are evicted first) for twice the added
    sequences' average private footprint; a preemption (the decode rows did not fit) cuts the
    limit to what was left running (TCP's multiplicative decrease on loss).
  - **Decay when the load is light** (RFC 7661's idle window): after `idle_windows` windows
    with at most L/2 running, the limit falls to max(start, 2 × the most that ran), so sampler
    chains kept for an old burst are given back.

A user's explicit cap is the ceiling: the limiter starts there and moves only below it; with
no cap (`cap=auto`) it starts at `initial` and may grow to the device's ceiling.
`adaptive=False` pins the limit at the ceiling (the benchmarks' fixed-cap rows, calibration).
tests/test_limiter.py replays a measured step table against the best fixed cap;
docs/design/sched.md says how close it lands.

Thread contract: none; the scheduler's owner calls it from one thread. `limit`, `reason` and
`moves` are plain attributes other threads may read (a torn read sees an older value).
"""

from __future__ import annotations

from dataclasses import dataclass

# An adaptive cap's ceiling and start per device kind, when no cap is given (`gpu`, `cap=auto`):
# the one place they are set (engine/backends/local.py gives each of a spec's contexts its own;
# the simulator's adaptive backends use them too). The ceiling is a measurement's to decide, not
# one workload's: `scripts/gpu/steps.sh defaults_http` compares the default with one and two
# contexts at fixed caps 16 / 32 / 64 on the study, long prompts, 4 / 16 / 32 tenants and chats.
# A GPU starts at 32: its decode tok/s still rises up to b = 32, and a lower start left the
# limiter climbing through queues it need not have had. It climbs to 64 under backlog, where one
# context ran many tenants fastest and the simulated H200 meets every fixed cap. On a CPU decode
# flattens sooner and each sequence's tokens come slower with every one added.
CEILING = {"gpu": 64, "cpu": 16}
START = {"gpu": 32, "cpu": 4}


@dataclass(slots=True)
class _Window:
    steps: int = 0
    bound: int = 0  # steps where requests waited with the running set at the limit
    peak: int = 0  # most sequences running at once
    waiting: int = 0  # queue length at the last step
    streak: int = 0  # steps in a row, up to the last, where requests waited at the limit
    tokens: int = 0  # decode tokens of the window's decode-only steps
    seconds: float = 0.0  # their step time
    batch_sum: int = 0  # their batch sizes, summed (mean batch = batch_sum / decode_steps)
    decode_steps: int = 0


@dataclass(slots=True)
class _Probe:
    base: int  # the limit the step up started from
    rate: float  # decode tok/s measured at `base`
    target: int  # the limit tried
    drops: int = 0  # filled windows in a row where decode tok/s fell below `rate` by more than the tolerance


class ConcurrencyLimiter:
    """The live concurrency cap of one backend. See the module doc for the rules."""

    def __init__(self, ceiling: int, *, initial: int | None = None, floor: int = 1, adaptive: bool = True,
                 window: int = 16, tolerance: float = 0.10, reprobe_windows: int = 32, idle_windows: int = 8,
                 slow_start: int = 16, patience: int = 2, confirm: int = 2):
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling}")
        self.ceiling = ceiling
        self.floor = max(1, min(floor, ceiling))
        self.initial = self._clamp(initial if initial is not None else ceiling)
        self.adaptive = adaptive
        self.window = window
        self.tolerance = tolerance  # a step up stays unless decode tok/s fell by more
        self.reprobe_windows = reprobe_windows
        self.idle_windows = idle_windows
        self.slow_start = slow_start  # below it a step up doubles the limit, above it adds half
        self.patience = patience  # steps in a row with requests waiting at the limit before a step up
        self.confirm = max(1, confirm)  # filled windows in a row that must show a drop before a revert
        self.limit = self.initial if adaptive else ceiling
        self.reason = "start" if adaptive else "fixed"
        self.moves = 0
        self.rates: dict[int, float] = {}  # mean decode batch → decode tok/s (smoothed)
        self._win = _Window()
        self._probe: _Probe | None = None
        self._plateau = 0  # a step up from here did not pay: hold at most this
        self._plateau_left = 0  # windows before the plateau is tried again
        self._light = 0  # windows in a row with at most half the limit running
        self._light_peak = 0

    # ---- inputs ----

    def observe(self, n_decode: int, n_prefill: int, seconds: float, running: int, waiting: int) -> bool:
        """One decoded step. True when the limiter wants `decide` called with the KV room: a
        window is complete, or requests wait at the limit and a step up may be tried now."""
        w = self._win
        w.steps += 1
        bound = waiting > 0 and running >= self.limit
        if bound:
            w.bound += 1
            w.streak += 1
        else:
            w.streak = 0
        w.peak = max(w.peak, running)
        w.waiting = waiting
        if n_decode and not n_prefill and seconds > 0:
            w.tokens += n_decode
            w.seconds += seconds
            w.batch_sum += n_decode
            w.decode_steps += 1
        if self._window_done():
            return True
        return w.streak >= self.patience and self._may_grow()

    def _window_done(self) -> bool:
        """The window has its steps; it needs a few decode-only ones to say anything about the
        decode rate (or has waited four windows' worth for them)."""
        w = self._win
        return w.steps >= self.window and (w.decode_steps >= 4 or w.steps >= 4 * self.window)

    def decide(self, kv_free: int, cells_per_seq: int) -> bool:
        """Maybe move the limit. `kv_free`: cells free or held only by idle cached prefixes;
        `cells_per_seq`: the average running sequence's private cells (plus the admission
        headroom). True if the limit moved."""
        w = self._win
        if self._window_done():
            self._win = _Window(streak=w.streak)
            if self._judge(w):
                return True
        if not (w.streak >= self.patience and self._may_grow()):
            return False
        # Requests wait at the limit: step up now (the next window judges whether it paid).
        room = max(0, kv_free) // max(1, 2 * cells_per_seq)
        step = self.limit if self.limit < self.slow_start else self.limit // 2
        target = min(self.ceiling, self.limit + max(1, step), self.limit + room)
        if target <= self.limit:
            self.reason = f"{w.waiting} waiting, but KV room for no more sequences"
            return False
        base = self._rate_near(self.limit)
        self._probe = _Probe(self.limit, base, target)
        got = f"decode {base:.0f} tok/s at {self.limit}" if base else "no decode rate yet"
        return self._move(target, f"{w.waiting} waiting at {self.limit} ({got}): trying {target}")

    def _may_grow(self) -> bool:
        return (self.adaptive and self._probe is None and self.limit < self.ceiling
                and not (self._plateau and self.limit >= self._plateau))

    def _judge(self, w: _Window) -> bool:
        """A complete window: record its decode rate, judge a step up, or decay."""
        rate = batch = 0.0
        if w.decode_steps:
            rate = w.tokens / w.seconds
            batch = w.batch_sum / w.decode_steps
            key = max(1, round(batch))
            old = self.rates.get(key)
            self.rates[key] = rate if old is None else 0.5 * old + 0.5 * rate
        if not self.adaptive:
            return False
        if self._plateau_left:
            self._plateau_left -= 1
            if not self._plateau_left:
                self._plateau = 0
        probe = self._probe
        if probe is not None and rate and batch >= probe.base + 0.75 * (probe.target - probe.base):
            # the step up filled: did it pay? A drop must persist over `confirm` windows.
            if probe.rate and rate < probe.rate * (1 - self.tolerance):
                probe.drops += 1
                if probe.drops < self.confirm:
                    self.reason = (f"decode {rate:.0f} tok/s at batch {batch:.0f}, below {probe.rate:.0f} at "
                                   f"{probe.base}: checking again")
                    return False
                self._probe = None
                self._plateau, self._plateau_left = probe.base, self.reprobe_windows
                return self._move(max(probe.base, self.initial), f"decode fell to {rate:.0f} tok/s at batch "
                                                                 f"{batch:.0f} from {probe.rate:.0f} at {probe.base}")
            self._probe = None
            self.reason = f"decode {rate:.0f} tok/s at batch {batch:.0f}, up from {probe.rate:.0f} at {probe.base}"
            return False
        if w.bound * 2 >= w.steps:  # requests waited at the limit
            self._light = 0
            return False
        return self._maybe_decay(w)

    def _rate_near(self, b: int) -> float:
        """The measured decode rate at the batch size nearest `b` from below (within 25 %)."""
        near = [k for k in self.rates if 0.75 * b <= k <= b]
        return self.rates[max(near)] if near else 0.0

    def kv_full(self, running: int) -> bool:
        """A sequence was preempted for KV room: run no more than the `running` that are left."""
        if not self.adaptive:
            return False
        self._probe = None
        new = max(self.floor, running)
        self._plateau, self._plateau_left = new, self.reprobe_windows
        if new >= self.limit:
            return False
        return self._move(new, f"KV full: a sequence was preempted with {running + 1} running")

    def set_ceiling(self, ceiling: int, adaptive: bool | None = None, start: int | None = None,
                    reason: str | None = None) -> None:
        """A user's cap: the new ceiling; the limit starts again at `start` (default: the
        ceiling) with nothing learned. `reason` says why, where no user set it (calibration
        restoring the cap it found)."""
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling}")
        self.ceiling = ceiling
        self.floor = min(self.floor, ceiling)
        if adaptive is not None:
            self.adaptive = adaptive
        self.initial = self._clamp(start if start is not None and self.adaptive else ceiling)
        self.rates.clear()
        self._win = _Window()
        self._probe, self._plateau, self._plateau_left, self._light = None, 0, 0, 0
        self._move(self.initial, reason or ("set by the user" if self.adaptive else "fixed"))

    # ---- helpers ----

    def _maybe_decay(self, w: _Window) -> bool:
        if w.peak * 2 > self.limit:
            self._light = 0
            return False
        self._light += 1
        self._light_peak = w.peak if self._light == 1 else max(self._light_peak, w.peak)
        if self._light < self.idle_windows:
            return False
        self._light = 0
        self._probe = None  # the load fell before the step up filled: nothing to judge
        new = max(self.initial, 2 * self._light_peak, self.floor)
        if new >= self.limit:
            return False
        return self._move(new, f"the load ran at most {self._light_peak} at once")

    def _move(self, limit: int, reason: str) -> bool:
        limit = self._clamp(limit)
        self.reason = reason
        if limit == self.limit:
            return False
        self.limit = limit
        self.moves += 1
        return True

    def _clamp(self, n: int) -> int:
        return max(self.floor, min(self.ceiling, n))
