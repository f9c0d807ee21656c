"""Turn a stream of token pieces (bytes) into text deltas, holding back what is not final.

Two things are not final until later tokens arrive: a UTF-8 character split across tokens,
and text that might be the beginning of a stop string. `TextStream` holds both back and
releases them as soon as they are decided. Used on the backend's thread, one per sequence.
"""

from __future__ import annotations

import codecs


class TextStream:
    """Accumulates token pieces; `push()` returns the text that is safe to show now.

    After a stop string is found, `stopped` is True and the text up to (not including) the
    stop string has been released; nothing more is accepted.
    """

    __slots__ = ("_decoder", "_hold", "_pending", "_stops", "stopped", "text")

    def __init__(self, stop: tuple[str, ...] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded text not yet released (may start a stop string)
        self._stops = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything released so far
        self.stopped = False

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the newly released text (may be empty)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(piece)
        if self._stops:
            hit = _first_stop(self._pending, self._stops)
            if hit is not None:
                self.stopped = True
                return self._release(hit)
            # Keep the longest tail that could still grow into a stop string.
            keep = _partial_stop_len(self._pending, self._stops, self._hold)
            return self._release(len(self._pending) - keep)
        return self._release(len(self._pending))

    def flush(self) -> str:
        """End of stream: release whatever is held. A character whose last bytes never came
        (the reply was cut inside it) is dropped, not shown as U+FFFD."""
        if self.stopped:
            return ""
        self._decoder.reset()
        return self._release(len(self._pending))

    def _release(self, n: int) -> str:
        out, self._pending = self._pending[:n], self._pending[n:]
        self.text += out
        return out


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _partial_stop_len(text: str, stops: tuple[str, ...], hold: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    for n in range(min(hold, len(text)), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in stops):
            return n
    return 0
