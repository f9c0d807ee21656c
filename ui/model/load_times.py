"""How long a model's load has taken and, from the pace of the phase in progress, how long it
has left; durations in words. Qt-free (each call may be given the time), so it tests
without a screen; the loading screen (`ui.panels.first_start`) shows it. Any thread; one owner.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MIN_FRACTION_FOR_ESTIMATE = 0.1  # a phase's pace says little before a tenth of it is done


@dataclass
class LoadTimes:
    """When the load and the phase in progress started, and how far the phase is."""

    started: float = field(default_factory=time.monotonic)
    phase_started: float = 0.0
    fraction: float = 0.0

    def new_phase(self, now: float | None = None) -> None:
        self.phase_started = time.monotonic() if now is None else now
        self.fraction = 0.0

    def elapsed(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.started

    def left(self, now: float | None = None) -> float | None:
        """Seconds the phase in progress still needs at its pace so far; None until it is a tenth
        done (or when it is complete)."""
        now = time.monotonic() if now is None else now
        f = self.fraction
        if not MIN_FRACTION_FOR_ESTIMATE <= f < 1.0 or not self.phase_started:
            return None
        spent = now - self.phase_started
        return spent * (1.0 - f) / f


def fmt_duration(seconds: float) -> str:
    """3.2 -> '3 s', 75 -> '1 min 15 s'."""
    s = max(0, round(seconds))
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s"
