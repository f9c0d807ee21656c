"""One llama.cpp context on one device, served by its own worker thread.

The worker owns the context. Each step (llama.cpp server's `update_slots` order):
  1. apply cancellations; admit queued requests while running < cap and KV room remains
     (the cached prefix is aliased into the new sequence with `llama_memory_seq_cp`);
  2. build ONE batch: a decode token for every generating sequence, then prompt chunks of
     prefilling ones up to `n_batch` (chunked prefill, decode first);
  3. `llama_decode` (the GIL is released inside), sample each row that asked for logits;
  4. finish sequences (end-of-generation, stop string, `max_tokens`, context end, cancel):
     insert their tokens into the prefix cache, free what they held, publish the record.

Other threads talk to the backend only through `enqueue`, `cancel`, `set_cap`, `warm`,
`flush`, `call` and `snapshot`; each says which lock it takes. Nothing else is shared.
"""

from __future__ import annotations

import collections
import heapq
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from operator import attrgetter

from .batch import Batch
from .errors import BackendUnavailable, ContextLengthExceeded, InvalidRequest, QueueFull
from .events import EventBus, RequestAdmitted, RequestFinished, StepDone
from .handle import Outbox, RequestHandle
from .llama import lc
from .model import Model
from .prefix_cache import PrefixCache
from .request import FinishRecord, Request, RequestStatus, SamplingParams
from .sampling import Sampler, SamplerSlots
from .snapshot import BackendSnapshot, CacheStats, Rates, WorkItem
from .textstream import TextStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendConfig:
    """How to build a backend. `cap` is the concurrency cap (max running sequences)."""

    name: str = "cpu"
    device: str = "cpu"
    cap: int = 4
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    threads: int = 0  # 0: all cores
    threads_batch: int = 0  # 0: same as threads
    n_seq_max: int = 0  # 0: cap + 8, at least 32 (sequence slots: running + cache holders)
    kv_unified: bool = True
    flash_attn: str = "auto"  # auto | on | off
    cache: bool = True
    max_queue: int = 4096
    backend_sampling: bool = True  # sample inside the decode graph (logits stay on the device)
    fused_greedy: bool = True  # on the device, one argmax for all greedy sequences of a step
    queue_timeout_s: float = 0.0  # a request waiting longer ends with an error (0: no limit)
    idle_sampler_s: float = 2.0  # an idle sequence id's sampler chain is detached after this
    # Unified KV: while B sequences run, the prefix cache keeps at most idle_cache_cells / B
    # cells that none of them uses (every step attends over all cells in use). -1: n_ctx.
    idle_cache_cells: int = -1
    # Turn a step's tokens into text (pieces, deliveries) while the next step runs on the
    # device, for requests without stop strings. None: on for GPU backends, whose
    # llama_decode returns before the device is done; on the CPU nothing would overlap.
    overlap_text: bool | None = None

    def resolved(self) -> "BackendConfig":
        threads = self.threads or os.cpu_count() or 1
        # Fewer slots make each step cheaper (measured: GPU b32 +5 % at 33 slots vs 72).
        n_seq_max = self.n_seq_max or min(256, max(32, self.cap + 8))
        return replace(self, threads=threads, threads_batch=self.threads_batch or threads, n_seq_max=n_seq_max)


_FLASH = {"auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
          "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}


class _Seq:
    """A request inside the backend (worker-owned, except the fields the snapshot reads)."""

    __slots__ = ("req", "handle", "sp", "tokens", "n_prompt", "seq_id", "n_past", "n_shared",
                 "generated", "sampler", "stream", "pin", "lock", "estimate", "warm", "reserve",
                 "t_submit", "t_admit", "t_first", "t_last", "itl_sum", "row", "status", "error")

    def __init__(self, req: Request, handle: RequestHandle, pin, estimate: int, t_submit: float, warm=False):
        self.req = req
        self.handle = handle
        self.sp: SamplingParams = req.sampling
        self.tokens = list(req.prompt_tokens)
        self.n_prompt = len(self.tokens)
        self.seq_id = -1
        self.n_past = 0  # tokens whose KV is in the context
        self.n_shared = 0  # leading tokens aliased from the prefix cache
        self.generated = 0
        self.sampler: Sampler | None = None
        self.stream = TextStream(self.sp.stop)
        self.pin = pin  # routing-time pin on the cached prefix, released at admission
        self.lock = None  # pin held while running, so the aliased prefix is never evicted
        self.estimate = estimate  # cached tokens the router counted on
        self.warm = warm
        self.reserve = 0
        self.t_submit = t_submit
        self.t_admit = self.t_first = self.t_last = 0.0
        self.itl_sum = 0.0
        self.row = -1
        self.status = RequestStatus.WAITING
        self.error: str | None = None

    @property
    def prefilling(self) -> bool:
        return self.n_past < self.n_prompt

    def work_item(self, running: bool) -> WorkItem:
        cached = self.n_shared if running else self.estimate
        return WorkItem(
            request_id=self.req.id,
            running=running,
            prompt_tokens=self.n_prompt,
            cached_tokens=cached,
            prefill_left=max(self.n_prompt - max(self.n_past, cached), 0),
            decode_left=0 if self.warm else self.sp.max_tokens - self.generated,
            generated=self.generated,
        )


class BackendFault(RuntimeError):
    """The backend cannot go on (device error, failed decode, injected fault)."""


class Backend:
    """A llama.cpp context with a continuous-batching scheduler in a worker thread.

    Health: a fatal decode error or a crash of the worker marks the backend unhealthy. Its
    queued requests (and running ones that asked for `retry` and have produced nothing) are
    handed to `on_unhealthy(backend, requests)` — the engine re-routes them — and the rest
    end with a clear error. `restart()` builds a fresh context and serves again.
    """

    def __init__(self, config: BackendConfig, model: Model, bus: EventBus | None = None,
                 rates: Rates | None = None):
        self.config = config.resolved()
        self.name = self.config.name
        self.model = model
        self.device = model.device
        self.bus = bus or EventBus()
        self.rates = rates or Rates(prefill_tok_s=500.0, decode_tok_s=50.0, source="default")
        self.cache = PrefixCache()
        # Unified KV aliases a cached prefix's cells; split KV copies the holder's stream.
        # `set_cache_enabled` switches the cache live.
        self.cache_enabled = self.config.cache
        self.cap = self.config.cap
        if not 1 <= self.cap <= self.config.n_seq_max:
            raise InvalidRequest(f"cap must be in [1, {self.config.n_seq_max}], got {self.cap}")
        self.n_ctx = 0
        self.healthy = True
        self.step_log: collections.deque = collections.deque(maxlen=4096)  # (n_decode, n_prefill, seq ids)
        self.steps = 0
        self.decode_s = 0.0  # time inside llama_decode (+ device sync), summed over steps
        self.eog_redos = 0  # end tokens a guarding chain sampled and the backend took back
        self._outbox = Outbox()  # the worker's deliveries to asyncio consumers (engine/handle.py)
        self._obs_prefill = self._obs_decode = 0.0
        self._lock = threading.Condition()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []
        self._cancelled: set[str] = set()
        self._blocked = False  # the queue's head waits for KV room that only a finish frees
        self._calls: list[tuple] = []
        self._stop = False
        self._fault: str | None = None  # test hook: "decode" or "crash" at the next step
        self.error: str | None = None  # why the backend is unhealthy
        self.on_unhealthy = None  # callable(backend, [(request, handle, t_submit)]), set by the engine
        self._prefill_budget = self.config.n_batch  # halved after a "no KV room" decode
        self._next_timeout_check = 0.0
        self._thread: threading.Thread | None = None
        self._ctx = None
        self._open_context()

    # ---- lifecycle ----

    def _open_context(self) -> None:
        c = self.config
        p = lc.llama_context_default_params()
        train = self.model.n_ctx_train * (1 if c.kv_unified else c.n_seq_max)  # per sequence
        p.n_ctx = min(c.n_ctx, train) if train > 0 else c.n_ctx
        p.n_batch = c.n_batch
        p.n_ubatch = min(c.n_ubatch, c.n_batch)
        p.n_seq_max = c.n_seq_max
        p.n_threads = c.threads
        p.n_threads_batch = c.threads_batch
        p.kv_unified = c.kv_unified
        p.flash_attn_type = _FLASH[c.flash_attn]
        p.no_perf = True
        if self.model.device == "cpu":
            p.offload_kqv = False
            p.op_offload = False
        self._ctx = lc.llama_init_from_model(self.model.ptr, p)
        if not self._ctx:
            raise BackendUnavailable(f"{self.name}: llama.cpp could not create a context ({c})")
        self.n_ctx = lc.llama_n_ctx(self._ctx)  # cells, all sequences together
        # The most one sequence may hold: all cells (unified KV) or its own stream's (split).
        self.n_ctx_seq = lc.llama_n_ctx_seq(self._ctx)
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = Batch(max(c.n_batch, c.n_seq_max))
        # A min-heap: the lowest free id first, so running sequences stay on few, low ids
        # (split KV decodes consecutive ids in one ubatch; a gap starts another).
        self._free_ids = list(range(c.n_seq_max))
        self._kv_cell_bytes = _kv_bytes_per_cell(self.model)
        self._samplers = SamplerSlots(self.model.n_vocab, self.model.eog_tokens, c.backend_sampling,
                                      idle_s=c.idle_sampler_s, fused=c.fused_greedy)
        self._overlap = c.overlap_text if c.overlap_text is not None else self.model.device == "gpu"
        self._pending_text: list[tuple[_Seq, int]] = []  # tokens whose text waits for the next launch

    def start(self) -> "Backend":
        self._thread = threading.Thread(target=self._run, name=f"backend-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel everything, stop the worker, free the context. Idempotent."""
        if not self._halt(timeout):
            log.error("%s: worker did not stop within %.1f s", self.name, timeout)

    def _halt(self, timeout: float) -> bool:
        """Stop the worker (it cancels what it holds) and free the context; False if it hung."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None
            self._samplers.close()
        return True

    # ---- any thread ----

    def validate(self, request: Request) -> None:
        """Raise if this backend can never serve `request`: the prompt does not fit the
        context, or holds a token id the model does not have (llama.cpp would fail the
        whole step, and every sequence in it)."""
        tokens = request.prompt_tokens
        if len(tokens) >= self.n_ctx_seq:
            raise ContextLengthExceeded(len(tokens), self.n_ctx_seq)
        if tokens and (min(tokens) < 0 or max(tokens) >= self.model.n_vocab):
            bad = next(t for t in tokens if not 0 <= t < self.model.n_vocab)
            raise InvalidRequest(f"prompt token id {bad} is not in the model's vocabulary [0, {self.model.n_vocab})")

    def match(self, request: Request) -> int:
        """Longest usable cached prefix of the request's prompt (cheap, read-only; any thread).

        Capped at `len(tokens) - 1`: the last prompt token is always decoded for logits.
        """
        return self._match_tokens(request.prompt_tokens)

    def _match_tokens(self, tokens) -> int:
        if not self.cache_enabled:
            return 0
        return self.cache.match_length(tokens, max_len=len(tokens) - 1)

    def pin_prefix(self, request: Request) -> tuple[int, object]:
        """Match and pin the usable cached prefix of the prompt (any thread): `(length, pin)`.

        The pin keeps the prefix from eviction until the request is admitted (or cancelled),
        so the estimate the router used stays true. `pin` is None when nothing matched.
        """
        tokens = request.prompt_tokens
        for _ in range(3 if self.cache_enabled else 0):  # the worker may evict in between: again
            m = self.cache.match(tokens, max_len=len(tokens) - 1)
            if m.length == 0:
                return 0, None
            try:
                return m.length, self.cache.pin(m)
            except ValueError:
                continue
        return 0, None

    def enqueue(self, request: Request, handle: RequestHandle | None = None, *, pin=None,
                cached_estimate: int | None = None, t_submit: float | None = None) -> RequestHandle:
        """Queue a request (FCFS). `pin` keeps the router's cache estimate valid until admission."""
        self.validate(request)
        handle = handle or RequestHandle(request)
        if cached_estimate is None:
            cached_estimate = self.match(request)
        seq = _Seq(request, handle, pin, cached_estimate, t_submit or time.monotonic())
        self._submit(seq)
        return handle

    def warm(self, tokens) -> RequestHandle:
        """Prefill `tokens` into the prefix cache (no generation); the handle ends when done."""
        req = Request(tuple(tokens), SamplingParams(max_tokens=1, temperature=0.0), source="warm")
        self.validate(req)
        handle = RequestHandle(req)
        self._submit(_Seq(req, handle, None, self.match(req), time.monotonic(), warm=True))
        return handle

    def _submit(self, seq: _Seq) -> None:
        seq.handle.backend = self.name
        seq.handle._cancel = self.cancel
        with self._lock:
            if self._stop or not self.healthy:
                self._release_pin(seq)
                raise BackendUnavailable(f"backend {self.name} is not serving")
            if len(self._waiting) >= self.config.max_queue:
                self._release_pin(seq)
                raise QueueFull(f"backend {self.name} has {len(self._waiting)} requests waiting")
            self._waiting.append(seq)
            self._blocked = False
            self._lock.notify()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)
            self._lock.notify()

    def set_cap(self, cap: int) -> None:
        """Change the concurrency cap; takes effect at the next step (running ones finish)."""
        if not 1 <= cap <= self.config.n_seq_max:
            raise InvalidRequest(f"cap must be in [1, {self.config.n_seq_max}], got {cap}", param="cap")
        with self._lock:
            self.cap = cap
            self._blocked = False
            self._lock.notify()

    def set_rates(self, rates: Rates) -> None:
        self.rates = rates

    def call(self, fn) -> Future:
        """Run `fn(backend)` on the worker thread between steps; the future holds its result."""
        fut: Future = Future()
        with self._lock:
            if self._stop:
                raise BackendUnavailable(f"backend {self.name} is stopped")
            self._calls.append((fn, fut))
            self._blocked = False
            self._lock.notify()
        return fut

    def set_cache_enabled(self, enabled: bool) -> Future:
        """Switch prefix reuse on or off while serving. Off: nothing new is cached or reused,
        and what is cached is dropped (prefixes still pinned go as their requests end)."""

        def switch(b: "Backend") -> None:
            b.cache_enabled = enabled
            if not enabled:
                b._apply_evictions(b.cache.flush())

        return self.call(switch)

    def flush(self) -> Future:
        """Drop every unpinned cached prefix and free its KV."""
        return self.call(lambda b: b._apply_evictions(b.cache.flush()))

    def kv_state_bytes(self) -> int:
        """llama.cpp's own serialised-state size: grows with KV cells in use (tests use it)."""
        return self.call(lambda b: lc.llama_state_get_size(b._ctx)).result(30)

    def snapshot(self) -> BackendSnapshot:
        with self._lock:
            running = list(self._running)
            waiting = list(self._waiting)
            cap = self.cap
        stats = self.cache.stats()
        used = self.kv_cells_used(running)
        mem_free, mem_total = self.model.memory.read()
        return BackendSnapshot(
            name=self.name,
            device=self.model.device,
            cap=cap,
            n_ctx=self.n_ctx,
            rates=self.rates,
            items=tuple(s.work_item(True) for s in running) + tuple(s.work_item(False) for s in waiting),
            healthy=self.healthy and not self._stop,
            error=self.error,
            threads=self.config.threads,
            kv_cells_used=used,
            kv_cells_total=self.n_ctx,
            kv_bytes=used * self._kv_cell_bytes,
            kv_bytes_total=self.kv_bytes_total,
            model_bytes=self.model.info.size_bytes,
            device_memory_free_bytes=mem_free,
            device_memory_total_bytes=mem_total,
            device_name=self.model.info.device_name,
            process_rss_bytes=_process_rss(),
            cache=CacheStats(
                enabled=self.cache_enabled,
                query_tokens=stats.query_tokens,
                hit_tokens=stats.hit_tokens,
                cached_tokens=stats.cached_tokens,
                pinned_tokens=stats.pinned_tokens,
                evictions=stats.evictions,
            ),
            prefill_tok_s=self._obs_prefill,
            decode_tok_s=self._obs_decode,
            steps=self.steps,
            time=time.monotonic(),
        )

    def kv_cells_used(self, running=None) -> int:
        """Cells in use. Unified KV: cached tokens (shared ones once) plus each running
        sequence's own tail. Split KV: each holder's whole path plus each running sequence's
        whole context, its copied prefix included."""
        running = self._running if running is None else running
        if not self.config.kv_unified:
            return self.cache.held_tokens + sum(s.n_past for s in running)
        return self.cache.cached_tokens + sum(s.n_past - s.n_shared for s in running)

    @property
    def kv_bytes_total(self) -> int:
        return self.n_ctx * self._kv_cell_bytes

    @property
    def graphs_reused(self) -> int:
        """Decodes that reused the previous step's compute graph (llama.cpp's own count)."""
        return lc.llama_perf_context(self._ctx).n_reused if self._ctx else 0

    @property
    def sampler_attaches(self) -> int:
        """Sampler chains handed to llama.cpp (each makes it re-reserve its graph once)."""
        return self._samplers.attaches

    @property
    def samplers_attached(self) -> int:
        """Sampler chains attached now, running sequences' and idle ones."""
        return self._samplers.attached

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
        """Queued calls, cancellations, admissions, one step; until stopped."""
        while True:
            with self._lock:
                while not (self._stop or self._calls or self._cancelled or self._running
                           or (self._waiting and len(self._running) < self.cap and not self._blocked)):
                    due = self._samplers.expires_in(time.monotonic())  # idle chains to detach
                    if due is not None and due <= 0:
                        break
                    self._lock.wait(due)
                if self._stop:
                    break
                calls, self._calls = self._calls, []
            for fn, fut in calls:
                _run_call(fn, self, fut)
            with self._lock:
                cancelled, self._cancelled = self._cancelled, set()
            if cancelled:
                self._apply_cancel(cancelled)
            self._admit()
            if self._running:
                self._shed_idle_cache()
                self._step()
            if self._pending_text and not self._running:
                self._emit_pending()
            self._samplers.trim(self.cap)
            self._outbox.flush()

    def _apply_cancel(self, ids: set[str]) -> None:
        with self._lock:
            queued = [s for s in self._waiting if s.req.id in ids]
            for s in queued:
                self._waiting.remove(s)
        for s in queued:
            self._finish(s, RequestStatus.FINISHED_CANCELLED)
        for s in [s for s in self._running if s.req.id in ids]:
            self._finish(s, RequestStatus.FINISHED_CANCELLED)

    def _admit(self) -> None:
        if self.config.queue_timeout_s:
            self._expire_waiting()
        if self._blocked:
            return
        while True:
            with self._lock:
                if not self._waiting or len(self._running) >= self.cap:
                    return
                seq = self._waiting[0]
            try:
                placed = self._place(seq)
            except Exception as e:  # this request cannot start; the backend goes on
                log.exception("%s: could not admit %s", self.name, seq.req.id)
                self._fail_waiting_head(seq, f"could not start: {e}")
                continue
            if not placed:
                return
            with self._lock:
                self._waiting.popleft()
                self._running.append(seq)
            self.bus.publish(RequestAdmitted(self.name, seq.req.id, seq.n_shared, seq.t_admit))

    def _shed_idle_cache(self) -> None:
        """Unified KV: evict least recently used cached sequences that no running sequence
        uses until at most `idle_cache_cells / B` such cells remain. Each decode token attends
        over every cell in use, so an idle cached cell costs every running sequence at every
        step: a lone chat keeps its history, a batch of B keeps a B-th of it."""
        if not self.config.kv_unified or not self.cache_enabled:
            return
        budget = self.n_ctx if self.config.idle_cache_cells < 0 else self.config.idle_cache_cells
        excess = self.cache.evictable_tokens - budget // len(self._running)
        if excess > 0:
            self._apply_evictions(self.cache.evict(need_tokens=excess))

    def _place(self, seq: _Seq) -> bool:
        """Give `seq` a sequence id and its cached prefix, if KV room allows. Worker thread."""
        n_prompt = seq.n_prompt
        decode_room = 0 if seq.warm else min(seq.sp.max_tokens, self.n_ctx_seq - n_prompt)
        usable = n_prompt - (0 if seq.warm else 1) if self.cache_enabled else 0
        match = self.cache.match(seq.tokens, max_len=usable)
        lock = self.cache.pin(match) if match.length else None  # keeps it through evictions
        hit = match.length
        need = n_prompt - hit + decode_room
        if not self._make_room(need):
            if lock is not None:
                self.cache.unpin(lock)
            if not self._running:  # nothing will free cells: waiting would be forever
                self._fail_waiting_head(seq, f"needs {need} KV cells and the context has "
                                             f"{self.n_ctx - self.kv_cells_used()} free "
                                             f"({self.cache.pinned_tokens} held for queued requests)")
            else:
                self._blocked = True  # retry when a running request ends
            return False
        seq.seq_id = self._take_id(seq)
        if not seq.warm:
            attached = self._samplers.attaches
            seq.sampler = self._samplers.acquire(self._ctx, seq.seq_id, seq.sp)
            if self._samplers.on_device and self._samplers.attaches > attached:  # a reserve is due anyway
                room = self.cap - self._samplers.attached
                self._samplers.prepare(self._ctx, heapq.nsmallest(max(room, 0), self._free_ids), seq.sp)
        if hit:
            self._reuse_prefix(self.cache.holder_for(lock.node), seq.seq_id, hit)
        seq.lock = lock
        self._release_pin(seq)
        seq.n_past = seq.n_shared = hit
        seq.reserve = need
        self.cache.record_query(n_prompt, hit)
        seq.t_admit = time.monotonic()
        seq.status = RequestStatus.RUNNING
        return True

    def _take_id(self, seq: _Seq) -> int:
        """The lowest free seq id; with unified KV (where ids need not be consecutive) the
        lowest free one whose idle sampler chain the request can reuse, if any."""
        if self.config.kv_unified and not seq.warm:
            free = set(self._free_ids)
            ready = [i for i in self._samplers.idle_ids(seq.sp) if i in free]
            if ready:
                sid = min(ready)
                self._free_ids.remove(sid)
                heapq.heapify(self._free_ids)
                return sid
        return heapq.heappop(self._free_ids)

    def _reuse_prefix(self, holder: int, seq_id: int, n: int) -> None:
        """Give `seq_id` the KV of the holder's first `n` tokens."""
        if self.config.kv_unified:  # the same cells, aliased: no copy
            lc.llama_memory_seq_cp(self._mem, holder, seq_id, 0, n)
        else:  # another stream: llama.cpp copies the whole stream, then we drop its tail
            lc.llama_memory_seq_cp(self._mem, holder, seq_id, -1, -1)
            lc.llama_memory_seq_rm(self._mem, seq_id, n, -1)

    def _make_room(self, need_cells: int) -> bool:
        """Evict unpinned cached prefixes until `need_cells` cells and one seq id are free.

        Split KV gives every seq id its own stream, sized for one sequence, so there only
        the seq id counts."""
        if not self.config.kv_unified:
            need_cells = 0
        deficit = need_cells - (self.n_ctx - self.kv_cells_used() - self._reserved())
        if deficit > 0:
            self._apply_evictions(self.cache.evict(need_tokens=deficit))
            if need_cells > self.n_ctx - self.kv_cells_used() - self._reserved():
                return False
        if not self._free_ids:
            self._apply_evictions(self.cache.evict(need_seqs=1))
        return bool(self._free_ids)

    def _reserved(self) -> int:
        """Cells running sequences may still claim (their admitted reservation not yet used)."""
        return sum(max(s.reserve - (s.n_past - s.n_shared), 0) for s in self._running)

    def _step(self) -> None:
        batch = self._batch
        batch.clear()
        budget = self._prefill_budget
        decoding = [s for s in self._running if not s.prefilling]
        if not self.config.kv_unified:  # llama.cpp's split-KV ubatches take ids in rising order
            decoding.sort(key=attrgetter("seq_id"))
        for s in decoding:
            s.row = batch.add_one(s.tokens[s.n_past], s.seq_id, s.n_past)
        n_decode = batch.n
        chunks = []
        for s in self._running:
            room = budget - batch.n
            if room <= 0:
                break
            if s.prefilling:
                k = min(s.n_prompt - s.n_past, room)
                done = s.n_past + k == s.n_prompt
                s.row = batch.add(s.tokens[s.n_past:s.n_past + k], s.seq_id, s.n_past, done and not s.warm)
                chunks.append((s, k))
        if self._fault is not None:
            self._inject()
        t0 = time.perf_counter()
        rc = lc.llama_decode(self._ctx, batch.full())
        if self._pending_text:  # the previous step's text, while the device runs this one,
            self._emit_pending()
            self._outbox.flush()  # and to the event loops while this thread waits for the device
        if rc == 0:
            lc.llama_synchronize(self._ctx)  # so `dt` is the device's time, not a launch
        dt = time.perf_counter() - t0
        if rc != 0:
            self._decode_failed(rc, bool(chunks))
            return
        self._prefill_budget = self.config.n_batch
        self.steps += 1
        self.decode_s += dt
        n_prefill = batch.n - n_decode
        self._observe(n_decode, n_prefill, dt)
        now = time.monotonic()
        sampled = [s.seq_id for s in decoding]
        for s in decoding:
            s.n_past += 1
            self._sampled(s, now)
        for s, k in chunks:
            s.n_past += k
            if not s.prefilling:
                if s.warm:
                    self._finish(s, RequestStatus.FINISHED_STOPPED)
                else:
                    sampled.append(s.seq_id)
                    self._sampled(s, now)
        self.step_log.append((n_decode, n_prefill, tuple(sampled)))
        self.bus.publish(StepDone(self.name, n_decode, n_prefill, len(self._running), dt, now))

    def _sampled(self, s: _Seq, now: float) -> None:
        tok = s.sampler.sample(self._ctx, s.row)
        if s.sampler.guards_eog and self.model.is_eog(tok):
            self._pick_again(s)
            return
        s.tokens.append(tok)
        s.generated += 1
        if s.generated == 1:
            s.t_first = now
        else:
            s.itl_sum += now - s.t_last
        s.t_last = now
        if (self.model.is_eog(tok) and not s.sp.ignore_eos) or s.generated == s.req.stop_after:
            self._finish(s, RequestStatus.FINISHED_STOPPED)
            return
        if self._overlap and not s.sp.stop:  # no stop string can end it: its text can wait
            self._pending_text.append((s, tok))
        elif self._emit(s, tok):
            self._finish(s, RequestStatus.FINISHED_STOPPED)
            return
        if s.generated >= s.sp.max_tokens or s.n_past + 1 >= self.n_ctx_seq:
            self._finish(s, RequestStatus.FINISHED_LENGTH)

    def _emit(self, s: _Seq, tok: int) -> bool:
        """Push a token's text to the request's stream; True if a stop string ended it."""
        delta = s.stream.push(self.model.piece(tok))
        if delta:
            s.handle._deliver_text(delta)
        return s.stream.stopped

    def _emit_pending(self, only: _Seq | None = None) -> None:
        """Text for the tokens `_sampled` left pending (all, or `only`'s, before it ends)."""
        if only is None:
            pending, self._pending_text = self._pending_text, []
        else:
            pending = [p for p in self._pending_text if p[0] is only]
            self._pending_text = [p for p in self._pending_text if p[0] is not only]
        for s, tok in pending:
            if s.status == RequestStatus.RUNNING:
                self._emit(s, tok)

    def _pick_again(self, s: _Seq) -> None:
        """`s` ignores end tokens and its chain guarded one (engine/sampling.py): forget it,
        and decode the same input again next step, with a chain that bans end tokens."""
        s.sampler = self._samplers.ban_eog(self._ctx, s.seq_id, s.sp, s.tokens[s.n_prompt:])
        s.n_past -= 1
        lc.llama_memory_seq_rm(self._mem, s.seq_id, s.n_past, -1)
        self.eog_redos += 1

    def _finish(self, s: _Seq, status: RequestStatus, error: str | None = None) -> None:
        """End a sequence: stream the rest, keep or free its KV, publish its record."""
        if self._pending_text:
            self._emit_pending(only=s)
        if status == RequestStatus.FINISHED_LENGTH or (status == RequestStatus.FINISHED_STOPPED
                                                       and not s.stream.stopped):
            # Release what the stream held back (a partial stop string, a split character).
            rest = s.stream.flush()
            if rest:
                s.handle._deliver_text(rest)
        if s.sampler is not None:  # its chain stays with the sequence id, idle (SamplerSlots)
            self._samplers.release(s.seq_id)
            s.sampler = None
        cached = s.n_shared
        if s.seq_id >= 0:
            keep = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
            self._retire(s, keep)
        self._release_pin(s)
        with self._lock:
            if s in self._running:
                self._running.remove(s)
            self._blocked = False
        s.status = status
        now = time.monotonic()
        record = FinishRecord(
            request_id=s.req.id,
            backend=self.name,
            status=status,
            text=s.stream.text,
            prompt_tokens=s.n_prompt,
            cached_tokens=cached,
            output_tokens=s.generated,
            queue_s=(s.t_admit or now) - s.t_submit,
            ttft_s=(s.t_first - s.t_submit) if s.generated else None,
            e2e_s=now - s.t_submit,
            itl_s=s.itl_sum / (s.generated - 1) if s.generated > 1 else None,
            error=error,
            error_kind="server_error" if error else None,
        )
        s.handle._deliver_finish(record)
        self.bus.publish(RequestFinished(record, now))

    def _retire(self, s: _Seq, keep: bool) -> None:
        """Hand a finished sequence's KV to the prefix cache, or free it."""
        sid, s.seq_id = s.seq_id, -1
        if not keep or not self.cache_enabled:
            lc.llama_memory_seq_rm(self._mem, sid, -1, -1)
            heapq.heappush(self._free_ids, sid)
        else:
            in_kv = s.tokens[:s.n_past]
            match = self.cache.match(in_kv)
            if match.length < len(in_kv) and not any(i > sid for i in self._free_ids):
                # It will be kept, and `_park` needs a free id above: the least recently used
                # cached sequence makes way (else this one would stay on a chained id).
                self._apply_evictions(self.cache.evict(need_seqs=1))
                match = self.cache.match(in_kv)
            if match.length > s.n_shared and self.config.kv_unified:
                # The sequence computed its own copy of a prefix the cache already holds:
                # drop the copy and alias the cached cells, so shared cells exist once.
                lc.llama_memory_seq_rm(self._mem, sid, 0, match.length)
                lc.llama_memory_seq_cp(self._mem, self.cache.holder_for(match.node), sid, 0, match.length)
            if match.length < len(in_kv):  # it will be kept, on an id of its own
                sid = self._park(sid)
            result = self.cache.insert(in_kv, sid)
            self._apply_free(result.free_seqs)
        if s.lock is not None:
            self.cache.unpin(s.lock)
            s.lock = None
            if not self.cache_enabled:  # switched off while this ran: drop what it held
                self._apply_evictions(self.cache.flush())
        s.n_shared = s.n_past = 0

    def _park(self, sid: int) -> int:
        """Move a finished sequence's KV to the highest free id, which the cache then holds;
        returns that id. Running sequences keep the low ids, and with them the sampler chains
        attached there (SamplerSlots): a cache holder left on a chained id would send the next
        request to an id without one, and each attach costs a graph reserve. In split KV it
        also keeps the running ids consecutive (one ubatch per decode step). Unified KV: the
        cells gain and lose a sequence id, nothing moves; split KV: one stream is copied on
        the device."""
        top = max(self._free_ids, default=-1)
        if top < sid:
            return sid
        self._free_ids.remove(top)
        heapq.heapify(self._free_ids)
        lc.llama_memory_seq_cp(self._mem, sid, top, -1, -1)
        lc.llama_memory_seq_rm(self._mem, sid, -1, -1)
        heapq.heappush(self._free_ids, sid)
        return top

    def _apply_free(self, seq_ids) -> None:
        for sid in seq_ids:
            lc.llama_memory_seq_rm(self._mem, sid, -1, -1)
            heapq.heappush(self._free_ids, sid)

    def _apply_evictions(self, actions) -> None:
        for a in actions:
            if a.keep == 0:
                self._apply_free([a.seq_id])
            else:
                lc.llama_memory_seq_rm(self._mem, a.seq_id, a.keep, -1)

    def _release_pin(self, s: _Seq) -> None:
        if s.pin is not None:
            self.cache.unpin(s.pin)
            s.pin = None

    def _decode_failed(self, rc: int, had_prefill: bool) -> None:
        """llama.cpp server's answer: no KV room → smaller batch, then fail the youngest."""
        if rc != 1:
            raise BackendFault(f"llama_decode returned {rc}")
        if had_prefill and self._prefill_budget > 1:
            self._prefill_budget //= 2
            log.warning("%s: no KV room for the batch; prefill budget now %d", self.name, self._prefill_budget)
            return
        youngest = self._running[-1]
        log.warning("%s: no KV room even for one token per sequence; failing %s", self.name, youngest.req.id)
        self._finish(youngest, RequestStatus.FINISHED_ERROR,
                     f"backend {self.name}: the context ran out of KV cells for this request")

    # ---- health ----

    def inject_fault(self, kind: str = "decode") -> None:
        """Test hook: make the next step fail like a device error (`decode`) or kill the
        worker thread with an exception (`crash`). Real llama.cpp state is untouched."""
        if kind not in ("decode", "crash"):
            raise InvalidRequest(f"unknown fault {kind!r}: decode or crash")
        with self._lock:
            self._fault = kind
            self._lock.notify()

    def _inject(self) -> None:
        kind, self._fault = self._fault, None
        if kind == "decode":
            raise BackendFault("llama_decode returned -1 (injected fault)")
        raise RuntimeError("worker crashed (injected fault)")

    def _die(self, why: str) -> None:
        """Mark unhealthy; hand movable requests to `on_unhealthy`, fail the rest."""
        self.healthy = False
        self.error = why
        with self._lock:
            queued = list(self._waiting)
            self._waiting.clear()
            running = list(self._running)
        movable = [s for s in running if s.req.retry and s.generated == 0]
        for s in running:
            if s not in movable:
                self._finish(s, RequestStatus.FINISHED_ERROR, why)
        handed = []
        for s in queued + movable:
            self._drop_quietly(s)
            handed.append((s.req, s.handle, s.t_submit))
        callback = self.on_unhealthy
        if callback is not None and handed:
            callback(self, handed)
        else:
            for req, handle, t_submit in handed:
                handle._deliver_finish(error_record(req, self.name, why, t_submit))

    def _drop_quietly(self, s: _Seq) -> None:
        """Forget a sequence without finishing its handle (it moves to another backend)."""
        if s.sampler is not None:
            self._samplers.release(s.seq_id)
            s.sampler = None
        if s.seq_id >= 0:
            self._retire(s, keep=False)
        elif s.lock is not None:
            self.cache.unpin(s.lock)
            s.lock = None
        self._release_pin(s)
        with self._lock:
            if s in self._running:
                self._running.remove(s)

    def restart(self, timeout: float = 30.0) -> None:
        """Throw the context away and serve again with a fresh one (and an empty cache)."""
        if not self._halt(timeout):
            raise BackendUnavailable(f"backend {self.name}: the worker did not stop within {timeout} s")
        self.cache = PrefixCache()
        self._open_context()
        self.healthy, self.error, self._stop, self._fault, self._blocked = True, None, False, None, False
        self.start()

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        if now < self._next_timeout_check:
            return
        self._next_timeout_check = now + 0.05
        limit = self.config.queue_timeout_s
        with self._lock:
            expired = [s for s in self._waiting if now - s.t_submit > limit]
            for s in expired:
                self._waiting.remove(s)
        for s in expired:
            self._finish(s, RequestStatus.FINISHED_ERROR,
                         f"backend {self.name}: waited more than {limit:g} s in the queue")

    def _fail_waiting_head(self, seq: _Seq, why: str) -> None:
        with self._lock:
            self._waiting.remove(seq)
        self._finish(seq, RequestStatus.FINISHED_ERROR, f"backend {self.name}: {why}")

    def _shutdown(self) -> None:
        with self._lock:
            seqs = list(self._running) + list(self._waiting)
            self._waiting.clear()
            calls, self._calls = self._calls, []
        for s in seqs:
            self._finish(s, RequestStatus.FINISHED_CANCELLED, f"backend {self.name} shut down")
        for _, fut in calls:
            fut.set_exception(BackendUnavailable(f"backend {self.name} is stopped"))
        self._apply_free(self.cache.clear())

    def _observe(self, n_decode: int, n_prefill: int, dt: float) -> None:
        a = 0.2
        if n_prefill == 0 and n_decode:
            self._obs_decode = n_decode / dt if not self._obs_decode else (1 - a) * self._obs_decode + a * n_decode / dt
        elif n_prefill >= 32 and n_decode == 0:
            self._obs_prefill = n_prefill / dt if not self._obs_prefill else (1 - a) * self._obs_prefill + a * n_prefill / dt


def error_record(req: Request, backend: str, why: str, t_submit: float) -> FinishRecord:
    now = time.monotonic()
    return FinishRecord(request_id=req.id, backend=backend, status=RequestStatus.FINISHED_ERROR, text="",
                        prompt_tokens=len(req.prompt_tokens), cached_tokens=0, output_tokens=0,
                        queue_s=now - t_submit, ttft_s=None, e2e_s=now - t_submit, itl_s=None,
                        error=why, error_kind="unavailable_error")


def _run_call(fn, backend, fut: Future) -> None:
    try:
        fut.set_result(fn(backend))
    except Exception as e:
        fut.set_exception(e)


def _process_rss() -> int:
    """Resident set size of this process from /proc (0 where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _kv_bytes_per_cell(model: Model) -> int:
    """K and V of one token in every layer, f16."""
    n_head = lc.llama_model_n_head(model.ptr)
    n_head_kv = lc.llama_model_n_head_kv(model.ptr)
    head_dim = model.info.n_embd // max(n_head, 1)
    return model.info.n_layer * 2 * n_head_kv * head_dim * 2
