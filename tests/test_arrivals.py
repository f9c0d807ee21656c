"""The arrival clock that live runs and the app's benchmark runs are timed by: pause, step, resume.

The clock reads a `ManualClock` that moves only when a test moves it, so no test sleeps: a
submitter blocked in `wait_for` is known to be waiting once it has read the clock in its loop."""

from __future__ import annotations

import threading
import time

import pytest

from engine.sim.arrivals import ArrivalClock


class ManualClock:
    """Monotonic seconds that move only by `advance`; counts its reads, so a test can wait
    until another thread has read it."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t
        self.reads = 0
        self._cond = threading.Condition()

    def __call__(self) -> float:
        with self._cond:
            self.reads += 1
            self._cond.notify_all()
            return self.t

    def advance(self, seconds: float) -> None:
        with self._cond:
            self.t += seconds

    def wait_reads(self, n: int, timeout: float = 10.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.reads >= n, timeout), f"{self.reads} reads, {n} awaited"


def blocked_submitter(clock: ArrivalClock, manual: ManualClock, arrival_s: float) -> tuple[threading.Thread, list]:
    """A thread blocked in `clock.wait_for(arrival_s)` on a paused clock: returned once it has
    read the deadline and then the time left (it holds the clock's lock until it waits)."""
    got: list[bool] = []
    reads = manual.reads
    t = threading.Thread(target=lambda: got.append(clock.wait_for(arrival_s, timeout=10)))
    t.start()
    manual.wait_reads(reads + 2)
    return t, got


def test_a_paused_clock_stands_still():
    manual = ManualClock()
    clock = ArrivalClock(manual)
    clock.start()
    manual.advance(0.02)
    clock.pause()
    at = clock.now()
    manual.advance(0.05)
    assert at == pytest.approx(0.02)
    assert clock.now() == at
    assert not clock.take(at + 0.01)


def test_resume_shifts_the_arrivals_still_to_come():
    manual = ManualClock()
    clock = ArrivalClock(manual)
    clock.start()
    clock.pause()
    manual.advance(0.1)  # longer than the arrival below is due after start
    clock.resume()
    assert not clock.take(0.05)  # still 0.05 s away on the clock, not released by the pause
    manual.advance(0.05)
    assert clock.wait_for(0.05, timeout=5)


def test_step_lets_exactly_one_arrival_through():
    clock = ArrivalClock(ManualClock())
    clock.start()
    clock.pause()
    clock.step()
    assert clock.take(3.0)
    assert clock.now() == 3.0  # the clock moved to the stepped arrival
    assert not clock.take(3.0)
    assert clock.taken == 1


def test_step_wakes_a_blocked_submitter():
    manual = ManualClock()
    clock = ArrivalClock(manual)
    clock.start()
    clock.pause()
    t, got = blocked_submitter(clock, manual, 10.0)
    assert not got  # paused: still waiting
    clock.step()
    t.join(10)
    assert got == [True]


def test_close_releases_a_blocked_submitter_with_false():
    manual = ManualClock()
    clock = ArrivalClock(manual)
    clock.start()
    clock.pause()
    t, got = blocked_submitter(clock, manual, 1.0)
    clock.close()
    t.join(10)
    assert got == [False]
    assert not clock.take(0.0)


def test_the_clock_records_each_pause_with_the_last_still_open():
    manual = ManualClock()
    clock = ArrivalClock(manual)
    clock.start()
    clock.pause()
    manual.advance(1.0)
    clock.resume()
    manual.advance(2.0)
    clock.step()  # pauses again
    assert clock.pauses() == [(100.0, 101.0), (103.0, None)]


def test_the_clock_reads_the_monotonic_clock_by_default():
    clock = ArrivalClock()
    clock.start()
    before = time.monotonic()
    clock.pause()
    after = time.monotonic()
    ((start, end),) = clock.pauses()
    assert before <= start <= after
    assert end is None
