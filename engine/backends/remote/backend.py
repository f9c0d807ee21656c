"""An OpenAI-compatible engine elsewhere (llama-server, vLLM, SGLang, another Tandem) as a backend.

`RemoteBackend` implements `BackendProtocol` (engine/backends/protocol.py) by streaming each request to
the engine over HTTP: `POST /v1/completions` (the request's `text`, else its token ids) or
`/v1/chat/completions` (its `messages`), `stream: true`, with the sampling values that API
accepts. Text deltas go to the request's handle as they arrive; the engine's `usage` (prompt,
cached and completion tokens) goes into the `FinishRecord`, else counted chunks do.

What the router sees (`snapshot()`):
- `items`: every request Tandem has in flight there (running) or queued here (waiting), exact
  and immediate — plus the engine's *external* load, requests others sent it, as items whose
  `request_id` starts with `external:` (running or waiting as the engine reports them, with
  `decode_left` the engine's own remaining budget where it tells — Tandem's `/v1/routing`,
  llama-server's `/slots` — else the mean `max_tokens` of our recent requests). The engine's
  load is polled every `poll_s` (llama-server `/slots` + `/metrics`, vLLM and SGLang
  `/metrics`, Tandem `/v1/routing`); external = what it reported minus what of ours it held
  *at that poll*, so our own changes since then are never counted twice or missed.
- `cache`: a prediction. What was sent there is kept in an approximate radix tree
  (`approx_cache.py` here, SGLang router's way); `match()` is the longest prefix of the new
  prompt in it. Keys are token ids when the request carries them, else text (characters),
  counted as `CHARS_PER_TOKEN` characters per token (`cache_units` says which; the snapshot's
  `cache` figures are in tokens either way). `query_tokens`/`hit_tokens` count the
  prediction at routing time (`pin_prefix`).
- `device="remote"`, `kv_cells_total=0` (unknown: the router assumes room), `rates` from
  calibration (`engine.rates.measure.calibrate_remote`) refined online from each finished request's
  TTFT and ITL (EWMA; `source="override"` rates are left alone).

Flow control: at most `cap` requests are in flight at the engine; the rest wait here, FCFS, so
that they can move elsewhere if the engine dies. `set_cap` applies at once.

The engine is untrusted: this module keeps the queue and failover, `client.py` bounds every
HTTP call (sizes, shapes, output, first-token and inter-token deadlines), `probe.py` reads
health and load, one dialect per engine kind.

Health: `/health` (else `/v1/models`) is probed every `health_s`. A connection error or 5xx on
a request or a probe marks the engine unhealthy, and so does a request that misses its
first-token or inter-token deadline: such an engine stays out for `quarantine_s` (doubling
while it keeps failing, up to `MAX_QUARANTINE_S`) even if its `/health` answers, since a
silent engine often still answers probes. A reply of the wrong shape or size fails that
request alone (`server_error`).
When an engine goes unhealthy, every queued and in-flight request goes to
`on_unhealthy(backend, [(request, handle, t_submit), ...])` (the engine re-routes them).
Queued ones, in-flight ones that had streamed nothing and in-flight ones whose caller does not
stream (`Request.stream` false: their text is handed over whole at the end, so a dropped
attempt was never seen) start again from the prompt. One that had streamed text to its caller
leaves that part on its handle (`RequestHandle._interrupt`: text, tokens, timings) and the
engine continues it on another engine from that text (`Request.continued`), so its caller
sees one stream:
- the resent prompt is the prompt followed by the text: a completion's `prompt` + text; a
  chat's messages + an assistant message of the text, continued in its turn
  (`continue_final_message` to Tandem, vLLM, SGLang; llama-server continues a final assistant
  message by itself unless run with `--no-prefill-assistant`; a generic OpenAI API cannot,
  so a fleet with one refuses the continuation and the stream ends with the error); token
  ids + the text tokenized (the local model's or `tokenizer=` vocabulary, else it cannot);
- `max_tokens` (and `stop_after`) less the tokens streamed, counted as the engine's chunks
  (llama-server sends one per token; Tandem's server joins the text that piled up while its
  loop was busy into one chunk, so the whole can then run a few tokens over `max_tokens`,
  while usage reports `max_tokens`);
- limits: the text is re-tokenized where it is appended, so the continuation's tokens may
  split differently from the ones generated; sampling is not bit-identical after the switch
  (another engine, another seed state); penalties see only the continuation's own output;
  a grammar-constrained answer cannot be continued (its grammar would start over) and ends
  with the error; usage sums both parts (each prompt as computed, the first part's output
  plus the second's);
- only when no healthy engine is left does the stream end with an `unavailable_error`.
The probe keeps running and brings the engine back when it answers again.

Thread contract: one thread per backend runs an asyncio loop that owns the HTTP session and
every request's task; callers' methods (`enqueue`, `cancel`, `set_cap`, `snapshot`, ...) may be
called from any thread: they take `_lock` for the queue and in-flight table, `_tree_lock` for
the cache prediction, and hand work to the loop with `call_soon_threadsafe`.
`on_unhealthy` is called on the backend's loop thread.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import cast

import aiohttp

from engine.backends.config import RemoteConfig
from engine.backends.protocol import BackendBase, BackendProtocol
from engine.backends.registry import BuildContext, backend_kind
from engine.core.errors import BackendUnavailable, ContextLengthExceeded, InvalidRequest, QueueFull, RestartInProgress
from engine.core.events import EventBus, RequestAdmitted, RequestFinished
from engine.core.handle import Outbox, RequestHandle
from engine.core.request import CHARS_PER_TOKEN, FinishRecord, Request, RequestStatus, SamplingParams
from engine.core.snapshot import BackendSnapshot, CacheStats, Rates, WorkItem

from . import probe
from .approx_cache import ApproxTree
from .client import EngineClient, EngineFailed, EngineMisbehaved, EngineRefused, EngineSilent
from .keys import VocabOnly, key_of, render_message
from .probe import Load

log = logging.getLogger(__name__)

DEFAULT_RATES = Rates(prefill_tok_s=2000.0, decode_tok_s=50.0, source="default")
DEFAULT_DECODE_BUDGET = 256  # external requests' decode_left before we have seen a request
MAX_QUARANTINE_S = 300.0
PROBE_FAILURES = 3  # probes that time out in a row before a live-but-silent engine is unhealthy
START_TIMEOUT_S = 10.0
ONLINE_WEIGHT = 0.2

# Sampling fields each API accepts beyond OpenAI's own (temperature, top_p, max_tokens, stop, seed).
_EXTRA = {
    "openai": (),
    "llama-server": ("top_k", "min_p", "repeat_penalty", "repeat_last_n", "ignore_eos"),
    "tandem": ("top_k", "min_p", "repeat_penalty", "repeat_last_n", "ignore_eos"),
    "vllm": ("top_k", "min_p", "repetition_penalty", "ignore_eos"),
    "sglang": ("top_k", "min_p", "repetition_penalty", "ignore_eos"),
}


class _Job:
    """A request inside the backend. Fields other than those the snapshot reads are loop-owned."""

    __slots__ = (
        "chunks",
        "done",
        "estimate",
        "fail",
        "finish_reason",
        "handle",
        "key",
        "moved",
        "parts",
        "prompt_estimate",
        "req",
        "t_first",
        "t_last",
        "t_sent",
        "t_submit",
        "task",
        "usage",
    )

    def __init__(self, req: Request, handle: RequestHandle, t_submit: float, estimate: int, key, prompt_estimate):
        self.req = req
        self.handle = handle
        self.t_submit = t_submit
        self.estimate = estimate  # predicted cached tokens (routing time)
        self.key = key  # the cache-prediction key of its prompt
        self.prompt_estimate = prompt_estimate  # prompt tokens (exact for token prompts)
        self.parts: list[str] = []
        self.chunks = 0
        self.t_sent = self.t_first = self.t_last = 0.0
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.task: asyncio.Task | None = None
        self.moved = False  # handed to another backend: finish nothing here
        self.fail: str | None = None  # end with this error when its task is cancelled
        self.done = False

    def work_item(self, running: bool) -> WorkItem:
        generated = self.output_tokens()
        prompt = self.prompt_tokens()
        return WorkItem(request_id=self.req.id, running=running, prompt_tokens=prompt,
                        cached_tokens=min(self.estimate, prompt),
                        prefill_left=0 if self.chunks else max(prompt - self.estimate, 0),
                        decode_left=max(self.req.sampling.max_tokens - generated, 0), generated=generated)

    def prompt_tokens(self) -> int:
        if self.usage and isinstance(self.usage.get("prompt_tokens"), int):
            return self.usage["prompt_tokens"]
        return self.prompt_estimate

    def output_tokens(self) -> int:
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"]
        return self.chunks


class RemoteBackend(BackendBase):
    """An OpenAI-compatible engine behind a URL, served by its own asyncio thread."""

    def __init__(self, config: RemoteConfig, bus: EventBus | None = None, rates: Rates | None = None):
        if not 1 <= config.cap <= 100_000:
            raise InvalidRequest(f"cap must be in [1, 100000], got {config.cap}", param="cap")
        self.config = config
        self.name = config.name
        self.device = "remote"
        self.url = config.url
        self.api = config.api  # resolved from "auto" at the first successful probe
        self.bus = bus or EventBus()
        self.rates = rates or DEFAULT_RATES
        self._base_rates = self.rates
        self._factor = 1.0  # observed / predicted step time, EWMA
        self._obs_prefill = self._obs_decode = 0.0
        self.healthy = False
        self.error: str | None = "not started"
        self.on_unhealthy = None  # callable(backend, [(request, handle, t_submit)]), set by the engine
        self.models: list[str] = []  # model ids the engine serves (`/v1/models`)
        self.n_ctx = 0  # the engine's context per request where it says, else 0
        self.n_vocab = 0  # the engine's vocabulary where it says, else 0 (token-id prompts check it)
        self.cache_enabled = True
        self.cache_units = "tokens"  # "tokens" or "chars/4": what the last key counted
        self._cap = config.cap
        self._lock = threading.Lock()
        self._waiting: collections.deque[_Job] = collections.deque()
        self._inflight: dict[str, _Job] = {}
        self._tree = ApproxTree(config.cache_capacity)
        self._tree_lock = threading.Lock()
        self.tokenizer = VocabOnly(config.tokenizer) if config.tokenizer else None
        self._keys: collections.OrderedDict[str, tuple] = collections.OrderedDict()  # request id -> key
        self._queries = self._hits = 0
        self._budget_mean = float(DEFAULT_DECODE_BUDGET)
        self._load = Load(0, 0, 0)
        self._probe_failures = 0
        self._quarantine_s = config.quarantine_s  # how long a silent engine stays out; doubles
        self._out_until = 0.0  # monotonic time before which probes do not bring it back
        self._stopped = False
        self._restarting = threading.Lock()
        self._outbox = Outbox()
        self._flush_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: EngineClient | None = None
        self._tasks: list[asyncio.Task] = []
        self.steps = 0  # requests finished (a remote engine's steps are not visible)

    @classmethod
    def from_config(cls, config: RemoteConfig, bus: EventBus | None = None,
                    rates: Rates | None = None) -> RemoteBackend:
        """Build and start one (it probes the engine once, up to `START_TIMEOUT_S`; an engine
        that does not answer yet starts unhealthy and is probed in when it does)."""
        return cls(config, bus, rates).start()

    @property
    def cap(self) -> int:
        return self._cap

    @property
    def model_name(self) -> str:
        return self.models[0] if self.models else ""

    # ---- lifecycle ----

    def start(self) -> RemoteBackend:
        ready = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run_loop, args=(ready,), name=f"remote-{self.name}",
                                        daemon=True)
        self._thread.start()
        ready.wait(START_TIMEOUT_S)
        try:
            self._submit_coro(self._connect()).result(START_TIMEOUT_S + 1)
        except Exception as e:  # unreachable for now: the health loop keeps trying
            self._set_unhealthy(f"cannot reach {self.url}: {e}")
        self._submit_coro(self._start_pollers())
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything (in-flight requests' connections are closed), stop the thread. Idempotent."""
        if self._loop is None or self._stopped:
            return
        self._stopped = True
        try:
            self._submit_coro(self._shutdown()).result(timeout)
        except Exception:
            log.exception("%s: shutdown did not finish cleanly", self.name)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.tokenizer is not None:
            self.tokenizer.close()

    def restart(self, timeout: float = 30.0) -> None:
        """Reconnect: queued requests are handed to `on_unhealthy` (moved), in-flight ones end
        with an error, the session and the cache prediction start afresh, the engine is probed.
        Serialised: raises `RestartInProgress` while one runs."""
        if not self._restarting.acquire(blocking=False):
            raise RestartInProgress(f"backend {self.name} is already restarting")
        try:
            if self._loop is None or self._stopped:
                raise BackendUnavailable(f"backend {self.name} is stopped")
            self._submit_coro(self._reconnect()).result(timeout)
        finally:
            self._restarting.release()

    # ---- requests (any thread) ----

    def validate(self, request: Request) -> None:
        """Raise if the engine can never serve `request`: a token prompt longer than its context,
        or logprobs (its stream's logprobs are not relayed), or a grammar its API has no field for."""
        if request.sampling.logprobs is not None:
            raise InvalidRequest(f"backend {self.name} is a remote engine: logprobs are not relayed from it",
                                 param="logprobs")
        n = len(request.prompt_tokens)
        if n and self.n_ctx and n >= self.n_ctx and not (request.text or request.messages):
            raise ContextLengthExceeded(n, self.n_ctx)
        if request.continue_final and self.api == "openai" and request.text is None:
            raise InvalidRequest(f"{self.name}: continuing the final assistant message needs a Tandem, "
                                 f"llama-server, vLLM or SGLang engine", param="messages")
        if request.sampling.grammar is not None and self.api not in ("llama-server", "tandem", "auto"):
            raise InvalidRequest(f"{self.name}: grammar-constrained requests (response_format, tools, grammar) "
                                 f"need a llama-server or Tandem engine, not {self.api}")

    def match(self, request: Request) -> int:
        """Predicted cached prompt tokens on the engine (see the module docstring)."""
        if not self.cache_enabled:
            return 0
        key, per_token = self._key(request)
        with self._tree_lock:
            n = self._tree.match(key)
        return self._tokens(n, per_token, request)

    def cached_prefix(self, request: Request) -> tuple[int, int]:
        """`match`; nothing resumed: the predicted tree does not know where the engine's requests end."""
        return self.match(request), 0

    def _key(self, request: Request):
        """`_key()`, remembered for the last requests (the router matches every backend)."""
        with self._tree_lock:
            hit = self._keys.get(request.id)
        if hit is not None:
            return hit
        made = key_of(request, self.tokenizer)
        with self._tree_lock:
            self._keys[request.id] = made
            while len(self._keys) > 256:
                self._keys.popitem(last=False)
        return made

    def pin_prefix(self, request: Request) -> tuple[int, object]:
        """`(predicted cached tokens, None)`: nothing can be pinned on a remote engine. Counted
        in the snapshot's cache stats (queries and predicted hits)."""
        n = self.match(request)
        prompt = self._prompt_estimate(request)
        with self._tree_lock:
            self._queries += prompt
            self._hits += n
        return n, None

    def enqueue(self, request: Request, handle: RequestHandle | None = None, *, pin=None,
                cached_estimate: int | None = None, t_submit: float | None = None) -> RequestHandle:
        """Queue a request (FCFS); it is sent when fewer than `cap` of ours are in flight there."""
        self.validate(request)
        handle = handle or RequestHandle(request)
        if cached_estimate is None:
            cached_estimate = self.match(request)
        key, per_token = self._key(request)
        job = _Job(request, handle, t_submit or time.monotonic(), cached_estimate, key, max(len(key) // per_token, 1))
        handle.backend = self.name
        handle._cancel = self.cancel
        with self._lock:
            if self._stopped or not self.healthy or self._loop is None:
                raise BackendUnavailable(f"backend {self.name} is not serving: {self.error or 'stopped'}")
            if len(self._waiting) >= self.config.max_queue:
                raise QueueFull(f"backend {self.name}'s queue is full ({len(self._waiting)} queued, "
                                f"at most {self.config.max_queue}); retry later")
            self._waiting.append(job)
        self._budget_mean += 0.05 * (request.sampling.max_tokens - self._budget_mean)
        if self.cache_enabled:
            with self._tree_lock:  # what is sent there is what its cache will hold (SGLang's rule)
                self._tree.insert(key)
            self.cache_units = "tokens" if per_token == 1 else f"chars/{per_token}"
        self._wake(self._pump)
        return handle

    def cancel(self, request_id: str) -> None:
        self._wake(self._cancel_now, request_id)

    def warm(self, tokens) -> RequestHandle:
        """Send `tokens` with one token to generate, so the engine caches them as a prefix."""
        req = Request(tuple(tokens), SamplingParams(max_tokens=1, temperature=0.0), source="warm")
        return self.enqueue(req)

    # ---- controls ----

    def set_cap(self, cap: int) -> None:
        """Change how many requests may be in flight there; more are sent at once if it grew."""
        if not 1 <= cap <= 100_000:
            raise InvalidRequest(f"cap must be in [1, 100000], got {cap}", param="cap")
        with self._lock:
            self._cap = cap
        self._wake(self._pump)

    def set_rates(self, rates: Rates) -> None:
        self.rates = self._base_rates = rates
        self._factor = 1.0

    def set_cache_enabled(self, enabled: bool) -> Future:
        """Use the cache prediction or not (the engine's own cache is its business)."""
        self.cache_enabled = enabled
        if not enabled:
            with self._tree_lock:
                self._tree.clear()
        return _done_future()

    def flush(self) -> Future:
        """Forget the cache prediction (the engine's cache is not ours to flush)."""
        with self._tree_lock:
            self._tree.clear()
        return _done_future()

    # ---- state ----

    def snapshot(self) -> BackendSnapshot:
        with self._lock:
            running = list(self._inflight.values())
            waiting = list(self._waiting)
            cap = self._cap
            load = self._load
        with self._tree_lock:
            size, evicted, queries, hits = self._tree.size, self._tree.evicted, self._queries, self._hits
        per = 1 if self.cache_units == "tokens" else CHARS_PER_TOKEN
        items = (tuple(j.work_item(True) for j in running) + self._external(load)
                 + tuple(j.work_item(False) for j in waiting))
        return BackendSnapshot(
            name=self.name,
            device="remote",
            cap=cap,
            n_ctx=self.n_ctx,
            rates=self.rates,
            items=items,
            healthy=self.healthy and not self._stopped,
            error=self.error,
            cache=CacheStats(enabled=self.cache_enabled, query_tokens=queries, hit_tokens=hits,
                             cached_tokens=size // per, evictions=evicted // per, units=self.cache_units),
            prefill_tok_s=self._obs_prefill,
            decode_tok_s=self._obs_decode,
            steps=self.steps,
            time=time.monotonic(),
            url=self.url,
            model=self.model_name,
        )

    def describe(self) -> dict:
        """What the UI and `/v1/routing` can show beside the snapshot."""
        load = self._load
        return {"url": self.url, "api": self.api, "models": list(self.models), "cache_units": self.cache_units,
                "external_running": max(load.running - load.ours, 0),
                "external_waiting": max(load.waiting - max(load.ours - load.running, 0), 0)}

    def _external(self, load: Load) -> tuple[WorkItem, ...]:
        """The engine's load that is not ours, as work items (see the module docstring)."""
        if not load.time or time.monotonic() - load.time > 5 * self.config.poll_s + 2:
            return ()  # too old to tell (the engine is not answering)
        ext_running = max(load.running - load.ours, 0)
        ext_waiting = max(load.waiting - max(load.ours - load.running, 0), 0)
        budgets = list(load.decode_left) or []
        items = []
        for i in range(ext_running + ext_waiting):
            left = budgets[i] if i < len(budgets) else int(self._budget_mean)
            items.append(WorkItem(request_id=f"external:{self.name}:{i}", running=i < ext_running,
                                  prompt_tokens=0, cached_tokens=0, prefill_left=0, decode_left=max(left, 0)))
        return tuple(items)

    def _tokens(self, n: int, per_token: int, request: Request) -> int:
        """Matched key elements → tokens, below the prompt's length (its last token is computed)."""
        return max(min(n // per_token, self._prompt_estimate(request) - 1), 0)

    def _prompt_estimate(self, request: Request) -> int:
        key, per = self._key(request)
        return max(len(key) // per, 1)

    # ---- the loop thread ----

    def _run_loop(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _submit_coro(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._running_loop())

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The backend's event loop (its own thread); None until that thread has started."""
        if self._loop is None:
            raise BackendUnavailable(f"backend {self.name}'s event loop has not started")
        return self._loop

    def _http(self) -> EngineClient:
        """The HTTP client, made on connecting and dropped on stopping."""
        if self._client is None:
            raise BackendUnavailable(f"backend {self.name} is not connected to {self.url}")
        return self._client

    def _wake(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # closed in between
                pass

    def _new_client(self) -> EngineClient:
        c = self.config
        return EngineClient(self.url, c.key, first_token_s=c.first_token_s, token_gap_s=c.token_gap_s,
                            timeout_s=c.timeout_s)

    async def _connect(self) -> None:
        if self._client is None:
            self._client = self._new_client()
        await self._probe(first=True)

    async def _start_pollers(self) -> None:
        self._tasks = [asyncio.create_task(self._health_loop()), asyncio.create_task(self._poll_loop())]

    async def _probe(self, first: bool = False) -> None:
        """One health probe; raises if the engine does not answer healthily. The first
        successful one resolves `api: auto` and reads the served models. An engine in
        quarantine (it timed out on a request) is probed but not brought back yet."""
        await probe.probe_health(self._http())
        if time.monotonic() < self._out_until:
            return
        if first or not self.healthy or not self.models:  # (back) up: what does it serve now
            if self.api == "auto":
                self.api = await probe.detect(self._http())
            models = await probe.read_models(self._http())
            if models is not None:
                self.models = models.ids
                self.n_ctx = models.n_ctx or self.n_ctx
                self.n_vocab = models.n_vocab or self.n_vocab
        self._probe_failures = 0
        if not self.healthy:
            self.healthy, self.error = True, None
            log.info("%s: %s is healthy (%s, serving %s)", self.name, self.url, self.api, ", ".join(self.models))
            self._pump()

    async def _answers_health(self) -> bool:
        """Whether the engine's health endpoint answers 200 now (a 5xx on one request from an
        engine that does is that request's failure: its queue stays and it stays healthy)."""
        return await probe.answers_health(self._http())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_s)
            try:
                await self._probe()
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                self._probe_failures += 1
                if self.healthy and self._probe_failures >= PROBE_FAILURES:
                    self._engine_failed(f"{self.url} did not answer {PROBE_FAILURES} health probes")
            except (aiohttp.ClientError, OSError, EngineFailed, EngineMisbehaved) as e:
                if self.healthy:
                    self._engine_failed(f"{self.url} is unreachable: {_why(e)}")
            except Exception:  # a bug must not end the probing
                log.exception("%s: health probe failed", self.name)

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_s)
            if not self.healthy:
                continue
            try:
                load = await self._poll()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the health probe decides about health; load is best effort
                log.debug("%s: load poll failed: %s", self.name, e)
                continue
            if load is not None:
                with self._lock:
                    self._load = replace(load, ours=len(self._inflight), time=time.monotonic())

    async def _poll(self) -> Load | None:
        """The engine's running and waiting requests, from its own endpoints (`probe.DIALECTS`)."""
        return await probe.DIALECTS.get(self.api, probe.Dialect()).load(self._http())

    # ---- requests on the loop ----

    def _pump(self) -> None:
        """Send queued requests while fewer than `cap` are in flight (loop thread)."""
        started = []
        with self._lock:
            while self._waiting and len(self._inflight) < self._cap and self.healthy and not self._stopped:
                job = self._waiting.popleft()
                self._inflight[job.req.id] = job
                started.append(job)
        for job in started:
            job.t_sent = time.monotonic()
            job.task = self._running_loop().create_task(self._run(job))
            self.bus.publish(RequestAdmitted(self.name, job.req.id, job.estimate, job.t_sent))

    def _cancel_now(self, request_id: str) -> None:
        with self._lock:
            queued = next((j for j in self._waiting if j.req.id == request_id), None)
            if queued is not None:
                self._waiting.remove(queued)
            running = self._inflight.get(request_id)
        if queued is not None:
            self._finish(queued, RequestStatus.FINISHED_CANCELLED)
        elif running is not None and running.task is not None:
            running.task.cancel()  # closes its connection: the engine sees the disconnect

    async def _run(self, job: _Job) -> None:
        try:
            await self._stream(job)
        except asyncio.CancelledError:
            if not job.moved:
                if job.fail:
                    self._finish(job, RequestStatus.FINISHED_ERROR, job.fail, "unavailable_error")
                else:
                    self._finish(job, RequestStatus.FINISHED_CANCELLED)
            return
        except EngineRefused as e:
            self._finish(job, RequestStatus.FINISHED_ERROR, f"{self.name} ({self.url}): {e}", e.kind)
        except EngineMisbehaved as e:  # this reply cannot be read: this request fails, not the engine
            log.warning("%s: request %s: %s", self.name, job.req.id, e)
            self._finish(job, RequestStatus.FINISHED_ERROR, f"backend {self.name} sent a reply this server will "
                                                            f"not relay: {e}", "server_error")
        except EngineSilent as e:  # unhealthy even if its /health answers: out for a while
            self._quarantine()
            self._engine_failed(f"{self.url} went silent: {e}", job)
        except (TimeoutError, aiohttp.ClientError, OSError, EngineFailed) as e:
            self._engine_failed(f"{self.url} failed: {_why(e)}", job)
        except Exception as e:  # a bug: this request fails, not the engine
            log.exception("%s: request %s failed", self.name, job.req.id)
            self._finish(job, RequestStatus.FINISHED_ERROR, f"backend {self.name}: {type(e).__name__}", "server_error")
        else:
            status = RequestStatus.FINISHED_LENGTH if job.finish_reason == "length" else RequestStatus.FINISHED_STOPPED
            if job.req.stop_after is not None and job.output_tokens() >= job.req.stop_after:
                status = RequestStatus.FINISHED_STOPPED
            self._finish(job, status)

    async def _stream(self, job: _Job) -> None:
        chat = job.req.messages is not None and job.req.text is None
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = self._body(job.req, chat)
        result = await self._http().stream(path, body, chat=chat, max_tokens=body["max_tokens"],
                                           on_delta=lambda d: self._deliver(job, d),
                                           answers_health=self._answers_health)
        job.usage = result.usage
        job.finish_reason = result.finish_reason
        if result.cut:  # the engine went on past the request's bound: what it is owed is what it got
            log.warning("%s: request %s cut at its output bound (%d tokens)", self.name, job.req.id,
                        body["max_tokens"])
            if job.usage is not None:
                job.usage = {**job.usage, "completion_tokens": min(job.chunks, body["max_tokens"])}

    def _quarantine(self) -> None:
        """Keep a silent engine out for `_quarantine_s` (doubling each time, up to the max)."""
        self._out_until = time.monotonic() + self._quarantine_s
        self._quarantine_s = min(self._quarantine_s * 2, MAX_QUARANTINE_S)

    def _body(self, req: Request, chat: bool) -> dict:
        sp = req.sampling
        body: dict = {"stream": True, "stream_options": {"include_usage": True},
                      "temperature": sp.temperature, "top_p": sp.top_p,
                      "max_tokens": min(sp.max_tokens, req.stop_after or sp.max_tokens)}
        if self.model_name:
            body["model"] = self.model_name
        if chat:
            if req.messages is None:
                raise InvalidRequest(f"request {req.id} has no messages to send as a chat")
            body["messages"] = list(req.messages)
            if req.continue_final and self.api != "llama-server":  # llama-server continues a final
                # assistant message by itself (its assistant prefill, on unless --no-prefill-assistant)
                body["continue_final_message"] = True
                if self.api == "vllm":  # which refuses it beside its default add_generation_prompt
                    body["add_generation_prompt"] = False
        else:
            body["prompt"] = req.text if req.text is not None else list(req.prompt_tokens)
        if sp.stop:
            body["stop"] = list(sp.stop)
        if sp.seed is not None:
            body["seed"] = sp.seed
        if sp.logit_bias:  # OpenAI's own fields: every API takes them
            body["logit_bias"] = {str(t): b for t, b in sp.logit_bias}
        if sp.presence_penalty:
            body["presence_penalty"] = sp.presence_penalty
        if sp.frequency_penalty:
            body["frequency_penalty"] = sp.frequency_penalty
        if sp.grammar is not None:  # `validate` let only engines that take `grammar` have it
            body["grammar"] = sp.grammar
        extra = _EXTRA.get(self.api, ())
        if "top_k" in extra and sp.top_k > 0:
            body["top_k"] = sp.top_k
        if "min_p" in extra:
            body["min_p"] = sp.min_p
        if "repeat_penalty" in extra:
            body["repeat_penalty"] = sp.repeat_penalty
            body["repeat_last_n"] = sp.repeat_last_n
        if "repetition_penalty" in extra:
            body["repetition_penalty"] = sp.repeat_penalty
        if "ignore_eos" in extra and sp.ignore_eos:
            body["ignore_eos"] = True
        if self.api == "llama-server":
            body["cache_prompt"] = True
        return body

    def _deliver(self, job: _Job, delta: str) -> None:
        """Stream a delta to the handle. Deliveries made in one loop iteration (all streams'
        data that arrived together) reach each consumer's loop in one hand-over (`Outbox`)."""
        now = time.monotonic()
        job.chunks += 1
        if job.chunks == 1:
            job.t_first = now
        job.t_last = now
        job.parts.append(delta)
        if job.req.stream:  # else the whole text goes at the end (`_finish`): an attempt may be dropped
            self._gather()
            job.handle._deliver_text(delta)

    def _gather(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            self._outbox.__enter__()  # this thread's deliveries go to the outbox until the flush
            self._running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        self._outbox.__exit__(None, None, None)

    def _finish(self, job: _Job, status: RequestStatus, error: str | None = None, error_kind: str | None = None) -> None:
        """End a request: its record to the handle and the bus, rates refined, next one sent."""
        if job.done:
            return
        job.done = True
        with self._lock:
            self._inflight.pop(job.req.id, None)
            in_flight = len(self._inflight)
            load = self._load
        now = time.monotonic()
        record = self._record(job, status, now, error, error_kind)
        text = record.text
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH) and self.cache_enabled:
            self._remember(job, text)
            self._observe(job, record, in_flight + 1 + max(load.running - load.ours, 0))
        self.steps += 1
        if self._loop is not None and threading.current_thread() is self._thread:
            self._gather()  # behind this request's text in the same hand-over
        if text and not job.req.stream:
            job.handle._deliver_text(text)
        job.handle._deliver_finish(record)
        self.bus.publish(RequestFinished(record, now))
        if not self._stopped:
            self._pump()

    def _record(self, job: _Job, status: RequestStatus, now: float, error: str | None = None,
                error_kind: str | None = None) -> FinishRecord:
        text = "".join(job.parts)
        output = job.output_tokens()
        usage = job.usage or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if not isinstance(cached, int):
            cached = job.estimate if job.chunks else 0  # no word from the engine: the prediction
        ttft = (job.t_first - job.t_submit) if job.chunks else None
        # Chunks can carry several tokens (a busy engine joins them): the gaps between the first
        # and last chunk over the tokens between them. One chunk says nothing about the gaps.
        itl = (job.t_last - job.t_first) / (output - 1) if job.chunks > 1 and output > 1 else None
        return FinishRecord(
            request_id=job.req.id, backend=self.name, status=status, text=text,
            prompt_tokens=job.prompt_tokens(), cached_tokens=cached, output_tokens=output,
            queue_s=(job.t_sent or now) - job.t_submit, ttft_s=ttft, e2e_s=now - job.t_submit, itl_s=itl,
            error=error, error_kind=error_kind if error else None)

    def _remember(self, job: _Job, text: str) -> None:
        """The engine caches prompt + output: so does the prediction (text keys only; a token
        prompt's output tokens are not known here)."""
        key = job.key
        if isinstance(key, str):
            key = key + (render_message({"role": "assistant", "content": text}) if job.req.messages
                         and job.req.text is None else text)
        elif self.tokenizer is not None and job.req.text is not None:
            key = key + tuple(self.tokenizer.tokenize(text, add_special=False))
        with self._tree_lock:
            self._tree.insert(key)

    def _observe(self, job: _Job, record: FinishRecord, batch: int) -> None:
        """Refine the rates from one finished request (EWMA): its ITL against the step time
        the rates predict at the batch it ran in; its prefill speed when it ran alone."""
        w = ONLINE_WEIGHT
        if record.itl_s:
            self._obs_decode = batch / record.itl_s if not self._obs_decode else \
                self._obs_decode + w * (batch / record.itl_s - self._obs_decode)
        new_prompt = record.prompt_tokens - record.cached_tokens
        if record.ttft_s and new_prompt >= 32 and batch == 1:
            observed = new_prompt / max(record.ttft_s - record.queue_s, 1e-6)
            self._obs_prefill = observed if not self._obs_prefill else \
                self._obs_prefill + w * (observed - self._obs_prefill)
        if self.rates.source == "override" or not record.itl_s:
            return
        predicted = self._base_rates.step_s(batch)
        if predicted > 0:
            self._factor += w * (record.itl_s / predicted - self._factor)
            b = self._base_rates
            alpha, beta, table = b.scaled(self._factor)
            self.rates = replace(b, prefill_tok_s=self._obs_prefill or b.prefill_tok_s,
                                 decode_tok_s=b.decode_tok_s / self._factor, step_alpha_s=alpha,
                                 step_beta_s=beta, step_table=table, source="online")

    # ---- failure ----

    def _set_unhealthy(self, why: str) -> None:
        self.healthy = False
        self.error = why

    def _engine_failed(self, why: str, failing: _Job | None = None) -> None:
        """Mark unhealthy (loop thread): hand every queued and in-flight request to
        `on_unhealthy`. Silent ones, and those whose caller reads nothing until the end
        (`Request.stream` false: what this engine made of them is dropped), start again from
        the prompt; one that streamed text to its caller leaves that part on its handle
        (`RequestHandle._interrupt`) and goes on from it elsewhere. Without `on_unhealthy`,
        those that streamed end with the error."""
        if self.healthy:
            log.warning("%s: %s", self.name, why)
        self._set_unhealthy(why)
        with self._lock:
            queued = list(self._waiting)
            self._waiting.clear()
            inflight = list(self._inflight.values())
            self._inflight.clear()
        callback = self.on_unhealthy
        handed = []
        now = time.monotonic()
        for job in inflight:
            if job.done:
                continue
            if job.chunks == 0 or not job.req.stream:
                job.moved = True
                job.done = True
                handed.append(job)
            elif callback is not None:  # it goes on elsewhere from what it streamed
                job.handle._interrupt(self._record(job, RequestStatus.FINISHED_ERROR, now,
                                                   f"backend {self.name} failed while streaming: {why}",
                                                   "unavailable_error"))
                job.moved = True
                job.done = True
                handed.append(job)
            else:
                job.fail = f"backend {self.name} failed while streaming: {why}"
            if job is failing:
                if job.fail:
                    self._finish(job, RequestStatus.FINISHED_ERROR, job.fail, "unavailable_error")
            elif job.task is not None:
                job.task.cancel()
        moved = [(j.req, j.handle, j.t_submit) for j in queued + handed]
        if not moved:
            return
        if callback is not None:
            if self._flush_pending:  # the text streamed so far reaches its caller before the rest
                self._flush()
            callback(self, moved)
        else:
            for j in queued + handed:
                j.done = False
                self._finish(j, RequestStatus.FINISHED_ERROR, f"backend {self.name} is unhealthy: {why}",
                             "unavailable_error")

    async def _reconnect(self) -> None:
        if self.healthy:  # drain first: queued requests move elsewhere
            with self._lock:
                queued = list(self._waiting)
                self._waiting.clear()
            if queued and self.on_unhealthy is not None:
                self._set_unhealthy("restarting")
                self.on_unhealthy(self, [(j.req, j.handle, j.t_submit) for j in queued])
            else:
                for j in queued:
                    self._finish(j, RequestStatus.FINISHED_ERROR, f"backend {self.name} restarted",
                                 "unavailable_error")
        self._set_unhealthy("restarting")
        await self._cancel_inflight(f"backend {self.name} restarted")
        if self._client is not None:
            await self._client.close()
        self._client = self._new_client()
        self._out_until = 0.0  # a restart asked for by a person lets it back at once
        self._quarantine_s = self.config.quarantine_s
        with self._tree_lock:
            self._tree.clear()
        with self._lock:
            self._load = Load(0, 0, 0)
        try:
            await self._probe(first=True)
        except (TimeoutError, aiohttp.ClientError, OSError, EngineFailed, EngineMisbehaved) as e:
            self._set_unhealthy(f"cannot reach {self.url}: {_why(e)}")

    async def _cancel_inflight(self, why: str) -> None:
        with self._lock:
            jobs = list(self._inflight.values())
        tasks = []
        for j in jobs:
            j.fail = why
            if j.task is not None:
                j.task.cancel()
                tasks.append(j.task)
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    async def _shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        with self._lock:
            queued = list(self._waiting)
            self._waiting.clear()
        for j in queued:
            self._finish(j, RequestStatus.FINISHED_CANCELLED, f"backend {self.name} shut down")
        await self._cancel_inflight(f"backend {self.name} shut down")
        if self._flush_pending:
            self._flush()
        if self._client is not None:
            await self._client.close()
            self._client = None
        self._set_unhealthy("stopped")


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _done_future() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


@backend_kind(RemoteConfig)
def build(c: RemoteConfig, ctx: BuildContext) -> BackendProtocol:
    """Started and probed once; an engine that does not answer yet starts unhealthy."""
    backend = RemoteBackend(c, ctx.bus, ctx.rates.get(c.name))
    backend.start()
    return cast("BackendProtocol", backend)  # its annotations (`on_unhealthy`, `set_cap`) predate the protocol's
