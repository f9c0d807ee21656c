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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from engine.core.errors import InvalidRequest

if TYPE_CHECKING:
    from engine.core.events import EventBus
    from engine.core.handle import RequestHandle
    from engine.core.request import Request
    from engine.core.snapshot import BackendSnapshot, Rates

@dataclass(frozen=True)
class BackendInfo:
    """Facts about one backend that do not change while it serves (the GUI's card)."""

    name: str
    device: str
    model: str
    threads: int
    n_ctx: int
    n_seq_max: int
    n_batch: int
    flash_attn: str
    kv_unified: bool


# (request, handle, t_submit) of each request a failed or draining backend gives back.
Handed = tuple["Request", "RequestHandle", float]


@runtime_checkable
class BackendProtocol(Protocol):
    name: str
    device: str  # "cpu", "gpu", "gpu1", ..., "remote"
    rates: Rates
    healthy: bool
    error: str | None  # why it is unhealthy
    on_unhealthy: Callable[[BackendProtocol, Sequence[Handed]], None] | None

    @property
    def cap(self) -> int: ...

    # ---- lifecycle ----
    def start(self) -> BackendProtocol: ...
    def stop(self, timeout: float = 10.0) -> None: ...
    def restart(self, timeout: float = 30.0) -> None:
        """Serve again with fresh state. Serialised: a restart while one runs raises
        `RestartInProgress`. A healthy backend drains first: its queued requests are
        handed to `on_unhealthy` (the engine moves them) before it goes down."""

    # ---- requests ----
    def validate(self, request: Request) -> None:
        """Raise an `EngineError` if this backend can never serve `request`."""

    def match(self, request: Request) -> int:
        """Prompt tokens this backend's cache holds (or is predicted to hold) for `request`."""

    def cached_prefix(self, request: Request) -> tuple[int, int]:
        """`match`, and of it the own history of an earlier request that `request` resumes here
        (a conversation's next turn), past what other cached prompts share: 0 where none, or
        where the backend cannot tell. One lookup, for the router."""

    def pin_prefix(self, request: Request) -> tuple[int, object]:
        """`(cached tokens, pin)`: keep the match from eviction until admission; pin may be None."""

    def enqueue(self, request: Request, handle: RequestHandle | None = None, *, pin=None,
                cached_estimate: int | None = None, t_submit: float | None = None) -> RequestHandle: ...

    def cancel(self, request_id: str) -> None: ...

    # ---- controls ----
    def set_cap(self, cap: int | None, adaptive: bool | None = None) -> None:
        """The most requests it runs at once (None: the device's automatic cap); `adaptive`
        switches a kind's adaptive limit on or off (None: as it is; a kind without one ignores it)."""
    def set_rates(self, rates: Rates) -> None: ...
    def set_cache_enabled(self, enabled: bool) -> Future: ...
    def flush(self) -> Future: ...
    def warm(self, tokens) -> RequestHandle: ...

    # ---- state ----
    def snapshot(self) -> BackendSnapshot: ...
    def info(self) -> BackendInfo: ...
    def kv_state_bytes(self) -> int:
        """llama.cpp's own state size of the backend's context (0 where it has none here)."""

    # ---- what it serves ----
    models: list[str]  # model ids it serves ([]: not known yet; it may take any)
    n_vocab: int  # token ids it accepts (0: not known)
    model: Any  # the local model it runs, if any (the engine frees it when done)
    tokenizer: Any  # turns streamed text back into tokens (`tokenize`), if it can
    bus: EventBus  # where it publishes its events

    def enqueue_group(self, requests: list[Request], handles: list[RequestHandle], *, pin=None,
                      cached_estimate: int | None = None, t_submit: float | None = None) -> None:
        """Queue the choices of one request (same prompt) together."""

    embeds: bool  # computes embeddings (`embed`)

    def embed(self, inputs: Sequence[Sequence[int]]) -> Future:
        """A Future of one embedding (float32 array) per input (token ids), in order."""


class BackendBase:
    """What a backend kind may inherit where it has nothing of its own to say."""

    model: Any = None
    tokenizer: Any = None
    n_vocab: int = 0
    embeds: bool = False

    def embed(self, inputs) -> Future:
        """A kind without embeddings refuses them (the engine routes only to backends that have them)."""
        raise InvalidRequest(f"backend {self.name} does not compute embeddings")  # type: ignore[attr-defined]

    def enqueue_group(self, requests, handles, *, pin=None, cached_estimate: int | None = None,
                      t_submit: float | None = None) -> None:
        """Each choice on its own, in order, on this backend (the first holds the pin)."""
        for i, (r, h) in enumerate(zip(requests, handles)):
            self.enqueue(r, h, pin=pin if i == 0 else None,  # type: ignore[attr-defined]
                         cached_estimate=cached_estimate, t_submit=t_submit)

    def info(self) -> BackendInfo:
        snap = self.snapshot()  # type: ignore[attr-defined]
        return BackendInfo(name=snap.name, device=snap.device, model="", threads=snap.threads, n_ctx=snap.n_ctx,
                           n_seq_max=snap.cap, n_batch=0, flash_attn="", kv_unified=True)

    def kv_state_bytes(self) -> int:
        return 0
