"""The Engine: backends that share a model per device, a router, and an event bus.

Backends are local llama.cpp contexts, remote OpenAI-compatible engines (engine/backends/remote/) or
both. An engine with only remote backends loads no model: it is the router in front of a
fleet, and requests carry their prompt as text or chat messages (`Request.text`/`messages`).

`submit()` routes one whole request to one backend and returns its handle; `submit_group()`
routes the choices of one request (OpenAI's `n`) together, to one backend, which computes
their shared prompt once (engine/backends/local.py `enqueue_group`). Routing and
enqueueing happen under one lock, so each request sees the queues its predecessors made,
and the chosen backend's matched prefix is pinned until the request is admitted (the
router's cache estimate cannot be evicted under it).

Every control is here (cap, cache on/off, warm, flush, restart, rates, snapshot, facts), so
`ui/` and `app/` name backends by name and never hold a backend object. It asks backends only
what `BackendProtocol` (engine/backends/protocol.py) says, and builds them from their configs
through the kinds registered in engine/backends/registry.py.

Thread contract: every method may be called from any thread. `restart` blocks (run it off an
event loop); a second restart of the same backend while one runs raises `RestartInProgress`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.backends import registry
from engine.backends.config import resolve_contexts
from engine.backends.protocol import BackendInfo, BackendProtocol, Handed
from engine.core.errors import BackendUnavailable, EngineError, InvalidRequest, QueueFull
from engine.core.events import EventBus, RequestRouted
from engine.core.handle import RequestHandle
from engine.core.request import Request, RequestStatus, SamplingParams, error_record, next_request_id
from engine.core.snapshot import BackendSnapshot, Rates
from engine.prompts import chat
from engine.prompts.chat import ChatPrompt
from engine.prompts.tool_calls import ToolMode
from engine.rates.measure import calibrate_at_load
from engine.rates.store import ModelRates
from engine.routing import RouteQuery, Router, RoutingDecision

from .llama.model import Model, ModelRegistry, resolve_model

if TYPE_CHECKING:
    from engine.rates.refresh import OnlineRefresh

log = logging.getLogger(__name__)


class Engine:
    """Owns backends and a router. Thread-safe: submit from any thread."""

    def __init__(self, backends: list[BackendProtocol], router: Router | None = None, bus: EventBus | None = None,
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
        self.online: OnlineRefresh | None = None  # when rates are refreshed from observed steps

    @classmethod
    def load(cls, model: str | Path | None, configs: Sequence[registry.BackendSpec], *,
             policy: str = "default", rates: dict[str, Rates] | None = None, progress=None,
             online_rates: bool = False, calibrate: bool = False,
             status: Callable[[str], None] | None = None,
             calibration_progress: Callable[[int, int, str], None] | None = None) -> Engine:
        """Resolve the model, load it once per device, start one backend per config (of any kind
        engine/backends/registry.py knows).

        `RemoteConfig`s become remote backends; with nothing but those, no model is loaded
        (`model` may be None).

        Each backend's rates: `rates[name]` if given, else the calibrated ones stored for this
        model file and backend config (`engine.rates`), else `DEFAULT_RATES`, a placeholder.
        With `calibrate`, placeholders are replaced before this returns by a short measurement
        (`calibrate_at_load`, a few seconds per backend config, stored for the next start;
        `status(text)` hears what is measured, `calibration_progress(done, total, what)` each
        step of it), so the router never prices a backend with them; the counters the
        measurement moved are then reset (`reset_stats`), so they start at the user's first
        request. With `online_rates` rates are then kept current from the steps the backends
        run (EWMA); benchmarks leave it off so that every run is priced alike.
        """
        router = Router(policy)  # a bad policy name or parameter fails here, before the model loads
        local = [c for c in configs if registry.needs_model(c)]
        if local and model is None:
            raise InvalidRequest("local backends need a model (--model); only remote: backends run without one",
                                 param="model")
        path = resolve_model(str(model), progress=progress) if local else None
        if path is not None:  # `contexts=auto` specs: as many contexts as the model and device suit
            configs = resolve_contexts(configs, Path(path).stat().st_size)
        calibrated = ModelRates(path) if path is not None else None
        models = ModelRegistry()
        bus = EventBus()
        ctx = registry.BuildContext(Path(path) if path else None, models, bus, calibrated, dict(rates or {}), progress)
        backends: list = []
        try:
            for c in configs:
                backends.append(registry.build(c, ctx))
        except BaseException:
            for b in backends:
                b.stop()
            raise
        engine = cls(backends, router, bus, models)
        if calibrate and path is not None:
            try:
                measured = calibrate_at_load([b for b in backends if b.model is not None], Path(path),
                                             engine.model.info.name if engine.model is not None else "",
                                             status=status, progress=calibration_progress)
                if measured:  # the measurement's requests are not the user's: start the counts at zero
                    engine.reset_stats()
            except BaseException:
                engine.close()
                raise
        if online_rates:
            from engine.rates.refresh import OnlineRefresh

            engine.online = OnlineRefresh(engine).attach()
        return engine

    # ---- requests ----

    @property
    def model(self) -> Model | None:
        """The local model (every local backend runs the same file); None in a fleet of remote
        engines only."""
        return next((b.model for b in self.backends.values() if b.model is not None), None)

    @property
    def n_vocab(self) -> int:
        """Token ids every backend accepts: the local model's vocabulary, else the smallest a
        remote engine reports (0: none says)."""
        if self.model is not None:
            return self.model.n_vocab
        said = [b.n_vocab for b in self.backends.values()]
        return min((v for v in said if v), default=0)

    def model_ids(self) -> list[str]:
        """The models this engine serves: the local model's file stem, then each remote
        engine's models, in backend order, without repeats."""
        ids: list[str] = []
        for b in self.backends.values():
            for m in b.models:
                if m not in ids:
                    ids.append(m)
        return ids

    def serves(self, backend, model: str | None) -> bool:
        """Whether `backend` can take a request that names `model` (None: any)."""
        if model is None:
            return True
        return model in backend.models or not backend.models  # not known yet: let it try

    def serving(self, model: str | None) -> list[str]:
        """The backends that can take a request naming `model` (None: any), by name."""
        return [name for name, b in self.backends.items() if self.serves(b, model)]

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Route `request` to one backend and queue it there. Raises `EngineError` on bad input."""
        handle = RequestHandle(request, loop)
        self._route(request, handle, time.monotonic())
        return handle

    def submit_group(self, requests: list[Request], loop: asyncio.AbstractEventLoop | None = None
                     ) -> list[RequestHandle]:
        """Route requests that share one prompt (the choices of one request) to ONE backend,
        which computes the prompt once and lets every choice alias its KV. A backend without
        group support (remote) gets them one by one, still all of them."""
        if len({r.prompt_tokens for r in requests}) != 1:
            raise InvalidRequest("the requests of a group must share their prompt")
        handles = [RequestHandle(r, loop) for r in requests]
        self._route(requests[0], handles[0], time.monotonic(), group=(requests, handles))
        return handles

    def _route(self, request: Request, handle: RequestHandle, t_submit: float, group=None,
               moved_from: str | None = None, continued: int = 0) -> None:
        t_wait = time.perf_counter()
        with self._lock:
            t_in = time.perf_counter()
            self._check_open()
            serving = [b for b in self.backends.values() if self.serves(b, request.model)]
            if not serving:
                raise InvalidRequest(f"no backend serves the model {request.model!r} "
                                     f"(served: {', '.join(self.model_ids())})", param="model")
            candidates = [b for b in serving if request.backend in (None, b.name)]
            for b in candidates:
                b.validate(request)
            prefixes = {b.name: b.cached_prefix(request) for b in serving}
            query = RouteQuery.from_request(request, {name: n for name, (n, _) in prefixes.items()}, moved_from,
                                            continued, {name: r for name, (_, r) in prefixes.items()})
            for attempt in range(len(serving)):
                decision = self.router.route(query, [b.snapshot() for b in serving], since=t_in, wait_s=t_in - t_wait)
                backend = self.backends[decision.backend]
                estimate, pin = backend.pin_prefix(request)
                handle.decision = decision
                try:
                    if group is None:
                        backend.enqueue(request, handle, pin=pin, cached_estimate=estimate, t_submit=t_submit)
                    else:
                        for h in group[1]:
                            h.decision = decision
                        backend.enqueue_group(*group, pin=pin, cached_estimate=estimate, t_submit=t_submit)
                    break
                except QueueFull as e:  # how long the client should wait: the router's estimate
                    e.retry_after_s = decision.chosen.queue_wait_s
                    raise
                except BackendUnavailable:
                    # It began a restart (or failed) after the snapshot the router saw: the
                    # next snapshot shows it unhealthy, so route again.
                    if attempt == len(serving) - 1:
                        raise
        self.bus.publish(RequestRouted(decision))

    def embed(self, inputs: Sequence[Sequence[int]], backend: str | None = None) -> tuple[Future, RoutingDecision]:
        """Route an embedding request (token ids per input) like any request, among the backends
        that compute embeddings (the decision's `kind` is "embedding"); the chosen backend
        batches it with the others it has (`Future` of one vector per input, in order)."""
        t_wait = time.perf_counter()
        with self._lock:
            t_in = time.perf_counter()
            self._check_open()
            able = [b for b in self.backends.values() if b.embeds]
            if not able:
                raise InvalidRequest("no backend here computes embeddings (a remote engine embeds at its own "
                                     "/v1/embeddings)", param="model")
            query = RouteQuery(request_id=next_request_id(), prompt_tokens=sum(len(t) for t in inputs), max_tokens=0,
                               backend=backend, kind="embedding")
            decision = self.router.route(query, [b.snapshot() for b in able], since=t_in, wait_s=t_in - t_wait)
            future = self.backends[decision.backend].embed(inputs)
        self.bus.publish(RequestRouted(decision))
        return future, decision

    def _rehome(self, failed: BackendProtocol, moved: Sequence[Handed]) -> None:
        """A backend went unhealthy or is restarting: route the requests it gave back to the
        others (called on its worker thread, or on the restarting thread). One whose stream
        broke after it began (a remote engine's, `RequestHandle._interrupt`) goes on from the
        text it streamed (`Request.continued`), so its caller sees one stream."""
        why = failed.error or f"backend {failed.name} is restarting"
        log.warning("%s: %s; re-routing %d requests", failed.name, why, len(moved))
        for request, handle, t_submit in moved:
            part = handle._take_interrupted()
            try:
                if request.backend == failed.name:  # pinned to the failed backend: nowhere to go
                    raise BackendUnavailable(f"backend {failed.name} is not serving: {why}")
                if part is None:
                    self._route(request, handle, t_submit, moved_from=failed.name)
                    continue
                n = part.output_tokens
                budget = min(request.sampling.max_tokens, request.stop_after or request.sampling.max_tokens)
                if n >= budget:  # it had made all it may: what it streamed is the answer
                    stopped = request.stop_after is not None and n >= request.stop_after
                    handle._deliver_finish(replace(
                        part, text="", prompt_tokens=0, cached_tokens=0, output_tokens=0, error=None, error_kind=None,
                        status=RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_LENGTH))
                    continue
                tokenize = self._continuation_tokenizer(failed)
                self._route(request.continued(part.text, n, tokenize), handle, t_submit, moved_from=failed.name,
                            continued=n)
            except EngineError as e:
                handle._deliver_finish(error_record(request, failed.name, f"{e} (after: {why})", t_submit))

    def _continuation_tokenizer(self, failed) -> Callable[[str], list[int]] | None:
        """How to append streamed text to a token-id prompt: the local model's tokenizer, else
        the failed remote backend's (`tokenizer=`), else none."""
        vocab = self.model if self.model is not None else failed.tokenizer
        if vocab is None:
            return None
        return lambda text: vocab.tokenize(text, add_special=False, parse_special=False)

    def restart(self, name: str, timeout: float = 30.0) -> BackendSnapshot:
        """Give a backend a fresh context; it serves again afterwards. A healthy one is drained
        first (its queue moves to the other backends). Raises `RestartInProgress` while a
        restart of the same backend runs. Blocks: run it off an event loop."""
        self._check_open()
        b = self.backend(name)
        b.restart(timeout)
        return b.snapshot()

    def restart_backend(self, name: str) -> None:
        """Same as `restart` (kept for callers that used this name)."""
        self.restart(name)

    def generate(self, prompt: str | list[int], sampling: SamplingParams | None = None, **kw) -> RequestHandle:
        """Submit raw text (tokenized with BOS where a local model is at hand) or token ids."""
        self._check_open()
        if not isinstance(prompt, str):
            return self.submit(Request(tuple(prompt), sampling or SamplingParams(), **kw))
        if self.model is None:
            return self.submit(Request((), sampling or SamplingParams(), text=prompt, **kw))
        tokens = self.model.tokenize(prompt)
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

    def json_grammar(self, schema: dict | None = None) -> str:
        """A grammar (`SamplingParams.grammar`) for replies that are a JSON object, matching
        `schema` when given; `InvalidRequest` with the converter's reason for a schema it
        cannot take. Quick (milliseconds): any thread, the GUI's included."""
        from .llama.grammar import object_grammar, schema_grammar

        return object_grammar() if schema is None else schema_grammar(schema, param="schema")

    def chat_tokens(self, messages: list[dict], tools: list[dict] | None = None,
                    continue_final: bool = False) -> list[int]:
        """Render `messages` with the model's chat template and tokenize the result; with
        `tools`, a prompt for a reply that may call them (engine/prompts/tool_calls.py);
        with `continue_final`, a prompt that goes on with the last (assistant) message."""
        return self.chat_prompt(messages, tools, continue_final=continue_final).tokens

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None, mode: ToolMode | None = None, *,
                    continue_final: bool = False, extra: dict | None = None) -> ChatPrompt:
        """`chat_tokens` with how to read the reply: the tool mode in the template's call format,
        and whether the reply starts in a thinking block (`engine.prompts.chat.render_chat`);
        `extra` are template variables (`chat_template_kwargs`)."""
        if not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        self._check_open()
        if self.model is None:
            raise InvalidRequest("this engine has no local model to render a chat template with", param="messages")
        try:
            # content is never parsed for special tokens
            return chat.render_chat(self.model, messages, tools, mode, continue_final=continue_final,
                                    max_prompt=self.prompt_limit(), extra=extra)
        except InvalidRequest:
            raise
        except Exception as e:  # the template's own errors (Jinja raises its own types)
            raise InvalidRequest(f"the chat template rejected these messages: {str(e)[:200]}", param="messages") from e

    def prompt_limit(self) -> int:
        """The longest prompt a backend checks here (a local one's context per sequence); 0: none does."""
        return max((b.prompt_limit() for b in self.backends.values()), default=0)

    def prompt_tokens(self, text: str, param: str = "prompt") -> list[int]:
        """A raw prompt's tokens (`Model.tokenize`), refused cheaply first when it cannot fit
        any local backend's context (`engine.prompts.chat.check_bound`)."""
        if self.model is None:
            raise InvalidRequest("this engine has no local model to tokenize with", param=param)
        limit = self.prompt_limit()
        if limit:
            chat.check_bound(self.model, [text], limit, param)
        return self.model.tokenize(text)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailable("the engine is closed")

    # ---- state and controls ----

    def snapshot(self) -> list[BackendSnapshot]:
        return [b.snapshot() for b in self.backends.values()]

    @property
    def backend_names(self) -> list[str]:
        return list(self.backends)

    @property
    def devices(self) -> dict[str, str]:
        """Each backend's device ("cpu", "gpu", ...), by name."""
        return {name: b.device for name, b in self.backends.items()}

    def relays_logprobs(self) -> bool:
        """Whether every backend relays token log-probabilities (a request may go to any)."""
        return all(b.info().logprobs for b in self.backends.values())

    def health(self) -> dict[str, bool]:
        """Whether each backend serves, by name: its flag, cheaper than a snapshot."""
        return {name: bool(b.healthy) for name, b in self.backends.items()}

    def backend_snapshot(self, name: str) -> BackendSnapshot:
        return self.backend(name).snapshot()

    def info(self, name: str) -> BackendInfo:
        return self.backend(name).info()

    def rates(self, name: str) -> Rates:
        return self.backend(name).rates

    def cap(self, name: str) -> int:
        return self.backend(name).cap

    def set_cap(self, name: str, cap: int) -> None:
        """Change one backend's concurrency cap (running requests finish; the next step uses it).
        On an adaptive backend it is the ceiling, and the live limit starts there again."""
        self.backend(name).set_cap(cap)

    def set_cache_enabled(self, name: str, enabled: bool, timeout: float | None = None) -> Future:
        """Switch one backend's prefix cache on or off; wait `timeout` s for it (None: don't)."""
        fut = self.backend(name).set_cache_enabled(enabled)
        if timeout is not None:
            fut.result(timeout)
        return fut

    def kv_state_bytes(self, name: str) -> int:
        """llama.cpp's own state size of one backend's context (grows with the KV in use)."""
        return self.backend(name).kv_state_bytes()

    def backend(self, name: str) -> BackendProtocol:
        try:
            return self.backends[name]
        except KeyError:
            raise InvalidRequest(f"unknown backend {name!r} (have: {', '.join(self.backends)})",
                                 param="backend") from None

    def set_rates(self, name: str, rates: Rates) -> None:
        """Replace one backend's rates (calibration, online refresh, a typed override)."""
        self.backend(name).set_rates(rates)

    def warm(self, tokens, backend: str | None = None, timeout: float | None = None,
             wait: bool = True) -> list[RequestHandle]:
        """Prefill `tokens` into the prefix cache of one backend or all; with `wait`, until done."""
        targets = [self.backend(backend)] if backend else list(self.backends.values())
        handles = [b.warm(tokens) for b in targets]
        if not wait:
            return handles
        for h in handles:
            record = h.result(timeout)
            if record.error:
                raise InvalidRequest(f"warming {record.backend} failed: {record.error}")
        return handles

    def flush(self, backend: str | None = None, timeout: float | None = 30, wait: bool = True) -> list[Future]:
        """Drop the unpinned cached prefixes of one backend or all; with `wait`, until done."""
        targets = [self.backend(backend)] if backend else list(self.backends.values())
        futures = [b.flush() for b in targets]
        if wait:
            for f in futures:
                f.result(timeout)
        return futures

    def reset_stats(self, backend: str | None = None, timeout: float | None = 30) -> None:
        """Zero the counters of one backend or all (prefix-cache queries, hits and evictions,
        observed speeds, steps); what is cached, caps and rates stay. Waits up to `timeout` s."""
        targets = [self.backend(backend)] if backend else list(self.backends.values())
        futures = [b.reset_stats() for b in targets]
        for f in futures:
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
                if b.model is not None:
                    self._registry.release(b.model)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
