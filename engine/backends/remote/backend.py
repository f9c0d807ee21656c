"""An OpenAI-compatible engine elsewhere (llama-server, vLLM, SGLang, another Tandem) as a backend.

`RemoteBackend` implements `BackendProtocol` by streaming each request to the engine over HTTP
in its dialect (dialects.py): `/v1/completions` for text or token ids, `/v1/chat/completions`
for messages. Text deltas reach the request's handle as they arrive (a request whose caller does
not stream gets its text whole at the end); the engine's usage goes into its `FinishRecord`, else
what was counted here. At most `cap` requests are in flight there; the rest wait here, FCFS
(queue.py), so that they can move if the engine dies (failover.py). The router sees every request
of ours, exact and immediate, the engine's own load (monitor.py), a prediction of its prefix
cache (prediction.py) and rates refined online (online.py); `kv_cells_total=0` (unknown: the
router assumes room). The engine is untrusted: client.py bounds every call and every count, and
no exception escapes a request's finish (one that fails still ends the request, with an error).

Thread contract: one thread per backend runs an asyncio loop (loop.py) that owns the HTTP client
and every request's task; the protocol's methods may be called from any thread and hand work to
the loop; `on_unhealthy` is called on the loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import aiohttp

from engine.backends.protocol import BackendBase, BackendInfo, BackendProtocol, Calibrator, Found, done_future
from engine.backends.registry import BuildContext, backend_kind
from engine.core.errors import BackendUnavailable, ContextLengthExceeded, InvalidRequest, RestartInProgress
from engine.core.events import EventBus
from engine.core.handle import RequestHandle
from engine.core.request import Request, RequestStatus, SamplingParams
from engine.core.snapshot import BackendSnapshot, Rates

from .client import EngineClient, EngineFailed, EngineMisbehaved
from .config import RemoteConfig
from .failover import handed, triage
from .flight import Flights
from .job import Job
from .keys import VocabOnly
from .loop import LoopThread
from .monitor import Monitor, why
from .online import OnlineRates
from .prediction import CachePrediction
from .queue import JobQueue

log = logging.getLogger(__name__)

DEFAULT_RATES = Rates(prefill_tok_s=2000.0, decode_tok_s=50.0, source="default")
START_TIMEOUT_S = 10.0


class RemoteBackend(BackendBase):
    """An OpenAI-compatible engine behind a URL, served by its own asyncio thread."""

    device = "remote"

    def __init__(self, config: RemoteConfig, bus: EventBus | None = None, rates: Rates | None = None) -> None:
        self.config = config
        self.name = config.name
        self.url = config.url
        self.bus = bus or EventBus()
        self.healthy = False
        self.error: str | None = "not started"
        self.on_unhealthy = None  # set by the engine
        self.tokenizer = VocabOnly(config.tokenizer) if config.tokenizer else None
        self._queue = JobQueue(config.name, config.cap, config.max_queue)
        self._cache = CachePrediction(config.cache_capacity, self.tokenizer)
        self._online = OnlineRates(rates or DEFAULT_RATES)
        self._loop = LoopThread(config.name)
        self._monitor = Monitor(config, self._http, self)
        self._flights = Flights(self, self.bus, self._queue, self._cache, self._online, self._loop, self._monitor,
                                self._http)
        self._client: EngineClient | None = None
        self._stopped = False
        self._restarting = threading.Lock()

    @property
    def cap(self) -> int:
        return self._queue.cap

    @property
    def rates(self) -> Rates:
        return self._online.rates

    @property
    def models(self) -> list[str]:
        return self._monitor.models

    @property
    def n_vocab(self) -> int:
        return self._monitor.n_vocab

    @property
    def api(self) -> str:
        """The engine's dialect (`auto` until the first good probe names it)."""
        return self._monitor.dialect.name

    @property
    def cache_units(self) -> str:
        return self._cache.units

    # ---- lifecycle ----

    def start(self) -> RemoteBackend:
        """Start the loop and probe the engine once, up to `START_TIMEOUT_S`; an engine that does
        not answer yet starts unhealthy and is probed in when it does."""
        self._stopped = False
        self._loop.start(START_TIMEOUT_S)
        try:
            self._loop.submit(self._monitor.probe(first=True)).result(START_TIMEOUT_S + 1)
        except Exception as e:  # unreachable for now: the health loop keeps trying
            self.healthy, self.error = False, f"cannot reach {self.url}: {why(e)}"
        self._loop.submit(self._monitor.start())
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything (in-flight requests' connections are closed), stop the thread. Idempotent."""
        if not self._loop.started or self._stopped:
            return
        self._stopped = True
        try:
            self._loop.submit(self._shutdown()).result(timeout)
        except Exception:
            log.exception("%s: shutdown did not finish cleanly", self.name)
        self._loop.stop(timeout)
        if self.tokenizer is not None:
            self.tokenizer.close()

    def restart(self, timeout: float = 30.0) -> None:
        """Reconnect: queued requests are handed to `on_unhealthy` (moved), in-flight ones end
        with an error, the client and the cache prediction start afresh, the engine is probed."""
        if not self._restarting.acquire(blocking=False):
            raise RestartInProgress(f"backend {self.name} is already restarting")
        try:
            if not self._loop.started or self._stopped:
                raise BackendUnavailable(f"backend {self.name} is stopped")
            self._loop.submit(self._reconnect()).result(timeout)
        finally:
            self._restarting.release()

    # ---- requests (any thread) ----

    def validate(self, request: Request) -> None:
        """Raise if the engine can never serve `request`: logprobs (its stream's are not relayed),
        a token prompt longer than its context, what its dialect cannot take."""
        if request.sampling.logprobs is not None:
            raise InvalidRequest(f"backend {self.name} is a remote engine: logprobs are not relayed from it",
                                 param="logprobs")
        n, n_ctx = len(request.prompt_tokens), self._monitor.n_ctx
        if n and n_ctx and n >= n_ctx and not (request.text or request.messages):
            raise ContextLengthExceeded(n, n_ctx)
        self._monitor.dialect.check(self.name, request)

    def match(self, request: Request) -> int:
        """Predicted cached prompt tokens on the engine (prediction.py)."""
        return self._cache.match(request)

    def cached_prefix(self, request: Request) -> tuple[int, int]:
        """`match`; nothing resumed: the predicted tree does not know where the engine's requests end."""
        return self.match(request), 0

    def pin_prefix(self, request: Request) -> tuple[int, object]:
        """`(predicted cached tokens, None)`: nothing can be pinned on a remote engine."""
        return self._cache.counted(request), None

    def enqueue(self, request: Request, handle: RequestHandle | None = None, *, pin: object = None,
                cached_estimate: int | None = None, t_submit: float | None = None) -> RequestHandle:
        """Queue a request (FCFS); it is sent when fewer than `cap` of ours are in flight there."""
        self.validate(request)
        handle = handle or RequestHandle(request)
        if cached_estimate is None:
            cached_estimate = self.match(request)
        key, per_token = self._cache.key(request)
        job = Job(request, handle, t_submit or time.monotonic(), cached_estimate, key, max(len(key) // per_token, 1))
        handle.backend = self.name
        handle._cancel = self.cancel
        self._queue.push(job, lambda: None if self.serving() and self._loop.started else self.error or "stopped")
        self._monitor.sent(request.sampling.max_tokens)
        self._cache.sent(key, per_token)  # what is sent there is what its cache will hold (SGLang's rule)
        self._loop.wake(self._flights.pump)
        return handle

    def cancel(self, request_id: str) -> None:
        self._loop.wake(self._flights.cancel, request_id)

    def warm(self, tokens: Sequence[int]) -> RequestHandle:
        """Send `tokens` with one token to generate, so the engine caches them as a prefix."""
        return self.enqueue(Request(tuple(tokens), SamplingParams(max_tokens=1, temperature=0.0), source="warm"))

    # ---- controls ----

    def set_cap(self, cap: int | None, adaptive: bool | None = None) -> None:
        """How many requests may be in flight there (None: the spec's); more are sent at once if it
        grew. The engine's own limit is not Tandem's to adapt: `adaptive` is ignored."""
        self._queue.set_cap(cap if cap is not None else self.config.cap)
        self._loop.wake(self._flights.pump)

    def set_rates(self, rates: Rates) -> None:
        self._online.set(rates)

    def set_cache_enabled(self, enabled: bool) -> Future:
        """Use the cache prediction or not (the engine's own cache is its business)."""
        self._cache.set_enabled(enabled)
        return done_future()

    def flush(self) -> Future:
        """Forget the cache prediction (the engine's cache is not ours to flush)."""
        self._cache.clear()
        return done_future()

    def reset_stats(self) -> Future:
        """Zero the prediction's queries and hits, the observed speeds and the finished count."""
        self._cache.reset_counters()
        self._online.reset_observed()
        self._flights.finished = 0
        return done_future()

    def calibrate(self, how: Calibrator[Found]) -> Found:
        """Measured by the requests it answers (its steps are not visible here)."""
        return how.by_requests(self)

    # ---- state ----

    def snapshot(self) -> BackendSnapshot:
        running, waiting, cap = self._queue.view()
        items = (*(j.work_item(True) for j in running), *self._monitor.external(),
                 *(j.work_item(False) for j in waiting))
        return BackendSnapshot(
            name=self.name, device=self.device, cap=cap, n_ctx=self._monitor.n_ctx, rates=self.rates, items=items,
            healthy=self.healthy and not self._stopped, error=self.error, cache=self._cache.stats(),
            prefill_tok_s=self._online.prefill_tok_s, decode_tok_s=self._online.decode_tok_s,
            steps=self._flights.finished,  # requests finished: a remote engine's steps are not visible
            time=time.monotonic(), url=self.url, model=self.models[0] if self.models else "")

    def info(self) -> BackendInfo:
        return BackendInfo(name=self.name, device=self.device, model=self.models[0] if self.models else "",
                           threads=0, n_ctx=self._monitor.n_ctx, n_seq_max=self.cap, n_batch=0, flash_attn="",
                           kv_unified=True, kind="remote", url=self.url, rates_key=f"remote:{self.url}", logprobs=False)

    def describe(self) -> dict:
        """What the UI and `/v1/routing` can show beside the snapshot."""
        running, waiting = self._monitor.others()
        return {"url": self.url, "api": self.api, "models": list(self.models), "cache_units": self.cache_units,
                "external_running": running, "external_waiting": waiting}

    def in_flight(self) -> int:
        return self._queue.in_flight()

    def serving(self) -> bool:
        return self.healthy and not self._stopped

    # ---- the engine's health (loop thread) ----

    def came_up(self) -> None:
        self.healthy, self.error = True, None
        self._flights.pump()

    def went_down(self, why: str, failing: Job | None = None) -> None:
        """Mark unhealthy; hand every queued and in-flight request over (failover.py)."""
        if self.healthy:
            log.warning("%s: %s", self.name, why)
        self.healthy, self.error = False, why
        queued, inflight = self._queue.drain()
        callback = self.on_unhealthy
        live = [j for j in inflight if not j.done]
        moved = queued + triage(live, self.name, why, callback is not None)
        for job in live:
            if job is failing and job.fail and not job.moved:
                self._flights.finish(job, RequestStatus.FINISHED_ERROR, job.fail, "unavailable_error")
            elif job is not failing and job.task is not None:
                job.task.cancel()  # a moved one's task finishes nothing; a failing one ends with `fail`
        if callback is not None and moved:
            self._loop.flush()  # the text streamed so far reaches its caller before the rest
            try:
                callback(self, handed(moved))
                return
            except Exception:  # they could not be handed over: they end here, with the error
                log.exception("%s: handing %d requests over failed", self.name, len(moved))
        for job in moved:
            job.done = False
            self._flights.finish(job, RequestStatus.FINISHED_ERROR, f"backend {self.name} is unhealthy: {why}",
                                 "unavailable_error")

    # ---- the loop thread ----

    def _http(self) -> EngineClient:
        """The HTTP client, made when first needed (the key read then: `RemoteConfig.secret`)
        and dropped on restarting and stopping."""
        if self._client is None:
            if self._stopped:
                raise BackendUnavailable(f"backend {self.name} is stopped")
            c = self.config
            self._client = EngineClient(self.url, c.secret(), first_token_s=c.first_token_s,
                                        token_gap_s=c.token_gap_s, timeout_s=c.timeout_s)
        return self._client

    async def _reconnect(self) -> None:
        queued, _ = self._queue.drain(inflight=False)  # a healthy one drains first: its queue moves
        if queued and self.healthy and self.on_unhealthy is not None:
            self.healthy, self.error = False, "restarting"
            self.on_unhealthy(self, handed(queued))
        else:
            for j in queued:
                self._flights.finish(j, RequestStatus.FINISHED_ERROR, f"backend {self.name} restarted",
                                     "unavailable_error")
        self.healthy, self.error = False, "restarting"
        await self._cancel_inflight(f"backend {self.name} restarted")
        if self._client is not None:
            await self._client.close()
            self._client = None
        self._monitor.forget()  # a restart asked for by a person lets it back at once
        self._cache.clear()
        try:
            await self._monitor.probe(first=True)
        except (TimeoutError, aiohttp.ClientError, OSError, EngineFailed, EngineMisbehaved, InvalidRequest) as e:
            self.healthy, self.error = False, f"cannot reach {self.url}: {why(e)}"

    async def _cancel_inflight(self, why: str) -> None:
        tasks = []
        jobs, _, _ = self._queue.view()
        for j in jobs:
            j.fail = why
            if j.task is not None:
                j.task.cancel()
                tasks.append(j.task)
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    async def _shutdown(self) -> None:
        self._monitor.stop()
        queued, _ = self._queue.drain(inflight=False)
        for j in queued:
            self._flights.finish(j, RequestStatus.FINISHED_CANCELLED, f"backend {self.name} shut down")
        await self._cancel_inflight(f"backend {self.name} shut down")
        self._loop.flush()
        if self._client is not None:
            await self._client.close()
            self._client = None
        self.healthy, self.error = False, "stopped"


@backend_kind(RemoteConfig)
def build(c: RemoteConfig, ctx: BuildContext) -> BackendProtocol:
    """Started and probed once; an engine that does not answer yet starts unhealthy."""
    return RemoteBackend(c, ctx.bus, ctx.rates.get(c.name)).start()
