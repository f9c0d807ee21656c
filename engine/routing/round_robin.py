"""`round-robin`: cycle through the eligible backends, ignoring load (a baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.errors import BackendUnavailable

from .seed_score import SeedScored
from .types import BackendScore, RouteQuery

HELP = "Takes turns, ignoring load (a baseline)."


class RoundRobin(SeedScored):
    """Cycle through the backends in order, skipping ineligible ones."""

    name = "round-robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, query: RouteQuery, scores: Sequence[BackendScore]) -> tuple[str, str]:
        names = [s.name for s in scores]
        start = names.index(self._last) + 1 if self._last in names else 0
        for k in range(len(scores)):
            s = scores[(start + k) % len(scores)]
            if s.eligible:
                self._last = s.name
                return s.name, f"round-robin: {s.name}'s turn"
        raise BackendUnavailable("no healthy backend")
