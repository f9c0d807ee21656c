"""How late the GUI event loop runs: a 10 ms timer that records how much later than asked it fired.

A responsive window keeps this lateness small while the backends are busy (their work runs on
worker threads and inside `llama_decode`, which releases the GIL). The status bar shows the p95;
`--responsiveness` in `app.gui` prints it for a demo run (48 requests unless `--demo N`).

Ticks are due on a fixed schedule (start + k × interval). Each time the timer fires, every tick
that fell due since the last one is a sample, late by `now - its due time`: a 500 ms stall of a
10 ms timer counts as 50 late ticks (500, 490, … ms), not one, so long stalls weigh what they
cost and the sample count matches the run's length (`missed` counts the ticks that came due
while the loop was blocked).

A busy machine makes every program late now and then; a class needs to hear of it only when the
window stays late. `lasting_lag` says so when each of the last few stretches of the schedule
(`LAG_CHUNK_S` each, `LAG_CHUNKS` of them) ran late by more than `LAG_ALERT_S` at its p95; one
stall shorter than that does not make it (the status bar's "machine busy" mark).
"""

from __future__ import annotations

import collections
import itertools
import time

import numpy as np
from PySide6.QtCore import QObject, Qt, QTimer

LAG_ALERT_S = 0.250  # a stretch whose lateness p95 is above this ran late
LAG_CHUNK_S = 5.0  # the stretches of the schedule judged one by one
LAG_CHUNKS = 3  # so many late stretches in a row: the lag lasts (15 s)


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

    def lasting_lag(self) -> bool:
        """Whether the window has run late for a while (`lasting_lag` over the samples)."""
        return lasting_lag(self.samples, self.interval_s)

    def lag_text(self) -> str:
        """The lateness in a sentence (the "machine busy" mark's tooltip)."""
        p95 = self.percentile(95)
        if p95 != p95:
            return "How late the window runs: nothing measured yet."
        return (f"The window runs late: its event loop's p95 lateness is {p95 * 1000:,.0f} ms over the last "
                f"{len(self.samples) * self.interval_s:.0f} s (a 10 ms timer). Another program is using the "
                "processor; the figures stay right, the screen catches up.")


def lasting_lag(samples, interval_s: float, threshold_s: float = LAG_ALERT_S, chunk_s: float = LAG_CHUNK_S,
                chunks: int = LAG_CHUNKS) -> bool:
    """Whether each of the last `chunks` stretches of `chunk_s` seconds of a schedule (a sample per
    `interval_s`) had a p95 lateness above `threshold_s`; False until there are that many."""
    per = max(1, round(chunk_s / interval_s))
    values = list(itertools.islice(reversed(samples), per * chunks))[::-1]  # the newest, in order
    if len(values) < per * chunks:
        return False
    return all(float(np.percentile(values[k * per:(k + 1) * per], 95)) > threshold_s for k in range(chunks))
