"""The Engine: backends that share a model per device, a router, and an event bus.

`submit()` routes one whole request to one backend and returns its handle. Routing and
enqueueing happen under one lock, so each request sees the queues its predecessors made,
and the chosen backend's matched prefix is pinned until the request is admitted (the
router's cache estimate cannot be evicted under it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

from . import chat
from .backend import Backend, BackendConfig, error_record
from .calibrate import ModelRates
from .errors import BackendUnavailable, EngineError, InvalidRequest
from .events import EventBus, RequestRouted
from .handle import RequestHandle
from .model import Model, ModelRegistry, resolve_model
from .request import Request, SamplingParams
from .router import RouteQuery, Router
from .snapshot import BackendSnapshot, Rates

log = logging.getLogger(__name__)

# Used for a backend that `tandem calibrate` has not measured (stored rates are picked up
# by `Engine.load`; explicit `rates` win over both).
DEFAULT_RATES = {
    "gpu": Rates(prefill_tok_s=20000.0, decode_tok_s=500.0, source="default"),
    "cpu": Rates(prefill_tok_s=400.0, decode_tok_s=40.0, source="default"),
}


class Engine:
    """Owns backends and a router. Thread-safe: submit from any thread."""

    def __init__(self, backends: list[Backend], router: Router | None = None, bus: EventBus | None = None,
                 registry: ModelRegistry | None = None):
        if not backends:
            raise InvalidRequest("an engine needs at least one backend")
        self.backends = {b.name: b for b in backends}
        for b in backends:
            b.on_unhealthy = self._rehome
        self.router = router or Router()
        self.bus = bus or backends[0].bus
        self._registry = registry
        self._lock = threading.Lock()
        self._closed = False
        self.online = None  # OnlineRefresh, when rates are refreshed from observed steps

    @classmethod
    def load(cls, model: str | Path, configs: list[BackendConfig], *, policy: str = "seed-score",
             rates: dict[str, Rates] | None = None, progress=None, online_rates: bool = False) -> "Engine":
        """Resolve the model, load it once per device, start one backend per config.

        Each backend's rates: `rates[name]` if given, else the calibrated ones stored for this
        model file and backend config (`engine.calibrate`), else `DEFAULT_RATES`. With
        `online_rates` they are then kept current from the steps the backends run (EWMA);
        benchmarks leave it off so that every run is priced alike.
        """
        path = resolve_model(str(model), progress=progress)
        calibrated = ModelRates(path)
        registry = ModelRegistry()
        bus = EventBus()
        backends: list[Backend] = []
        try:
            for c in configs:
                m = registry.acquire(path, c.device, progress=progress)
                r = (rates or {}).get(c.name) or calibrated.get(c, m.device) or DEFAULT_RATES[m.device]
                backends.append(Backend(c, m, bus, r).start())
        except BaseException:
            for b in backends:
                b.stop()
            raise
        engine = cls(backends, Router(policy), bus, registry)
        if online_rates:
            from .calibrate import OnlineRefresh

            engine.online = OnlineRefresh(engine).attach()
        return engine

    # ---- requests ----

    @property
    def model(self) -> Model:
        return next(iter(self.backends.values())).model

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Route `request` to one backend and queue it there. Raises `EngineError` on bad input."""
        handle = RequestHandle(request, loop)
        self._route(request, handle, time.monotonic())
        return handle

    def _route(self, request: Request, handle: RequestHandle, t_submit: float) -> None:
        with self._lock:
            self._check_open()
            candidates = [b for b in self.backends.values() if request.backend in (None, b.name)]
            for b in candidates:
                b.validate(request)
            cached = {b.name: b.match(request) for b in self.backends.values()}
            query = RouteQuery.from_request(request, cached)
            decision = self.router.route(query, self.snapshot())
            backend = self.backends[decision.backend]
            estimate, pin = backend.pin_prefix(request)
            handle.decision = decision
            backend.enqueue(request, handle, pin=pin, cached_estimate=estimate, t_submit=t_submit)
        self.bus.publish(RequestRouted(decision))

    def _rehome(self, failed: Backend, moved: list) -> None:
        """A backend went unhealthy: route its movable requests to the others (its thread)."""
        log.warning("%s is unhealthy (%s); re-routing %d requests", failed.name, failed.error, len(moved))
        for request, handle, t_submit in moved:
            try:
                if request.backend == failed.name:  # pinned to the failed backend: nowhere to go
                    raise BackendUnavailable(f"backend {failed.name} is unhealthy: {failed.error}")
                self._route(request, handle, t_submit)
            except EngineError as e:
                handle._deliver_finish(error_record(request, failed.name, f"{e} (after {failed.error})", t_submit))

    def restart_backend(self, name: str) -> None:
        """Give an (unhealthy) backend a fresh context; it serves again afterwards."""
        self.backend(name).restart()

    def generate(self, prompt: str | list[int], sampling: SamplingParams | None = None, **kw) -> RequestHandle:
        """Submit raw text (tokenized with BOS) or token ids."""
        self._check_open()
        tokens = self.model.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        return self.submit(Request(tuple(tokens), sampling or SamplingParams(), **kw))

    def chat(self, messages: list[dict], sampling: SamplingParams | None = None, **kw) -> RequestHandle:
        """Submit a chat, rendered with the model's own template."""
        tokens = self.chat_tokens(messages)
        return self.submit(Request(tuple(tokens), sampling or SamplingParams(), **kw))

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        """Render `messages` with the model's chat template and tokenize the result."""
        if not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        self._check_open()
        try:
            return chat.chat_tokens(self.model, messages)  # content is never parsed for special tokens
        except InvalidRequest:
            raise
        except Exception as e:  # the template's own errors (Jinja raises its own types)
            raise InvalidRequest(f"the chat template rejected these messages: {str(e)[:200]}", param="messages") from e

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailable("the engine is closed")

    # ---- state and controls ----

    def snapshot(self) -> list[BackendSnapshot]:
        return [b.snapshot() for b in self.backends.values()]

    def backend(self, name: str) -> Backend:
        try:
            return self.backends[name]
        except KeyError:
            raise InvalidRequest(f"unknown backend {name!r} (have: {', '.join(self.backends)})",
                                 param="backend") from None

    def set_rates(self, name: str, rates: Rates) -> None:
        """Replace one backend's rates (calibration, online refresh, a typed override)."""
        self.backend(name).set_rates(rates)

    def warm(self, tokens, backend: str | None = None, timeout: float | None = None) -> None:
        """Prefill `tokens` into the prefix cache of one backend or all; wait until done."""
        targets = [self.backend(backend)] if backend else list(self.backends.values())
        handles = [b.warm(tokens) for b in targets]
        for h in handles:
            record = h.result(timeout)
            if record.error:
                raise InvalidRequest(f"warming {record.backend} failed: {record.error}")

    def flush(self, backend: str | None = None, timeout: float | None = 30) -> None:
        targets = [self.backend(backend)] if backend else list(self.backends.values())
        for f in [b.flush() for b in targets]:
            f.result(timeout)

    def close(self) -> None:
        """Stop every backend (cancelling what they hold) and free the models. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.online is not None:
            self.online.detach()
        for b in self.backends.values():
            b.stop()
        if self._registry is not None:
            for b in self.backends.values():
                self._registry.release(b.model)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
