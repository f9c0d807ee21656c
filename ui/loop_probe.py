"""How late the GUI event loop runs: a 10 ms timer that records how much later than asked it fired.

A responsive window keeps this lateness small while the backends are busy (their work runs on
worker threads and inside `llama_decode`, which releases the GIL). The status bar shows the p95;
`bench responsiveness` in `app.gui` prints it for a 48-request run.
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
        self._last = None
        self._timer = QTimer(self)
        self._timer.setTimerType(Qt.PreciseTimer)
        self._timer.setInterval(interval_ms)
        self._timer.timeout.connect(self._on_timeout)

    def start(self) -> None:
        self._last = time.perf_counter()
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    def reset(self, keep_all: bool = False) -> None:
        """Forget the samples; with `keep_all`, keep every later sample (a benchmark's whole run)."""
        self.samples = collections.deque(maxlen=None if keep_all else self.samples.maxlen)
        self._last = time.perf_counter()

    def _on_timeout(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.samples.append(max(0.0, now - self._last - self.interval_s))
        self._last = now

    def percentile(self, q: float) -> float:
        """Lateness percentile in seconds (NaN before any sample)."""
        return float(np.percentile(self.samples, q)) if self.samples else float("nan")
