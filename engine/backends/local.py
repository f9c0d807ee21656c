"""One backend: a scheduler (engine/sched/scheduler.py) and a llama.cpp context (engine/llama/runner.py)
served by one worker thread.

The shell is llama.cpp server's loop (`server-queue.h`): other threads post typed messages
(`Enqueue`, `Cancel`, `SetCap`, `Call`, `Embed`, `Fault`, `Stop`) to ONE inbox; the worker takes
them all between steps, in order (the embeddings of every `Embed` taken together in as few
decodes as fit, on the worker's own embedding context, engine/llama/embedding.py), then runs a
step:
  1. the scheduler admits what fits and plans one batch (`Scheduler.schedule`);
  2. the runner applies the plan's KV ops, gives new sequences a sampler, decodes and samples
     (`ContextRunner.execute`; the previous step's text is made while the device runs);
  3. the scheduler applies the tokens and says what finished (`update_from_output`); the
     shell publishes their records and events, and hands text to the event loops once per
     step (`Outbox`).

A request with `n` choices comes as a group (`enqueue_group`): the choices, posted to the
inbox together so they stay next to each other in the queue; the first computes the prompt
and the scheduler holds the others back until it is published, then they alias its KV
(engine/sched/scheduler.py), so the prompt is computed once.

Thread contract: `enqueue`, `enqueue_group`, `warm`, `cancel`, `call`, `set_cache_enabled`, `flush`,
`inject_fault` only post to the inbox (its condition is the one lock they take); `set_cap`
sets the scheduler's cap (and its limiter's ceiling) under the state lock, then posts to wake
the worker; `snapshot`, `match`, `pin_prefix` and `validate` read under the state lock, which the worker
holds only while it plans or applies a step's results (never during a decode). `restart` is
serialised per backend: a second one while one runs raises `RestartInProgress`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

from engine.backends.config import (
    AUTO_CTX_MEMORY_SHARE,
    BackendConfig,
    auto_limits,
    auto_pool_cells,
    host_available_bytes,
)
from engine.backends.protocol import BackendBase, BackendInfo, Calibrator, CapState, Found
from engine.backends.registry import DEFAULT_RATES, BuildContext, backend_kind
from engine.core.errors import (
    BackendUnavailable,
    ContextLengthExceeded,
    EngineError,
    InvalidRequest,
    QueueFull,
    RestartInProgress,
)
from engine.core.events import EventBus, RequestAdmitted, RequestFinished, StepDone
from engine.core.handle import Outbox, RequestHandle
from engine.core.request import FinishRecord, Request, RequestStatus, SamplingParams, error_record
from engine.core.snapshot import BackendSnapshot, CacheStats, Rates
from engine.llama.embedding import Embeddings
from engine.llama.model import Model
from engine.llama.runner import ContextRunner, kv_bytes_per_cell, kv_cells_that_fit, process_rss
from engine.sched.limiter import ConcurrencyLimiter
from engine.sched.prefix_cache import PrefixCache
from engine.sched.scheduler import Finished, KvOp, Scheduler, SeqState

log = logging.getLogger(__name__)
PAUSED_POLL_S = 0.02  # how often a backend whose only work is paused sequences looks at their readers


def _reader_behind(s: SeqState) -> bool:
    """The scheduler's `paused` predicate: the request's asyncio reader is behind."""
    return s.handle is not None and s.handle.reader_behind


# ---- the inbox's messages ----


@dataclass(frozen=True, slots=True)
class Enqueue:
    seq: SeqState


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class SetCap:
    cap: int  # already applied by `Backend.set_cap`; the message wakes the worker


@dataclass(frozen=True, slots=True)
class Call:
    fn: Callable[[Backend], object]  # fn(backend) -> result, run on the worker between steps
    future: Future


@dataclass(frozen=True, slots=True)
class Embed:
    inputs: tuple[tuple[int, ...], ...]  # token ids per input; the future gets one vector each
    future: Future


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str  # "decode" | "crash"


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Message = Enqueue | Cancel | SetCap | Call | Embed | Fault | Stop


class Inbox:
    """The worker's one queue: any thread `put`s, the worker `take`s everything at once."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: collections.deque[Message] = collections.deque()
        self._in_transit = 0  # requests `take` handed the worker that are not yet in its queue (`landing`)
        self.closed = False

    def put(self, msg: Message) -> None:
        """Post a message (requests: `put_queued`); once closed, only a `Stop`."""
        with self._cond:
            if self.closed and not isinstance(msg, Stop):
                raise BackendUnavailable("the backend is stopped")
            self._items.append(msg)
            self._cond.notify()

    def put_queued(self, msgs: list[Enqueue], waiting: Callable[[], int], limit: int) -> int | None:
        """Post requests next to each other unless the queue would pass `limit`; None if posted,
        else how many are queued: those posted here, those taken and not yet in the scheduler's queue, and
        `waiting()`, that queue, all under the lock a request moves under (`landing`), so each
        is counted once; no other submitter posts between the count and the post."""
        with self._cond:
            if self.closed:
                raise BackendUnavailable("the backend is stopped")
            queued = sum(isinstance(m, Enqueue) for m in self._items) + self._in_transit + waiting()
            if queued + len(msgs) > limit:
                return queued
            self._items.extend(msgs)
            self._cond.notify()
            return None

    def take(self, wait: bool, timeout: float | None = None) -> list[Message]:
        if not wait and not self._items:  # the busy loop's common case: no lock
            return []
        with self._cond:
            if wait and not self._items:
                self._cond.wait(timeout)
            items = list(self._items)
            self._items.clear()
            self._in_transit += sum(isinstance(m, Enqueue) for m in items)
            return items

    @contextlib.contextmanager
    def landing(self) -> Iterator[None]:
        """Worker: a request `take` handed it goes into the scheduler's queue inside this block,
        which no `put_queued` count can split."""
        with self._cond:
            try:
                yield
            finally:
                self._in_transit -= 1

    def take_enqueued(self) -> list[SeqState]:
        """Take the posted requests out, leaving every other message in order."""
        with self._cond:
            seqs = [m.seq for m in self._items if isinstance(m, Enqueue)]
            self._items = collections.deque(m for m in self._items if not isinstance(m, Enqueue))
            return seqs

    def queued(self) -> list[SeqState]:
        """Requests posted and not yet taken by the worker (the snapshot shows them waiting)."""
        with self._cond:
            return [m.seq for m in self._items if isinstance(m, Enqueue)]

    def close(self) -> list[Message]:
        """Refuse new messages; return what was never taken."""
        with self._cond:
            self.closed = True
            items = list(self._items)
            self._items.clear()
            return items


class BackendFault(RuntimeError):
    """The backend cannot go on (device error, failed decode, injected fault)."""


class Backend(BackendBase):
    """A llama.cpp context with a continuous-batching scheduler in a worker thread.

    Health: a fatal decode error or a crash of the worker marks the backend unhealthy. Its
    queued requests (and running ones that asked for `retry` and have produced nothing) are
    handed to `on_unhealthy(backend, requests)` — the engine re-routes them — and the rest
    end with a clear error. `restart()` drains a healthy backend the same way (its queue moves
    to the other backends), builds a fresh context and serves again.
    """

    def __init__(self, config: BackendConfig, model: Model, bus: EventBus | None = None,
                 rates: Rates | None = None):
        self.config = config.resolved(model.device)
        if not config.n_ctx and not config.seq_ctx:  # a pool from the memory the device has
            kind = "cpu" if model.device == "cpu" else "gpu"
            fits = (kv_cells_that_fit(model, AUTO_CTX_MEMORY_SHARE) if kind == "gpu"
                    else int(host_available_bytes() * AUTO_CTX_MEMORY_SHARE) // kv_bytes_per_cell(model))
            self.config = replace(self.config, n_ctx=auto_pool_cells(kind, fits, max(config.contexts, 1)))
        self.name = self.config.name
        self.model = model
        self.device = model.device
        self.bus = bus or EventBus()
        self.rates = rates or Rates(prefill_tok_s=500.0, decode_tok_s=50.0, source="default")
        self._kind = "cpu" if model.device == "cpu" else "gpu"
        self._adaptive = self.config.adaptive
        self._set_limits(self.config.cap, config.auto_cap)
        self.healthy = True
        self.error: str | None = None  # why the backend is unhealthy
        self.on_unhealthy = None  # callable(backend, [(request, handle, t_submit)]), set by the engine
        self.step_log: collections.deque = collections.deque(maxlen=4096)  # (n_decode, n_prefill, seq ids)
        self.steps = 0
        self.prompt_tokens_computed = 0  # tokens decoded as prompt chunks (n choices share theirs)
        self.decode_s = 0.0  # time inside llama_decode (+ device sync), summed over steps
        self._obs_prefill = self._obs_decode = 0.0
        self._outbox = Outbox()  # the worker's deliveries to asyncio consumers (engine/core/handle.py)
        self._state = threading.RLock()  # the scheduler's queues, while planning or reading them
        self._restarting = threading.Lock()
        self._draining = False
        self._fault: str | None = None  # test hook: "decode" or "crash" at the next step
        self._thread: threading.Thread | None = None
        self._runner: ContextRunner | None = None
        self._embeddings = Embeddings(model, self.config.threads, self.config.threads_batch, self.name)
        self._open(PrefixCache(), self.config.cache)

    # ---- lifecycle ----

    def _open(self, cache: PrefixCache, cache_enabled: bool) -> None:
        c = self.config
        self._runner = ContextRunner(c, self.model, self.name)
        r = self._runner
        self.n_ctx, self.n_ctx_seq = r.n_ctx, r.n_ctx_seq
        busy = c.busy_chunk or (c.n_batch if self.model.device == "gpu" else max(c.n_batch // 8, 16))
        self._sched = Scheduler(
            cap=self._cap, n_ctx=r.n_ctx, n_ctx_seq=r.n_ctx_seq, n_seq_max=c.n_seq_max, n_batch=c.n_batch,
            kv_unified=c.kv_unified, cache_enabled=cache_enabled, idle_cache_cells=c.idle_cache_cells,
            busy_chunk=busy, queue_timeout_s=c.queue_timeout_s, name=self.name, piece=self.model.piece,
            is_eog=self.model.is_eog, preferred_ids=r.samplers.idle_ids, cache=cache,
            limiter=ConcurrencyLimiter(self._cap, initial=self._start, adaptive=self._adaptive),
            share_prefill=c.share_prefill, defer_shared=c.defer_shared, paused=_reader_behind)
        self._sched.overlap = c.overlap_text if c.overlap_text is not None else self.model.device == "gpu"
        self._inbox = Inbox()

    def start(self) -> Backend:
        self._thread = threading.Thread(target=self._run, name=f"backend-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything, stop the worker, free the context. Idempotent."""
        if not self._halt(timeout):
            log.error("%s: worker did not stop within %.1f s", self.name, timeout)

    def _halt(self, timeout: float) -> bool:
        """Stop the worker (it cancels what it holds) and free the context; False if it hung."""
        self._inbox.put(Stop())
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        else:  # never started: end what was posted
            self._shutdown()
        if self._runner is not None:
            self._runner.close()
        return True

    def restart(self, timeout: float = 30.0, drain_s: float = 10.0) -> None:
        """Throw the context away and serve again with a fresh one (and an empty cache).

        Serialised: a restart while one runs raises `RestartInProgress`. A healthy backend is
        drained first: its queued requests, and running ones that have produced nothing yet,
        are handed to `on_unhealthy` (the engine routes them elsewhere); running ones that
        produced text may finish for up to `drain_s` seconds, then end cancelled."""
        if not self._restarting.acquire(blocking=False):
            raise RestartInProgress(f"backend {self.name} is already restarting")
        try:
            self._draining = True  # the router sees it unhealthy; enqueue refuses
            deadline = time.monotonic() + min(drain_s, timeout)
            if self._thread is not None and self._thread.is_alive():
                try:
                    handed = self.call(lambda b: b._drain()).result(timeout)
                except Exception:  # stopped or hung: nothing to move, the halt below says
                    handed = []
                self._hand_over(handed, f"backend {self.name} is restarting")
                while self._sched.running and self.healthy and time.monotonic() < deadline:
                    time.sleep(0.01)  # the ones that produced text finish (bounded)
            if not self._halt(timeout):
                raise BackendUnavailable(f"backend {self.name}: the worker did not stop within {timeout} s")
            self._runner = None
            self._open(PrefixCache(), self._sched.cache_enabled)
            self.healthy, self.error, self._fault = True, None, None
            self.start()
        finally:
            self._draining = False
            self._restarting.release()

    # ---- any thread ----

    @property
    def cap(self) -> int:
        """The user's cap (with `cap_adaptive`, the ceiling of the limiter's live value)."""
        return self._cap

    def cap_state(self) -> CapState:
        """`auto`: no cap was given (or `set_cap(None)`): the ceiling is the device's, the start low."""
        return CapState(self._cap, self._auto, self._adaptive)

    def prompt_limit(self) -> int:
        """The context per sequence (`validate` refuses a prompt that fills it)."""
        return self.n_ctx_seq

    def calibrate(self, how: Calibrator[Found]) -> Found:
        """Measured by its own steps (`StepDone`), in this process."""
        return how.by_steps(self)

    @property
    def cache(self) -> PrefixCache:
        return self._sched.cache

    @property
    def cache_enabled(self) -> bool:
        return self._sched.cache_enabled

    @property
    def preemptions(self) -> int:
        return self._sched.preemptions

    def validate(self, request: Request) -> None:
        """Raise if this backend can never serve `request`: the prompt does not fit the
        context, holds a token id the model does not have (llama.cpp would fail the
        whole step, and every sequence in it), or its grammar does not parse."""
        tokens = request.prompt_tokens
        if len(tokens) >= self.n_ctx_seq:
            raise ContextLengthExceeded(len(tokens), self.n_ctx_seq)
        if tokens and (min(tokens) < 0 or max(tokens) >= self.model.n_vocab):
            bad = next(t for t in tokens if not 0 <= t < self.model.n_vocab)
            raise InvalidRequest(f"prompt token id {bad} is not in the model's vocabulary [0, {self.model.n_vocab})")
        bias = request.sampling.logit_bias
        if bias and bias[-1][0] >= self.model.n_vocab:  # sorted by id
            raise InvalidRequest(f"logit_bias token id {bias[-1][0]} is not in the model's vocabulary "
                                 f"[0, {self.model.n_vocab})", param="logit_bias")
        if request.sampling.grammar is not None:  # a grammar llama.cpp cannot parse would fail the worker
            self.model.check_grammar(request.sampling.grammar)

    def match(self, request: Request) -> int:
        """Longest usable cached prefix of the request's prompt (cheap, read-only; any thread).

        Capped at `len(tokens) - 1`: the last prompt token is always decoded for logits.
        """
        return self._sched.match_tokens(request.prompt_tokens)

    def cached_prefix(self, request: Request) -> tuple[int, int]:
        """`match`, and of it the own history of an earlier request that this one resumes."""
        return self._sched.match_resumed(request.prompt_tokens)

    def pin_prefix(self, request: Request) -> tuple[int, object]:
        """Match and pin the usable cached prefix of the prompt (any thread): `(length, pin)`.

        The pin keeps the prefix from eviction until the request is admitted (or cancelled),
        so the estimate the router used stays true. `pin` is None when nothing matched.
        """
        for _ in range(3):  # the worker may evict between the match and the pin: again
            try:
                return self._sched.pin_prefix(request.prompt_tokens)
            except ValueError:
                continue
        return 0, None

    def enqueue(self, request: Request, handle: RequestHandle | None = None, *, pin: object = None,
                cached_estimate: int | None = None, t_submit: float | None = None) -> RequestHandle:
        """Queue a request (FCFS). `pin` keeps the router's cache estimate valid until admission."""
        self.validate(request)
        handle = handle or RequestHandle(request)
        if cached_estimate is None:
            cached_estimate = self.match(request)
        seq = SeqState(request, handle, pin, cached_estimate, t_submit or time.monotonic(), n_ctx_seq=self.n_ctx_seq)
        self._submit(seq)
        return handle

    def enqueue_group(self, requests: list[Request], handles: list[RequestHandle], *, pin: object = None,
                      cached_estimate: int | None = None, t_submit: float | None = None) -> None:
        """Queue the choices of one request (same prompt) together: the first computes the
        prompt, the others alias its KV (engine/sched/scheduler.py). `pin` and `cached_estimate` are
        the first's; the others count on the whole prompt but its last token."""
        for r in requests:
            self.validate(r)
        t = t_submit or time.monotonic()
        estimate = self.match(requests[0]) if cached_estimate is None else cached_estimate
        self._submit(*(SeqState(r, h, None if i else pin, len(r.prompt_tokens) - 1 if i else estimate, t,
                                n_ctx_seq=self.n_ctx_seq, choice=True)
                       for i, (r, h) in enumerate(zip(requests, handles))))

    def warm(self, tokens: Sequence[int]) -> RequestHandle:
        """Prefill `tokens` into the prefix cache (no generation); the handle ends when done."""
        req = Request(tuple(tokens), SamplingParams(max_tokens=1, temperature=0.0), source="warm")
        self.validate(req)
        handle = RequestHandle(req)
        self._submit(SeqState(req, handle, None, self.match(req), time.monotonic(), warm=True))
        return handle

    def _submit(self, *seqs: SeqState) -> None:
        for seq in seqs:
            seq.handle.backend = self.name
            seq.handle._cancel = self.cancel
            seq.handle.logprobs = seq.logprobs  # the worker appends; the caller reads as it streams
            seq.handle.prompt_logprobs = seq.prompt_logprobs
        refused: EngineError | None = None
        if not self.serving:
            refused = BackendUnavailable(f"backend {self.name} is not serving")
        else:
            try:
                queued = self._inbox.put_queued([Enqueue(seq) for seq in seqs], lambda: len(self._sched.waiting),
                                                self.config.max_queue)
                if queued is not None:
                    refused = QueueFull(f"backend {self.name}'s queue is full ({queued} queued, at most "
                                        f"{self.config.max_queue}); retry later")
            except BackendUnavailable:
                refused = BackendUnavailable(f"backend {self.name} is not serving")
        if refused is not None:
            for seq in seqs:
                if seq.pin is not None:
                    with self._state:
                        self._sched.cache.unpin(seq.pin)
                    seq.pin = None
            raise refused

    embeds = True

    def embed(self, inputs: Sequence[Sequence[int]]) -> Future:
        """The pooled, normalised embedding of each input (token ids), in order: a Future of a
        list of float32 arrays, computed by the worker between two steps."""
        future: Future = Future()
        if not self.serving:
            raise BackendUnavailable(f"backend {self.name} is not serving")
        self._inbox.put(Embed(tuple(tuple(t) for t in inputs), future))
        return future

    @property
    def embedding_decodes(self) -> int:
        """Decodes its embedding context ran (requests taken together share them)."""
        return self._embeddings.decodes

    @property
    def serving(self) -> bool:
        return self.healthy and not self._draining and not self._inbox.closed

    def cancel(self, request_id: str) -> None:
        try:
            self._inbox.put(Cancel(request_id))
        except BackendUnavailable:
            pass  # stopped: everything it held has ended already

    def set_cap(self, cap: int | None, adaptive: bool | None = None, reason: str | None = None) -> None:
        """Change the concurrency cap; takes effect at the next step (running ones finish).
        Adaptive: `cap` is the new ceiling and the live limit starts there again; None is
        `auto` (the device's ceiling, starting low). `adaptive` switches adaptation on or off
        (None: as it is). `reason`: why the cap moved, where the user did not move it."""
        auto = cap is None
        if cap is None:
            cap = min(auto_limits(self._kind)[0], self.config.n_seq_max)
        self._set_limits(cap, auto)
        self._adaptive = True if auto else (self._adaptive if adaptive is None else adaptive)
        with self._state:  # at once: the next snapshot shows it (the worker plans under this lock)
            self._sched.set_cap(self._cap, self._adaptive, self._start, reason)
        self._inbox.put(SetCap(self._cap))  # wakes the worker: queued requests may fit now

    def _set_limits(self, cap: int, auto: bool) -> None:
        """The user's cap (the limiter's ceiling) and where the live limit starts: low for an
        `auto` cap, at the cap otherwise."""
        if not 1 <= cap <= self.config.n_seq_max:
            raise InvalidRequest(f"cap must be in [1, {self.config.n_seq_max}], got {cap}", param="cap")
        self._cap, self._auto = cap, auto
        self._start = min(auto_limits(self._kind)[1], cap) if auto else cap

    def set_rates(self, rates: Rates) -> None:
        self.rates = rates

    def reset_stats(self) -> Future:
        """Zero what the snapshot counts (prefix-cache queries, hits and evictions, observed
        speeds, steps, prompt tokens computed), on the worker between steps; what is cached
        and the cap stay. The engine calls it after calibration at load, so the measurement's
        requests never show as the user's."""
        def reset(b: Backend) -> None:
            with b._state:
                b._sched.cache.reset_counters()
                b.steps = b.prompt_tokens_computed = 0
                b.decode_s = 0.0
                b._obs_prefill = b._obs_decode = 0.0
        return self.call(reset)

    def call(self, fn: Callable[[Backend], object]) -> Future:
        """Run `fn(backend)` on the worker thread between steps; the future holds its result."""
        fut: Future = Future()
        try:
            self._inbox.put(Call(fn, fut))
        except BackendUnavailable:
            raise BackendUnavailable(f"backend {self.name} is stopped") from None
        return fut

    def set_cache_enabled(self, enabled: bool) -> Future:
        """Switch prefix reuse on or off while serving. Off: nothing new is cached or reused,
        and what is cached is dropped (prefixes still pinned go as their requests end)."""
        return self.call(lambda b: b._sched.set_cache_enabled(enabled))

    def flush(self) -> Future:
        """Drop every unpinned cached prefix and free its KV."""
        return self.call(lambda b: b._sched.flush_cache())

    @property
    def models(self) -> list[str]:
        """The model this backend serves, by its file's stem."""
        return [Path(self.model.path).stem]

    @property
    def n_vocab(self) -> int:
        return self.model.n_vocab

    @property
    def tokenizer(self) -> Model:
        return self.model

    def info(self) -> BackendInfo:
        c = self.config
        return BackendInfo(name=self.name, device=self.device, model=self.model.info.name, threads=c.threads,
                           n_ctx=self.n_ctx, n_seq_max=c.n_seq_max, n_batch=c.n_batch, flash_attn=c.flash_attn,
                           kv_unified=c.kv_unified, kind="local", rates_key=c.speed_key(self.model.device))

    def kv_state_bytes(self) -> int:
        """llama.cpp's own serialised-state size: grows with KV cells in use (tests use it)."""
        return self.call(lambda b: b._context().state_bytes()).result(30)

    def snapshot(self) -> BackendSnapshot:
        queued = self._inbox.queued()
        with self._state:
            sched = self._sched
            running = list(sched.running)
            waiting = list(sched.waiting) + queued
            used = sched.kv_cells_used(running)
            stats = sched.cache.stats()
            enabled = sched.cache_enabled
            limit = sched.cap
            reason = sched.limiter.reason if sched.limiter is not None else ""
        cell_bytes = self._runner.kv_cell_bytes if self._runner is not None else 0
        mem_free, mem_total = self.model.memory.read()
        return BackendSnapshot(
            name=self.name,
            device=self.model.device,
            cap=limit,
            cap_ceiling=self._cap,
            cap_adaptive=self._adaptive,
            cap_reason=reason,
            n_ctx=self.n_ctx,
            rates=self.rates,
            items=tuple(s.work_item(True) for s in running) + tuple(s.work_item(False) for s in waiting),
            healthy=self.healthy and not self._draining and not self._inbox.closed,
            error=self.error,
            threads=self.config.threads,
            kv_cells_used=used,
            kv_cells_total=self.n_ctx,
            kv_bytes=used * cell_bytes,
            kv_bytes_total=self.n_ctx * cell_bytes,
            model_bytes=self.model.info.size_bytes,
            device_memory_free_bytes=mem_free,
            device_memory_total_bytes=mem_total,
            device_name=self.model.info.device_name,
            group=self.config.group,
            process_rss_bytes=process_rss(),
            cache=CacheStats(
                enabled=enabled,
                query_tokens=stats.query_tokens,
                hit_tokens=stats.hit_tokens,
                cached_tokens=stats.cached_tokens,
                pinned_tokens=stats.pinned_tokens,
                evictions=stats.evictions,
                lost_tokens=stats.lost_tokens,
                recent_lost_share=stats.recent_lost_share,
            ),
            prefill_tok_s=self._obs_prefill,
            decode_tok_s=self._obs_decode,
            steps=self.steps,
            prompt_tokens_computed=self.prompt_tokens_computed,
            time=time.monotonic(),
        )

    def kv_cells_used(self) -> int:
        """Cells in use (see `Scheduler.kv_cells_used`)."""
        with self._state:
            return self._sched.kv_cells_used()

    @property
    def kv_bytes_total(self) -> int:
        return self.n_ctx * self._context().kv_cell_bytes

    @property
    def step_gaps(self) -> Sequence[float]:
        """Seconds of host work between consecutive steps, the last 8,192 (ContextRunner.gaps);
        read while the worker is idle."""
        r = self._runner
        return r.gaps if r is not None else ()

    @property
    def graphs_reused(self) -> int:
        """Decodes that reused the previous step's compute graph (llama.cpp's own count)."""
        r = self._runner
        return r.graphs_reused if r is not None else 0

    @property
    def eog_redos(self) -> int:
        """End tokens a guarding chain sampled and the backend took back."""
        return self._context().eog_redos

    @property
    def grammar_deferrals(self) -> int:
        """Grammar searches that ran past their share of a step and went on at the next
        (engine/llama/runner.py, `GRAMMAR_SHARE`)."""
        return self._context().grammar_deferrals

    @property
    def grammar_checks(self) -> int:
        """Candidate tokens grammar chains checked, counted as their requests end."""
        return self._context().samplers.grammar_checks

    @property
    def sampler_attaches(self) -> int:
        """Sampler chains handed to llama.cpp (each makes it re-reserve its graph once)."""
        return self._context().samplers.attaches

    @property
    def samplers_attached(self) -> int:
        """Sampler chains attached now, running sequences' and idle ones."""
        return self._context().samplers.attached

    def _context(self) -> ContextRunner:
        """The llama.cpp context; gone once the backend has shut down."""
        if self._runner is None:
            raise BackendUnavailable(f"backend {self.name} has shut down: its llama.cpp context is freed")
        return self._runner

    # ---- health ----

    def inject_fault(self, kind: str = "decode") -> None:
        """Test hook: make the next step fail like a device error (`decode`) or kill the
        worker thread with an exception (`crash`). Real llama.cpp state is untouched."""
        if kind not in ("decode", "crash"):
            raise InvalidRequest(f"unknown fault {kind!r}: decode or crash")
        self._inbox.put(Fault(kind))

    # ---- worker thread ----

    def _run(self) -> None:
        try:
            with self._outbox:  # text for asyncio consumers, handed over once per step
                self._loop()
        except Exception as e:  # a device failure or a bug: this backend stops, the process goes on
            log.exception("%s: worker failed", self.name)
            self._die(f"backend {self.name} failed: {e}")
        finally:
            self._shutdown()

    def _loop(self) -> None:
        """The inbox, then one step; until stopped."""
        sched, runner = self._sched, self._context()
        samplers = runner.samplers
        while True:
            idle = not sched.has_work() and not sched.pending_text and self._fault is None
            timeout = None
            if idle:
                due = samplers.expires_in(time.monotonic())  # idle chains to detach
                timeout = None if due is None else max(due, 0.0)
                if sched.n_paused or sched.parked:  # look again soon whether their readers caught up
                    timeout = PAUSED_POLL_S if timeout is None else min(timeout, PAUSED_POLL_S)
            msgs = self._inbox.take(idle and timeout != 0.0, timeout)
            if msgs and self._take(msgs):
                return
            if sched.running or sched.waiting:
                self._step()
            if sched.pending_text and not sched.running:
                sched.emit_pending()
            samplers.trim(sched.cap)
            self._outbox.flush()

    def _take(self, msgs: list[Message]) -> bool:
        """Apply the inbox's messages in order; True on `Stop`."""
        sched = self._sched
        cancelled: set[str] = set()
        embeds = [(m.inputs, m.future) for m in msgs if isinstance(m, Embed)]
        if embeds:
            self._embeddings.run(embeds)
        for m in msgs:
            if isinstance(m, Enqueue):
                with self._state, self._inbox.landing():
                    sched.add(m.seq)
            elif isinstance(m, Cancel):
                cancelled.add(m.request_id)
            elif isinstance(m, SetCap):
                sched.blocked = False  # the head of the queue may fit under the new cap
            elif isinstance(m, Call):
                try:  # not under the state lock: a call may take long (tests hold the worker)
                    m.future.set_result(m.fn(self))
                except Exception as e:
                    m.future.set_exception(e)
                self._context().apply(sched.take_ops())
            elif isinstance(m, Fault):
                self._fault = m.kind
            elif isinstance(m, Stop):
                return True
        if cancelled:
            with self._state:
                sched.cancel(cancelled)
            self._settle()
        return False

    def _settle(self, finished: Sequence[Finished] = ()) -> None:
        """Apply what the scheduler decided: finish records, then KV ops and released ids.

        The records go out first: the KV ops of finished sequences (each `seq_rm` / `seq_cp`
        scans every cell) only have to be done before the next step, and 128 sequences
        retiring at once took 59 ms of them (32,768 cells, 2-core dev machine) that every
        one of those requests waited for."""
        sched, runner = self._sched, self._context()
        ops: list[KvOp] = []
        unplaced: list[SeqState] = []
        if sched.has_effects():
            ops, unplaced = sched.take_ops(), sched.take_unplaced()
            finished = [*finished, *sched.take_finished()]
        for f in finished:
            self._publish(f)
        runner.apply(ops)
        for s in unplaced:
            runner.release(s)

    def _step(self) -> None:
        sched, runner = self._sched, self._context()
        with self._state:
            plan = sched.schedule()
        self._settle()
        if plan.admitted:
            runner.admit(plan.admitted, sched.cap, sched.lowest_free_ids)
            for s in plan.admitted:
                if s.status == RequestStatus.RUNNING:
                    self.bus.publish(RequestAdmitted(self.name, s.req.id, s.n_hit, s.t_admit))
        if plan.empty:
            return
        if self._fault is not None:
            self._inject()
        out = runner.execute(plan, self.config.kv_unified, self._during if sched.pending_text else None)
        if out.rc != 0:
            if out.rc != 1:
                raise BackendFault(f"llama_decode returned {out.rc}")
            log.warning("%s: no KV room for the batch (prefill budget %d)", self.name, sched.prefill_budget)
            with self._state:
                sched.decode_failed(plan)
            self._settle()
            return
        decoded = not plan.batch_empty  # else only grammar searches went on: no step to count or observe
        if decoded:
            self.steps += 1
            self.prompt_tokens_computed += out.n_prefill
            self.decode_s += out.seconds
            self._observe(out.n_decode, out.n_prefill, out.seconds)
        with self._state:
            finished = sched.update_from_output(plan, out.sampled, out.logprobs, seconds=out.seconds)
            for s in runner.dead_ends:  # their grammar allowed no token (engine/llama/sampling.py)
                if s.status == RequestStatus.RUNNING:
                    sched.fail(s, "the grammar allows no token of this model's vocabulary here; "
                                  "the reply cannot go on (no text satisfies the grammar or schema from here)",
                               "invalid_request_error")
            runner.dead_ends.clear()
        if decoded:
            rows = [s.ran_on for s in plan.decode]
            if plan.chunks:
                rows += [s.ran_on for s, _, _, lg in plan.chunks if lg]
            # The step's log entry and event go out before the finish records it caused: a caller
            # that waits for its requests (calibration's probe, tests) then sees the step.
            self.step_log.append((out.n_decode, out.n_prefill, tuple(rows)))
            self.bus.publish(StepDone(self.name, out.n_decode, out.n_prefill, len(sched.running), out.seconds,
                                      time.monotonic()))
        self._settle(finished)

    def _during(self) -> None:
        """While the device runs this step: the previous step's text, to the event loops."""
        self._sched.emit_pending()
        self._outbox.flush()

    def _publish(self, f: Finished) -> None:
        s = f.seq
        self._context().release(s)
        now = time.monotonic()
        record = FinishRecord(
            request_id=s.req.id,
            backend=self.name,
            status=f.status,
            text=s.stream.text,
            prompt_tokens=s.n_prompt,
            cached_tokens=s.n_shared,
            output_tokens=s.generated,
            queue_s=(s.t_admit or now) - s.t_submit,
            ttft_s=(s.t_first - s.t_submit) if s.generated else None,
            e2e_s=now - s.t_submit,
            itl_s=s.itl_sum / (s.generated - 1) if s.generated > 1 else None,
            error=f.error,
            cap_at_admit=s.admit_cap or None,
            cap_reason=s.admit_reason if s.admit_cap else None,
            error_kind=f.kind if f.error else None,
            logprobs=tuple(s.logprobs) if s.logprobs is not None else None,
            prompt_logprobs=tuple(s.prompt_logprobs) if s.prompt_logprobs is not None else None,
        )
        s.handle._deliver_finish(record)
        self.bus.publish(RequestFinished(record, now))

    def _inject(self) -> None:
        kind, self._fault = self._fault, None
        if kind == "decode":
            raise BackendFault("llama_decode returned -1 (injected fault)")
        raise RuntimeError("worker crashed (injected fault)")

    def _drain(self) -> list:
        """Worker thread: take the movable requests out (see `Scheduler.drain`); the rest run on
        until the halt cancels them."""
        with self._state:
            movable, _ = self._sched.drain(unstarted=True)
        self._settle()
        movable += self._inbox.take_enqueued()  # posted but not yet taken: they move too
        return [(s.req, s.handle, s.t_submit) for s in movable]

    def _hand_over(self, handed: list, why: str) -> None:
        callback = self.on_unhealthy
        if callback is not None and handed:
            callback(self, handed)
        else:
            for req, handle, t_submit in handed:
                handle._deliver_finish(error_record(req, self.name, why, t_submit))

    def _die(self, why: str) -> None:
        """Mark unhealthy; hand movable requests to `on_unhealthy`, fail the rest."""
        self.error = why  # first: a snapshot that reads unhealthy has the reason
        self.healthy = False
        with self._state:
            movable, rest = self._sched.drain()
            for s in rest:
                self._sched.fail(s, why)
        self._settle()
        for m in self._inbox.close():
            if isinstance(m, Enqueue):
                movable.append(m.seq)
            elif isinstance(m, (Call, Embed)):
                m.future.set_exception(BackendUnavailable(f"backend {self.name} is unhealthy"))
        self._hand_over([(s.req, s.handle, s.t_submit) for s in movable], why)

    def _shutdown(self) -> None:
        leftovers = self._inbox.close()
        with self._state:
            for m in leftovers:
                if isinstance(m, Enqueue):
                    self._sched.add(m.seq)
            self._sched.shutdown(RequestStatus.FINISHED_CANCELLED, f"backend {self.name} shut down")
        self._settle()
        for m in leftovers:
            if isinstance(m, (Call, Embed)):
                m.future.set_exception(BackendUnavailable(f"backend {self.name} is stopped"))
        self._embeddings.close()
        self._outbox.flush()

    def _observe(self, n_decode: int, n_prefill: int, dt: float) -> None:
        a = 0.2
        if n_prefill == 0 and n_decode:
            self._obs_decode = n_decode / dt if not self._obs_decode else (1 - a) * self._obs_decode + a * n_decode / dt
        elif n_prefill >= 32 and n_decode == 0:
            self._obs_prefill = n_prefill / dt if not self._obs_prefill else (1 - a) * self._obs_prefill + a * n_prefill / dt


@backend_kind(BackendConfig)
def build(c: BackendConfig, ctx: BuildContext) -> Backend:
    """A llama.cpp context in this process, on the model loaded once per device."""
    if ctx.model_path is None or ctx.registry is None:
        raise InvalidRequest(f"backend {c.name} runs llama.cpp in this process: it needs a model (--model)",
                             param="model")
    m: Model = ctx.registry.acquire(ctx.model_path, c.device, progress=ctx.progress)
    try:
        calibrated = ctx.calibrated
        r = (ctx.rates.get(c.name) or (calibrated.get(c, m.device) if calibrated is not None else None)
             or DEFAULT_RATES[m.device])
        return Backend(c, m, ctx.bus, r).start()
    except BaseException:
        ctx.registry.release(m)
        raise
