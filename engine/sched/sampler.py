"""A sequence's sampler chain as the runner drives it. The scheduler carries it on `SeqState` for
the runner and never calls it; engine/llama/sampling.py `Sampler` is the implementation, so the
scheduler's package names no native type."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Sampler(Protocol):
    """One sequence's chain (worker thread only, like the sequence that holds it)."""

    @property
    def direct(self) -> bool:
        """The token is read from the device's own choice, with no host call for the row."""
        ...

    @property
    def dist(self) -> object:
        """The fused temperature draw the step uploads for this row, or None."""
        ...

    @property
    def guards_eog(self) -> bool:
        """An end token it samples must be undone (a greedy chain that ignores end tokens)."""
        ...

    def sample(self, ctx: Any, row: int, deadline: float | None = None) -> int:
        """The token of output row `row` of the last decode, accepted (or a search's marker)."""
        ...

    def go_on(self, deadline: float | None) -> int:
        """Go on with a grammar search under way: the token, or a search's marker again."""
        ...

    def accept(self, tokens: Sequence[int]) -> None:
        """Replay tokens chosen before this chain took over."""
        ...
