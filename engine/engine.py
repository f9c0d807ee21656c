"""The Engine: backends that share a model per device, a router, and an event bus.

Backends are local llama.cpp contexts, remote OpenAI-compatible engines (engine/remote.py) or
both. An engine with only remote backends loads no model: it is the router in front of a
fleet, and requests carry their prompt as text or chat messages (`Request.text`/`messages`).

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
from .config import RemoteConfig
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
    def load(cls, model: str | Path | None, configs: list[BackendConfig | RemoteConfig], *,
             policy: str = "seed-score", rates: dict[str, Rates] | None = None, progress=None,
             online_rates: bool = False) -> "Engine":
        """Resolve the model, load it once per device, start one backend per config.

        `RemoteConfig`s become remote backends; with nothing but those, no model is loaded
        (`model` may be None).

        Each backend's rates: `rates[name]` if given, else the calibrated ones stored for this
        model file and backend config (`engine.calibrate`), else `DEFAULT_RATES`. With
        `online_rates` they are then kept current from the steps the backends run (EWMA);
        benchmarks leave it off so that every run is priced alike.
        """
        local = [c for c in configs if not isinstance(c, RemoteConfig)]
        if local and model is None:
            raise InvalidRequest("local backends need a model (--model); only remote: backends run without one",
                                 param="model")
        path = resolve_model(str(model), progress=progress) if local else None
        calibrated = ModelRates(path) if local else None
        registry = ModelRegistry()
        bus = EventBus()
        backends: list = []
        try:
            for c in configs:
                if isinstance(c, RemoteConfig):
                    from .remote import RemoteBackend  # aiohttp; only fleets need it

                    backends.append(RemoteBackend.from_config(c, bus, (rates or {}).get(c.name)))
                    continue
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
    def model(self) -> Model | None:
        """The local model (every local backend runs the same file); None in a fleet of remote
        engines only."""
        return next((b.model for b in self.backends.values() if b.device != "remote"), None)

    def model_ids(self) -> list[str]:
        """The models this engine serves: the local model's file stem, then each remote
        engine's models, in backend order, without repeats."""
        ids: list[str] = []
        for b in self.backends.values():
            for m in (b.models if b.device == "remote" else [Path(b.model.path).stem]):
                if m not in ids:
                    ids.append(m)
        return ids

    def serves(self, backend, model: str | None) -> bool:
        """Whether `backend` can take a request that names `model` (None: any)."""
        if model is None:
            return True
        if backend.device == "remote":
            return model in backend.models or not backend.models  # not known yet: let it try
        return model == Path(backend.model.path).stem

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Route `request` to one backend and queue it there. Raises `EngineError` on bad input."""
        handle = RequestHandle(request, loop)
        self._route(request, handle, time.monotonic())
        return handle

    def _route(self, request: Request, handle: RequestHandle, t_submit: float) -> None:
        with self._lock:
            self._check_open()
            serving = [b for b in self.backends.values() if self.serves(b, request.model)]
            if not serving:
                raise InvalidRequest(f"no backend serves the model {request.model!r} "
                                     f"(served: {', '.join(self.model_ids())})", param="model")
            candidates = [b for b in serving if request.backend in (None, b.name)]
            for b in candidates:
                b.validate(request)
            cached = {b.name: b.match(request) for b in serving}
            query = RouteQuery.from_request(request, cached)
            decision = self.router.route(query, [b.snapshot() for b in serving])
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
        """Submit raw text (tokenized with BOS where a local model is at hand) or token ids."""
        self._check_open()
        if isinstance(prompt, str) and self.model is None:
            return self.submit(Request((), sampling or SamplingParams(), text=prompt, **kw))
        tokens = self.model.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        return self.submit(Request(tuple(tokens), sampling or SamplingParams(), **kw))

    def chat(self, messages: list[dict], sampling: SamplingParams | None = None, **kw) -> RequestHandle:
        """Submit a chat, rendered with the model's own template (remote engines only: as
        messages, which each engine renders with its own)."""
        if self.model is None:
            if not messages:
                raise InvalidRequest("messages must not be empty", param="messages")
            return self.submit(Request((), sampling or SamplingParams(), messages=tuple(messages), **kw))
        tokens = self.chat_tokens(messages)
        return self.submit(Request(tuple(tokens), sampling or SamplingParams(), **kw))

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        """Render `messages` with the model's chat template and tokenize the result."""
        if not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        self._check_open()
        if self.model is None:
            raise InvalidRequest("this engine has no local model to render a chat template with", param="messages")
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
                if b.device != "remote":
                    self._registry.release(b.model)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
