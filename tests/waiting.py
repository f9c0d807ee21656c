"""Bounded waiting for tests: every wait has a deadline and says what it waited for.

Two tools, for two kinds of state:
- `wait_until` polls for a state that HOLDS once reached (idle, finished, a count that only
  grows). Its `unless=` names what makes the state impossible (the request ended, say), so a
  wait that can no longer succeed fails at once instead of spinning to its deadline.
- `held_when` is for a state that may PASS between two polls (mid-prefill, "decoding and still
  listed"): it pauses a backend's worker at the first step boundary where the state holds and
  keeps it there while the test acts, so the state cannot move on under the test.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

WAIT = 120  # seconds: the bound on any single wait for a request


def wait_until(cond, timeout: float = WAIT, what: str = "condition", unless=None) -> None:
    """Poll `cond()` until true; fail after `timeout`, or at once when `unless()` is true (the
    awaited state can no longer come)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if unless is not None and unless():
            if cond():  # reached in the meantime
                return
            raise AssertionError(f"{what} can no longer come")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(0.01)


@contextmanager
def held_when(backend, cond, what: str = "condition", unless=None, timeout: float = WAIT):
    """Pause `backend`'s worker thread at the first step boundary where `cond(snapshot)` holds,
    for the body of the `with` (it yields that snapshot). The check runs on the worker between
    steps (a `Backend.call` that posts itself again until the state comes), so no step runs
    between the check and the body. It fails at once when `unless(snapshot)` holds or the
    backend has nothing left to run (the state can no longer come), and after `timeout`.

    What the body posts (a cancel, say) is taken at the step boundary after the next step."""
    held, release = threading.Event(), threading.Event()
    seen: list = []  # (snapshot, why it failed or None)
    deadline = time.monotonic() + timeout

    def probe(b):
        try:
            look(b)
        except BaseException as e:  # a failing check must end the wait, not the worker
            seen.append((None, f"could not be checked: {e!r}"))
            held.set()

    def look(b):
        snap = b.snapshot()
        if cond(snap):
            seen.append((snap, None))
            held.set()
            release.wait(timeout)
            return
        if unless is not None and unless(snap):
            why = "can no longer come"
        elif not snap.items:
            why = "can no longer come: the backend has nothing left to run"
        elif time.monotonic() > deadline:
            why = f"not reached within {timeout} s"
        else:
            try:
                b.call(probe)  # look again at the next step boundary
                return
            except Exception as e:  # the backend stopped
                why = f"can no longer come: {e}"
        seen.append((snap, why))
        held.set()

    backend.call(probe)
    try:
        if not held.wait(timeout + 10):
            raise TimeoutError(f"{what}: the backend's worker never ran the check within {timeout} s")
        snap, why = seen[0]
        if why is not None:
            raise AssertionError(f"{what} {why}")
        yield snap
    finally:
        release.set()


def paused(backend, timeout: float = WAIT):
    """Hold `backend`'s worker at its next step boundary for the body of a `with`: what the
    body enqueues is taken together, in one step (a batch whose shape does not hang on timing)."""
    return held_when(backend, lambda _: True, "paused", timeout=timeout)
