"""Bounded waiting for tests: every wait has a deadline and says what it waited for."""

from __future__ import annotations

import time

WAIT = 120  # seconds: the bound on any single wait for a request


def wait_until(cond, timeout: float = WAIT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(0.01)
