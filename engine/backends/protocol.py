"""What every backend kind provides to the `Engine`: the one interface between them.

A backend takes whole requests, runs them somewhere (a llama.cpp context in this process,
an OpenAI-compatible engine over HTTP, a null answerer) and reports its state as an immutable
`BackendSnapshot`, which is all the router ever sees. Nothing above `engine/` holds a backend:
`ui/`, `app/` and `bench/` go through `Engine`'s controls and these methods, never through a
kind's own attributes, and never ask which kind a backend is to decide what it can do: a
capability one kind lacks has its default on `BackendBase` (each method's docstring is its
contract, the defaults included).

Thread contract: every method may be called from any thread unless it says otherwise;
`on_unhealthy` is called from the backend's own thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from engine.core.errors import InvalidRequest

if TYPE_CHECKING:
    from engine.core.events import EventBus
    from engine.core.handle import RequestHandle
    from engine.core.request import Request
    from engine.core.snapshot import BackendSnapshot, Rates

Measured = TypeVar("Measured", covariant=True)
Found = TypeVar("Found")


@dataclass(frozen=True)
class BackendInfo:
    """Facts about one backend that do not change while it serves (the GUI's card, summaries)."""

    name: str
    device: str
    model: str
    threads: int
    n_ctx: int
    n_seq_max: int
    n_batch: int
    flash_attn: str
    kv_unified: bool
    kind: str = "local"  # the kind that built it: "local", "remote", "null"
    url: str = ""  # where it runs: "" in this process, else the engine's URL
    rates_key: str = ""  # what measured rates of it are stored under ("": none are)
    logprobs: bool = True  # relays each token's log-probabilities (`SamplingParams.logprobs`)


@dataclass(frozen=True)
class CapState:
    """A backend's cap as the user set it. `cap`: the most requests it runs at once (the ceiling
    of an adaptive limit); `auto`: none was given, the device's own applies; `adaptive`: the live
    limit moves below `cap`. `set_cap(None if auto else cap, adaptive=adaptive)` restores it."""

    cap: int
    auto: bool = False
    adaptive: bool = False


class Calibrator(Protocol[Measured]):
    """A way to measure a backend's rates (engine/rates/measure.py). A backend picks the way
    that can see its work (`BackendProtocol.calibrate`), so no caller asks what kind it is."""

    def by_steps(self, backend: Any) -> Measured:
        """Time the backend's own batched steps: it runs them in this process, publishes
        `StepDone` for each, and its worker takes `call`s (engine/backends/local.py `Backend`)."""
        ...

    def by_requests(self, backend: BackendProtocol) -> Measured:
        """Time whole requests sent to it (TTFT, ITL): for an engine whose steps are not seen."""
        ...


# (request, handle, t_submit) of each request a failed or draining backend gives back.
Handed = tuple["Request", "RequestHandle", float]


@runtime_checkable
class BackendProtocol(Protocol):
    name: str
    device: str  # "cpu", "gpu", "gpu1", ..., "remote", "null": where it runs, for display and pricing
    healthy: bool
    error: str | None  # why it is unhealthy
    on_unhealthy: Callable[[BackendProtocol, Sequence[Handed]], None] | None

    @property
    def rates(self) -> Rates:
        """What the router prices it with (`set_rates` replaces them)."""
        ...

    @property
    def cap(self) -> int:
        """The most requests it runs at once now (an adaptive backend's ceiling)."""
        ...

    # ---- lifecycle ----
    def start(self) -> BackendProtocol:
        """Begin serving (idempotent for a started one); returns itself."""
        ...

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what it holds, stop its threads, free what it owns. Idempotent."""
        ...

    def restart(self, timeout: float = 30.0) -> None:
        """Serve again with fresh state. Serialised: a restart while one runs raises
        `RestartInProgress`. A healthy backend drains first: its queued requests are
        handed to `on_unhealthy` (the engine moves them) before it goes down."""
        ...

    # ---- requests ----
    def validate(self, request: Request) -> None:
        """Raise an `EngineError` if this backend can never serve `request`."""
        ...

    def prompt_limit(self) -> int:
        """The longest prompt (tokens) this backend takes, as this process can check it before
        sending (its context per sequence); 0 where it cannot tell here (an engine elsewhere
        applies its own limit and says so in its error)."""
        ...

    def match(self, request: Request) -> int:
        """Prompt tokens this backend's cache holds (or is predicted to hold) for `request`."""
        ...

    def cached_prefix(self, request: Request) -> tuple[int, int]:
        """`match`, and of it the own history of an earlier request that `request` resumes here
        (a conversation's next turn), past what other cached prompts share: 0 where none, or
        where the backend cannot tell. One lookup, for the router."""
        ...

    def pin_prefix(self, request: Request) -> tuple[int, object]:
        """`(cached tokens, pin)`: keep the match from eviction until admission; pin may be None."""
        ...

    def enqueue(self, request: Request, handle: RequestHandle | None = None, *, pin: object = None,
                cached_estimate: int | None = None, t_submit: float | None = None) -> RequestHandle:
        """Queue `request` (validated first); its text and finish reach `handle`. Raises
        `BackendUnavailable` when it is not serving, `QueueFull` when its queue is."""
        ...

    def enqueue_group(self, requests: list[Request], handles: list[RequestHandle], *, pin: object = None,
                      cached_estimate: int | None = None, t_submit: float | None = None) -> None:
        """Queue the choices of one request (same prompt) together (default: one by one)."""
        ...

    def cancel(self, request_id: str) -> None:
        """End a queued or running request (cancelled); unknown ids are ignored."""
        ...

    # ---- controls ----
    def set_cap(self, cap: int | None, adaptive: bool | None = None) -> None:
        """The most requests it runs at once (None: the device's automatic cap); `adaptive`
        switches a kind's adaptive limit on or off (None: as it is; a kind without one ignores it)."""
        ...

    def cap_state(self) -> CapState:
        """The cap as the user set it (default: `cap`, fixed), to restore after a measurement."""
        ...

    def set_rates(self, rates: Rates) -> None:
        """Price it with `rates` from now on (calibration, online refresh, an override)."""
        ...

    def set_cache_enabled(self, enabled: bool) -> Future:
        """Reuse cached prefixes or not; done when the future is."""
        ...

    def flush(self) -> Future:
        """Drop the unpinned cached prefixes (or their prediction); done when the future is."""
        ...

    def warm(self, tokens: Sequence[int]) -> RequestHandle:
        """Prefill `tokens` into its cache (one request generating one token)."""
        ...

    def reset_stats(self) -> Future:
        """Zero what its snapshot counts (cache queries and hits, observed speeds, steps); what
        is cached, the cap and the rates stay. Default: nothing counted, done at once."""
        ...

    def calibrate(self, how: Calibrator[Found]) -> Found:
        """Measure its rates the way that can see its work (`how.by_steps` or
        `how.by_requests`). Default: `InvalidRequest`, it has none to measure."""
        ...

    # ---- state ----
    def snapshot(self) -> BackendSnapshot:
        """Its state now, immutable: all the router sees."""
        ...

    def info(self) -> BackendInfo:
        """Facts that do not change while it serves."""
        ...

    def kv_state_bytes(self) -> int:
        """llama.cpp's own state size of the backend's context (0 where it has none here)."""
        ...

    # ---- what it serves ----
    @property
    def models(self) -> list[str]:
        """Model ids it serves ([]: not known yet; it may take any)."""
        ...

    @property
    def n_vocab(self) -> int:
        """Token ids it accepts (0: not known)."""
        ...

    model: Any  # the local model it runs, if any (the engine frees it when done)

    @property
    def tokenizer(self) -> Any:
        """Turns streamed text back into tokens (`tokenize`), if it can (None: it cannot)."""
        ...

    bus: EventBus  # where it publishes its events

    embeds: bool  # computes embeddings (`embed`)

    def embed(self, inputs: Sequence[Sequence[int]]) -> Future:
        """A Future of one embedding (float32 array) per input (token ids), in order."""


class BackendBase:
    """The defaults of the optional capabilities: what a kind inherits where it has nothing of
    its own to say (each contract is on `BackendProtocol`)."""

    name: str
    model: Any = None
    tokenizer: Any = None
    on_unhealthy: Callable[[BackendProtocol, Sequence[Handed]], None] | None = None  # set by the engine
    embeds: bool = False

    def embed(self, inputs: Sequence[Sequence[int]]) -> Future:
        """A kind without embeddings refuses them (the engine routes only to backends that have them)."""
        raise InvalidRequest(f"backend {self.name} does not compute embeddings")

    def enqueue_group(self, requests: list[Request], handles: list[RequestHandle], *, pin: object = None,
                      cached_estimate: int | None = None, t_submit: float | None = None) -> None:
        """Each choice on its own, in order, on this backend (the first holds the pin)."""
        for i, (r, h) in enumerate(zip(requests, handles)):
            self.enqueue(r, h, pin=pin if i == 0 else None,  # type: ignore[attr-defined]
                         cached_estimate=cached_estimate, t_submit=t_submit)

    def prompt_limit(self) -> int:
        return 0

    def cap_state(self) -> CapState:
        return CapState(self.cap)  # type: ignore[attr-defined]

    def reset_stats(self) -> Future:
        return done_future()

    def calibrate(self, how: Calibrator[Found]) -> Found:
        raise InvalidRequest(f"backend {self.name} has no rates to measure")

    def info(self) -> BackendInfo:
        snap = self.snapshot()  # type: ignore[attr-defined]
        return BackendInfo(name=snap.name, device=snap.device, model="", threads=snap.threads, n_ctx=snap.n_ctx,
                           n_seq_max=snap.cap, n_batch=0, flash_attn="", kv_unified=True, kind=snap.device)

    def kv_state_bytes(self) -> int:
        return 0


def done_future(result: object = None) -> Future:
    """A future that is already done (for controls with nothing to wait for)."""
    f: Future = Future()
    f.set_result(result)
    return f
