"""The clock a workload's arrivals are timed by, which a person can pause and step, and a stream
of arrivals that keeps coming at a rate a person can change (`ArrivalStream`, a lesson's).

`ArrivalClock` reads seconds since `start()`, except that it stands still while paused, so a
pause shifts every arrival still to come by its length instead of releasing them in a burst on
resume. `step()` (while paused) grants the next arrival at once: the clock moves to that
arrival's time and stays paused. Whoever submits the arrivals asks the clock:

- `take(arrival_s)`: may this arrival go now? (non-blocking; the GUI's timer-driven
  `ui.live_run.WorkloadRun`);
- `wait_for(arrival_s)`: block until it may (the benchmark runner's submitting thread,
  `engine.experiment.EngineRunner`); False once the clock is closed.

Requests already submitted are not the clock's business: the engine keeps serving them.

`pauses()` lists the pauses so far as monotonic (start, end) pairs, the open one with end None
(a pause by `step()` counts from the step that began it). A run's makespan leaves out the part
of them when none of its requests was in flight (`engine.sim.benchmark.idle_paused_s`): a person
stopping to explain is not the engine's time, but requests that ran meanwhile are.

Thread contract: every method may be called from any thread (one condition variable guards the
state; `pause`, `resume`, `step` and `close` wake a blocked `wait_for`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

EPSILON_S = 0.001  # an arrival within 1 ms of its time is due (timers fire a little early)


class ArrivalClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # monotonic seconds (tests pass one they move by hand)
        self._cond = threading.Condition()
        self._t0: float | None = None  # monotonic() when the clock read 0, shifted by each pause
        self._paused = False
        self._frozen = 0.0  # the reading while paused
        self._steps = 0  # arrivals granted by step() and not yet taken
        self._closed = False
        self._pauses: list[tuple[float, float | None]] = []  # monotonic (start, end); end None: open
        self.taken = 0  # arrivals let through so far

    # ---- control (any thread) ----

    def start(self) -> None:
        """Arrivals start now (a clock paused before it started stays paused, at 0)."""
        with self._cond:
            self._t0 = self._clock() - (self._frozen if self._paused else 0.0)
            self._cond.notify_all()

    def pause(self) -> bool:
        with self._cond:
            if self._paused or self._closed:
                return False
            self._hold()
            self._cond.notify_all()
            return True

    def resume(self) -> bool:
        with self._cond:
            if not self._paused:
                return False
            self._paused = False
            self._steps = 0
            self._pauses[-1] = (self._pauses[-1][0], self._clock())
            if self._t0 is not None:
                self._t0 = self._clock() - self._frozen
            self._cond.notify_all()
            return True

    def step(self) -> None:
        """Let the next arrival through now, and stay paused (pausing first)."""
        with self._cond:
            if not self._paused:
                self._hold()
            self._steps += 1
            self._cond.notify_all()

    def close(self) -> None:
        """No more arrivals: a blocked `wait_for` returns False, and so does every later one."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- reading (any thread) ----

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def started(self) -> bool:
        return self._t0 is not None

    def pauses(self) -> list[tuple[float, float | None]]:
        """Every pause so far, oldest first: monotonic (start, end), end None while it lasts (a
        clock closed while paused keeps its last pause open)."""
        with self._cond:
            return list(self._pauses)

    def now(self) -> float:
        """Seconds on the arrival clock (0 until started; still while paused)."""
        with self._cond:
            return self._now()

    def take(self, arrival_s: float) -> bool:
        """Whether the arrival due at `arrival_s` may be submitted now (a step granted is used up)."""
        with self._cond:
            return self._take(arrival_s)

    def wait_for(self, arrival_s: float, timeout: float | None = None) -> bool:
        """Block until the arrival at `arrival_s` may be submitted; False if the clock was closed
        (or `timeout` passed) first."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while not self._take(arrival_s):
                if self._closed:
                    return False
                waits = [] if self._paused or self._t0 is None else [arrival_s - self._now()]
                if deadline is not None:
                    waits.append(deadline - self._clock())
                    if waits[-1] <= 0:
                        return False
                self._cond.wait(max(0.0, min(waits)) if waits else None)
            return True

    def _hold(self) -> None:
        self._frozen = self._now()
        self._paused = True
        self._pauses.append((self._clock(), None))

    def _now(self) -> float:
        if self._paused or self._t0 is None:
            return self._frozen
        return self._clock() - self._t0

    def _take(self, arrival_s: float) -> bool:
        if self._closed or self._t0 is None:
            return False
        if self._paused:
            if not self._steps:
                return False
            self._steps -= 1
            self._frozen = max(self._frozen, arrival_s)
        elif self._now() < arrival_s - EPSILON_S:
            return False
        self.taken += 1
        return True


MIN_RATE = 0.1  # arrivals per second a stream may be turned down to (one every 10 s)
MAX_RATE = 20.0  # and up to


class ArrivalStream:
    """Arrivals that keep coming until closed, evenly spaced at a rate that can change at any time.

    Arrival 0 is due when the clock starts; each next one `1 / rate` after the one before it was
    let through, on the clock: a pause (the clock stands still) shifts them all, `clock.step()`
    lets the next one through at once, and a late taker gets no burst of overdue arrivals. A
    rate change applies to the arrival still to come: due `1 / rate` after the last one, at once
    if that time has passed. Arrivals are numbered from 0; what each one carries is the caller's
    business (`engine.lesson.LessonMix`).

    Thread contract: every method may be called from any thread (one lock; the clock has its own).
    """

    def __init__(self, rate: float, clock: ArrivalClock | None = None) -> None:
        self.clock = clock if clock is not None else ArrivalClock()
        self._lock = threading.Lock()
        self._rate = _clamp_rate(rate)
        self._last: float | None = None  # clock time of the last arrival let through
        self.count = 0  # arrivals let through so far

    @property
    def rate(self) -> float:
        """Arrivals per second."""
        return self._rate

    def set_rate(self, rate: float) -> float:
        """Change the rate (clamped to MIN_RATE..MAX_RATE) from the next arrival on; the rate set."""
        with self._lock:
            self._rate = _clamp_rate(rate)
            return self._rate

    @property
    def next_s(self) -> float:
        """When the next arrival is due, in seconds on the clock."""
        with self._lock:
            return self._next_s()

    def take(self) -> int | None:
        """The number of the next arrival if it may go now (a step granted is used up), else None."""
        with self._lock:
            due = self._next_s()
            if not self.clock.take(due):
                return None
            self._last = max(due, self.clock.now())  # a step moves the clock to the arrival
            self.count += 1
            return self.count - 1

    def due(self) -> list[int]:
        """Every arrival that may go now, oldest first (none while paused, unless stepped)."""
        out = []
        while (n := self.take()) is not None:
            out.append(n)
        return out

    def seconds_to_next(self) -> float | None:
        """How long until the next arrival is due; None while the clock is paused, closed or not started."""
        clock = self.clock
        if clock.paused or clock.closed or not clock.started:
            return None
        return max(0.0, self.next_s - clock.now())

    def _next_s(self) -> float:
        return 0.0 if self._last is None else self._last + 1.0 / self._rate


def _clamp_rate(rate: float) -> float:
    if not rate > 0:  # NaN included
        raise ValueError(f"an arrival rate must be a positive number of requests per second, got {rate!r}")
    return min(MAX_RATE, max(MIN_RATE, float(rate)))
