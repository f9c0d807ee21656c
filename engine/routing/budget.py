"""Decode budgets: how the study's score counts the unused `max_tokens` of work on a backend.

- `raw`: the study's rule, every item counts its unused `max_tokens` budget.
- `ratio`: SGLang's `new_token_ratio` heuristic. Running items' remaining budget is scaled
  by `NewTokenRatio.value`; queued items and the new request count their full budget, as
  SGLang reserves the full (clipped) budget for a request it is about to admit. The ratio
  starts at 0.7 and decays by a fixed step after each routed request toward a 0.1 floor;
  the engine calls `Router.reset_ratio()` when a backend has to retract/preempt work.

It applies to `seed-score` and `least-work`; the finish-time policies ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.errors import InvalidRequest

BUDGET_MODES = ("raw", "ratio")


@dataclass(frozen=True, slots=True)
class DecodeBudget:
    """How remaining decode budgets are counted: `raw`, or running items scaled by `ratio`."""

    mode: str = "raw"
    ratio: float = 1.0

    def running(self, decode_left: int) -> float:
        """The decode tokens a running item counts for."""
        return decode_left * self.ratio if self.mode == "ratio" else decode_left


RAW = DecodeBudget()


class NewTokenRatio:
    """SGLang's `new_token_ratio`: the share of running requests' budget expected to be used.

    A heuristic, not a prediction: it starts at `initial` (0.7), `step()` lowers it by `decay`
    toward `floor` (0.1), and `reset()` returns it to `initial` (SGLang does so when it had to
    retract requests, i.e. when the estimate proved too optimistic). The default decay
    reaches the floor after 60 steps. Not thread-safe on its own; `Router` holds it under its
    lock.
    """

    def __init__(self, initial: float = 0.7, floor: float = 0.1, decay: float = 0.01) -> None:
        if not 0 < floor <= initial <= 1:
            raise ValueError(f"need 0 < floor <= initial <= 1, got floor={floor}, initial={initial}")
        if decay < 0:
            raise ValueError(f"decay must be >= 0, got {decay}")
        self.initial = initial
        self.floor = floor
        self.decay = decay
        self.value = initial

    def step(self) -> float:
        """Decay once toward the floor; return the new value."""
        self.value = max(self.floor, self.value - self.decay)
        return self.value

    def reset(self) -> float:
        """Back to the initial value; return it."""
        self.value = self.initial
        return self.value

    def __repr__(self) -> str:
        return f"NewTokenRatio(value={self.value:.3f}, initial={self.initial}, floor={self.floor})"


def check_budget(mode: str) -> str:
    if mode not in BUDGET_MODES:
        raise InvalidRequest(
            f"unknown decode budget mode {mode!r}; valid: {', '.join(BUDGET_MODES)}", param="budget"
        )
    return mode
