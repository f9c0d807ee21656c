"""The arrival clock that live runs and the app's benchmark runs are timed by: pause, step, resume."""

from __future__ import annotations

import threading
import time

from engine.sim.arrivals import ArrivalClock


def test_a_paused_clock_stands_still():
    clock = ArrivalClock()
    clock.start()
    time.sleep(0.02)
    clock.pause()
    at = clock.now()
    time.sleep(0.05)
    assert clock.now() == at
    assert not clock.take(at + 0.01)


def test_resume_shifts_the_arrivals_still_to_come():
    clock = ArrivalClock()
    clock.start()
    clock.pause()
    time.sleep(0.1)  # longer than the arrival below is due after start
    clock.resume()
    assert not clock.take(0.05)  # still 0.05 s away on the clock, not released by the pause
    assert clock.wait_for(0.05, timeout=5)


def test_step_lets_exactly_one_arrival_through():
    clock = ArrivalClock()
    clock.start()
    clock.pause()
    clock.step()
    assert clock.take(3.0)
    assert clock.now() == 3.0  # the clock moved to the stepped arrival
    assert not clock.take(3.0)
    assert clock.taken == 1


def test_step_wakes_a_blocked_submitter():
    clock = ArrivalClock()
    clock.start()
    clock.pause()
    got = []
    t = threading.Thread(target=lambda: got.append(clock.wait_for(10.0, timeout=10)))
    t.start()
    time.sleep(0.05)
    assert not got  # paused: still waiting
    clock.step()
    t.join(10)
    assert got == [True]


def test_close_releases_a_blocked_submitter_with_false():
    clock = ArrivalClock()
    clock.start()
    clock.pause()
    got = []
    t = threading.Thread(target=lambda: got.append(clock.wait_for(1.0, timeout=10)))
    t.start()
    time.sleep(0.05)
    clock.close()
    t.join(10)
    assert got == [False]
    assert not clock.take(0.0)


def test_the_clock_records_each_pause_with_the_last_still_open():
    clock = ArrivalClock()
    clock.start()
    before = time.monotonic()
    clock.pause()
    clock.resume()
    clock.step()  # pauses again
    (a0, a1), (b0, b1) = clock.pauses()
    assert before <= a0 <= a1 <= b0
    assert b1 is None
