"""How late the GUI event loop runs: a 10 ms timer that records how much later than asked it fired.

A responsive window keeps this lateness small while the backends are busy (their work runs on
worker threads and inside `llama_decode`, which releases the GIL). The status bar shows the p95;
`--responsiveness` in `app.gui` prints it for a demo run (48 requests unless `--demo N`).

Ticks are due on a fixed schedule (start + k × interval). Each time the timer fires, every tick
that fell due since the last one is a sample, late by `now - its due time`: a 500 ms stall of a
10 ms timer counts as 50 late ticks (500, 490, … ms), not one, so long stalls weigh what they
cost and the sample count matches the run's length (`missed` counts the ticks that came due
while the loop was blocked).
"""

from __future__ import annotations

import collections
import time

import numpy as np
from PySide6.QtCore import QObject, Qt, QTimer


class LoopProbe(QObject):
    def __init__(self, interval_ms: int = 10, window: int = 3000, parent: QObject | None = None):
        super().__init__(parent)
        self.interval_s = interval_ms / 1000.0
        self.samples: collections.deque[float] = collections.deque(maxlen=window)
        self.missed = 0  # ticks that fell due while an earlier one was still waiting to run
        self._t0: float | None = None
        self._done = 0  # ticks of the schedule accounted for
        self._timer = QTimer(self)
        self._timer.setTimerType(Qt.TimerType.PreciseTimer)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self._on_timeout)

    def start(self) -> None:
        self._restart_schedule()
        self._timer.start()

    def _restart_schedule(self) -> None:
        self._t0 = time.perf_counter()
        self._done = 0

    def stop(self) -> None:
        self._timer.stop()

    def reset(self, keep_all: bool = False) -> None:
        """Forget the samples; with `keep_all`, keep every later sample (a benchmark's whole run)."""
        self.samples = collections.deque(maxlen=None if keep_all else self.samples.maxlen)
        self.missed = 0
        self._restart_schedule()

    def _on_timeout(self) -> None:
        now = time.perf_counter()
        if self._t0 is None:
            return
        due = int((now - self._t0) / self.interval_s)  # ticks of the schedule that are due by now
        for k in range(self._done + 1, due + 1):
            self.samples.append(max(0.0, now - (self._t0 + k * self.interval_s)))
        if due > self._done + 1:
            self.missed += due - self._done - 1
        self._done = max(self._done, due)

    def percentile(self, q: float) -> float:
        """Lateness percentile in seconds (NaN before any sample)."""
        return float(np.percentile(self.samples, q)) if self.samples else float("nan")
