"""`Dispatcher`: the engine's routing of whole requests to backends, and back again.

Routing and enqueueing happen under one lock, so each request sees the queues its predecessors
made, and the chosen backend's matched prefix is pinned until the request is admitted (the
router's cache estimate cannot be evicted under it). A backend that goes unhealthy or restarts
hands its movable requests back (`rehome`), and they are routed again; one whose stream broke
after it began goes on from the text it streamed (`Request.continued`).

Thread contract: every method may be called from any thread; `route` and `embed` take the
dispatcher's lock, which `Engine.close` also takes to mark it closed."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from engine.backends.protocol import BackendProtocol, Handed
from engine.core.errors import BackendUnavailable, EngineError, InvalidRequest, QueueFull
from engine.core.events import EventBus, RequestRouted
from engine.core.handle import RequestHandle
from engine.core.request import Request, RequestStatus, error_record, next_request_id
from engine.routing import RouteQuery, Router, RoutingDecision

log = logging.getLogger(__name__)

Group = tuple[list[Request], list[RequestHandle]]


class Dispatcher:
    """Routes requests to backends under one lock, and re-routes what a backend gives back."""

    def __init__(self, backends: Mapping[str, BackendProtocol], router: Router, bus: EventBus,
                 model: Any) -> None:
        self.backends = backends
        self.router = router
        self.bus = bus
        self.model = model  # the local model (a continuation's tokenizer), or None
        self.lock = threading.Lock()
        self.closed = False

    def check_open(self) -> None:
        """Raise `BackendUnavailable` once the engine is closed."""
        if self.closed:
            raise BackendUnavailable("the engine is closed")
    def route(self, request: Request, handle: RequestHandle, t_submit: float, group: Group | None = None,
              moved_from: str | None = None, continued: int = 0) -> None:
        """Route `request` (or the `group` of its choices) to one backend and queue it there."""
        t_wait = time.perf_counter()
        with self.lock:
            t_in = time.perf_counter()
            self.check_open()
            serving = [b for b in self.backends.values() if serves(b, request.model)]
            if not serving:
                raise InvalidRequest(f"no backend serves the model {request.model!r} "
                                     f"(served: {', '.join(model_ids(self.backends))})", param="model")
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
        with self.lock:
            t_in = time.perf_counter()
            self.check_open()
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

    def rehome(self, failed: BackendProtocol, moved: Sequence[Handed]) -> None:
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
                    self.route(request, handle, t_submit, moved_from=failed.name)
                    continue
                n = part.output_tokens
                budget = min(request.sampling.max_tokens, request.stop_after or request.sampling.max_tokens)
                if n >= budget:  # it had made all it may: what it streamed is the answer
                    stopped = request.stop_after is not None and n >= request.stop_after
                    handle._deliver_finish(replace(
                        part, text="", prompt_tokens=0, cached_tokens=0, output_tokens=0, error=None, error_kind=None,
                        status=RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_LENGTH))
                    continue
                tokenize = continuation_tokenizer(self.model, failed)
                self.route(request.continued(part.text, n, tokenize), handle, t_submit, moved_from=failed.name,
                            continued=n)
            except EngineError as e:
                handle._deliver_finish(error_record(request, failed.name, f"{e} (after: {why})", t_submit))


def continuation_tokenizer(model: Any, failed: BackendProtocol) -> Callable[[str], list[int]] | None:
    """How to append streamed text to a token-id prompt: the local `model`'s tokenizer, else
    the failed remote backend's (`tokenizer=`), else none."""
    vocab = model if model is not None else failed.tokenizer
    if vocab is None:
        return None
    return lambda text: vocab.tokenize(text, add_special=False, parse_special=False)


def serves(backend: BackendProtocol, model: str | None) -> bool:
    """Whether `backend` can take a request that names `model` (None: any)."""
    if model is None:
        return True
    return model in backend.models or not backend.models  # not known yet: let it try


def model_ids(backends: Mapping[str, BackendProtocol]) -> list[str]:
    """The models `backends` serve: each one's models, in backend order, without repeats."""
    ids: list[str] = []
    for b in backends.values():
        for m in b.models:
            if m not in ids:
                ids.append(m)
    return ids
