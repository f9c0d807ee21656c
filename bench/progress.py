"""A progress bar for long headless commands: tqdm when it is installed, else one stderr line.

The GPU machine has no tqdm; there the fallback rewrites one line (`\\r`) on a terminal, and
prints a plain line at most every 10 % when stderr is a file or pipe. Owned by one thread.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, desc: str = "", *, enabled: bool = True, stream=None):
        self.total = max(int(total), 0)
        self.n = 0
        self.desc = desc
        self.stream = stream or sys.stderr
        self._bar = None
        self._last_print = 0.0
        self._last_decile = -1
        self._enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=self.total, desc=desc, file=self.stream, leave=True,
                                 dynamic_ncols=True)

    def update(self, k: int = 1, status: str | None = None) -> None:
        self.n = min(self.n + k, self.total)
        if status is not None:
            self.desc = status
        if not self._enabled:
            return
        if self._bar is not None:
            if status is not None:
                self._bar.set_description_str(status, refresh=False)
            self._bar.update(k)
            return
        self._fallback()

    def add_total(self, k: int) -> None:
        """More work turned up (e.g. the next engine of a sweep)."""
        self.total += k
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def set(self, n: int, status: str | None = None) -> None:
        self.update(n - self.n, status)

    def close(self) -> None:
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.close()
        elif self._tty():
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _tty(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def _fallback(self) -> None:
        line = f"{self.desc} {self.n}/{self.total} ({100 * self.n // max(self.total, 1)}%)"
        if self._tty():
            now = time.monotonic()
            if now - self._last_print >= 0.2 or self.n == self.total:
                self._last_print = now
                self.stream.write("\r" + line[:160].ljust(60))
                self.stream.flush()
            return
        decile = 10 * self.n // max(self.total, 1)
        if decile != self._last_decile:
            self._last_decile = decile
            self.stream.write(line + "\n")
            self.stream.flush()


def loading_bar(label: str):
    """A model-loading bar fed with llama.cpp's progress fraction (0..1)."""
    bar = Progress(100, label)

    def update(fraction: float) -> bool:
        bar.set(int(fraction * 100))
        if fraction >= 1.0:
            bar.close()
        return True

    return update
