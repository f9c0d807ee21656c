"""What every backend kind provides to the `Engine`: the one interface between them.

A backend takes whole requests, runs them somewhere (a llama.cpp context in this process,
an OpenAI-compatible engine over HTTP, a simulated runner) and reports its state as an
immutable `BackendSnapshot`, which is all the router ever sees. Nothing above `engine/`
holds a backend: `ui/` and `app/` go through `Engine`'s controls.

Thread contract: every method may be called from any thread unless it says otherwise;
`on_unhealthy` is called from the backend's own thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from engine.core.handle import RequestHandle
    from engine.core.request import Request
    from engine.core.snapshot import BackendSnapshot, Rates

# (request, handle, t_submit) of each request a failed or draining backend gives back.
Handed = tuple["Request", "RequestHandle", float]


@runtime_checkable
class BackendProtocol(Protocol):
    name: str
    device: str  # "cpu", "gpu", "gpu1", ..., "remote"
    rates: "Rates"
    healthy: bool
    error: str | None  # why it is unhealthy
    on_unhealthy: Callable[["BackendProtocol", Sequence[Handed]], None] | None

    @property
    def cap(self) -> int: ...

    # ---- lifecycle ----
    def start(self) -> "BackendProtocol": ...
    def stop(self, timeout: float = 10.0) -> None: ...
    def restart(self, timeout: float = 30.0) -> None:
        """Serve again with fresh state. Serialised: a restart while one runs raises
        `RestartInProgress`. A healthy backend drains first: its queued requests are
        handed to `on_unhealthy` (the engine moves them) before it goes down."""

    # ---- requests ----
    def validate(self, request: "Request") -> None:
        """Raise an `EngineError` if this backend can never serve `request`."""

    def match(self, request: "Request") -> int:
        """Prompt tokens this backend's cache holds (or is predicted to hold) for `request`."""

    def pin_prefix(self, request: "Request") -> tuple[int, object]:
        """`(cached tokens, pin)`: keep the match from eviction until admission; pin may be None."""

    def enqueue(self, request: "Request", handle: "RequestHandle | None" = None, *, pin=None,
                cached_estimate: int | None = None, t_submit: float | None = None) -> "RequestHandle": ...

    def cancel(self, request_id: str) -> None: ...

    # ---- controls ----
    def set_cap(self, cap: int) -> None: ...
    def set_rates(self, rates: "Rates") -> None: ...
    def set_cache_enabled(self, enabled: bool) -> Future: ...
    def flush(self) -> Future: ...
    def warm(self, tokens) -> "RequestHandle": ...

    # ---- state ----
    def snapshot(self) -> "BackendSnapshot": ...
