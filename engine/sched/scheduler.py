"""The continuous-batching scheduler of one backend: pure planning, no llama.cpp, no threads.

vLLM v1's split (`vllm/v1/core/sched/scheduler.py`): `schedule()` returns a `Plan` value,
the runner (engine/llama/runner.py) executes it on a llama.cpp context, and
`update_from_output(plan, output)` applies the sampled tokens and returns what finished.
Every effect on the KV cache (alias a cached prefix, free a sequence, park it on another id,
evict a cached prefix) is a `KvOp` the scheduler queues and the runner applies (`take_ops`),
in order, before it decodes. Time comes from an injected `clock`, text from an injected
`piece(token)`, so the same scheduler runs against simulated runners and in unit tests
(tests/test_scheduler.py, milliseconds, no model).

The rules, in the order each step applies them, and why: docs/design/sched.md.

Thread contract: none. The owner (engine/backends/local.py's worker) calls everything from one
thread; only the queues (`waiting`, `running`), `kv_cells_used` and the counters are read by
other threads, under the owner's lock."""

from __future__ import annotations

import collections
import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.request import RequestStatus, SamplingParams
from engine.sched.kv_layout import KvLayout, KvOp, kv_layout
from engine.sched.limiter import ConcurrencyLimiter
from engine.sched.prefix_cache import Pin, PrefixCache, TreeNode
from engine.sched.reuse import NULL_CACHE, RadixReuse, Reuse
from engine.sched.sequence import SeqState

__all__ = ["ADMIT_HEADROOM", "Finished", "KvOp", "Plan", "Scheduler", "SeqState", "default_seq_slots"]

# Cells a request needs free beyond its uncached prompt to be admitted: its first few decode
# tokens, so that a fresh admission is not preempted at once.
ADMIT_HEADROOM = 16
# A running prompt is published into the prefix cache (and a queued request deferred behind
# it) only for at least this many computed tokens: each publication holds a sequence id.
SHARE_MIN_TOKENS = 64
# Sequence slots beyond the cap: the prefix cache holds each cached prefix on its own id. On a
# GPU 64: with 8 spare, 16 tenants' prefixes beside 32 running requests evicted each other and
# were computed again, and 104 slots decode as fast as 40 (docs/performance.md, "Many tenants").
# On a CPU 8 (its smaller pool holds few prefixes).
SPARE_SLOTS = {"gpu": 64, "cpu": 8}


def default_seq_slots(cap: int, device: str) -> int:
    """llama.cpp sequence slots (`n_seq_max`) for a backend of `cap` on `device` ("cpu"/"gpu")."""
    return min(256, max(32, cap + SPARE_SLOTS["cpu" if device == "cpu" else "gpu"]))


# A row's token is not known yet: its grammar search goes on over the logits it has (the runner's
# answer for a constrained sequence whose search ran past its share of the step). The sequence
# keeps its KV and takes no row until the token comes: decoding its input again would cost a
# row every step for nothing (on a CPU, where each row costs about the same, as much as any
# other user).
SEARCHING = -2
# A sequence paused for its reader this long gives its place (and its KV) to the queue when
# another client waits for it, and is set aside until its reader catches up (`Scheduler.parked`):
# 640 sequences whose readers never read held every place until their connections timed out.
PAUSE_YIELD_S = 0.25


@dataclass(slots=True)
class Plan:
    """One step: decode rows first (`decode`), then prompt chunks (`chunks`: seq, start, k,
    logits). `admitted` are new this step (the runner gives them a sampler). `searching`
    take no row: their grammar searches go on over the logits they have (`SEARCHING`)."""

    decode: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    admitted: list = field(default_factory=list)
    searching: list = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.decode) + sum(k for _, _, k, _ in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.chunks and not self.searching

    @property
    def batch_empty(self) -> bool:
        """Nothing to decode: only searches go on (the runner calls no `llama_decode`)."""
        return not self.decode and not self.chunks


@dataclass(slots=True)
class Finished:
    seq: SeqState
    status: RequestStatus
    error: str | None = None
    kind: str = "server_error"  # the error's kind (`EngineError.kind`): who is to blame


class Scheduler:
    """Queues, admission, KV accounting, batch plans and finish rules of one backend."""

    def __init__(self, *, cap: int, n_ctx: int, n_ctx_seq: int, n_seq_max: int, n_batch: int,
                 kv_unified: bool = True, cache_enabled: bool = True, idle_cache_cells: int = -1,
                 busy_chunk: int | None = None, queue_timeout_s: float = 0.0, name: str = "backend",
                 piece: Callable[[int], bytes] = lambda t: b"", is_eog: Callable[[int], bool] = lambda t: False,
                 preferred_ids: Callable[[SamplingParams], list[int]] = lambda sp: [],
                 clock: Callable[[], float] = time.monotonic, cache: PrefixCache | None = None,
                 limiter: ConcurrencyLimiter | None = None, share_prefill: bool = True,
                 defer_shared: bool = True, paused: Callable[[SeqState], bool] | None = None):
        self.name = name
        # The live cap; with a `limiter` (engine/sched/limiter.py) it follows the measured steps.
        self.limiter = limiter
        self.cap = limiter.limit if limiter is not None else cap
        self.n_ctx = n_ctx
        self.n_ctx_seq = n_ctx_seq
        self.n_seq_max = n_seq_max
        self.n_batch = n_batch
        self.kv: KvLayout = kv_layout(kv_unified, n_ctx)  # unified or split (engine/sched/kv_layout.py)
        self.cache = cache or PrefixCache()
        # The cache switch (engine/sched/reuse.py): on, with its sharing switches, or the null cache.
        self._cache_on = RadixReuse(share_prefill, defer_shared)
        self.reuse: Reuse = self._cache_on if cache_enabled else NULL_CACHE
        self.idle_cache_cells = idle_cache_cells
        self.busy_chunk = max(1, busy_chunk or n_batch)
        self.queue_timeout_s = queue_timeout_s
        self.piece = piece
        self.is_eog = is_eog
        self.preferred_ids = preferred_ids
        self.clock = clock
        self.waiting: collections.deque[SeqState] = collections.deque()
        self.running: list[SeqState] = []
        # A min-heap: the lowest free id first, so running sequences stay on few, low ids
        # (split KV decodes consecutive ids in one ubatch; a gap starts another).
        self.free_ids = list(range(n_seq_max))
        self.prefill_budget = n_batch  # halved after a "no KV room" decode
        self.blocked = False  # the queue's head waits for KV room that only a finish frees
        self.preemptions = 0
        self.unrelated_sheds = 0  # idle caches cleared for unrelated work (`_shed_unrelated`)
        self._ops: list[KvOp] = []
        self._finished: list[Finished] = []
        self._unplaced: list[SeqState] = []  # left the running set unfinished (preempted, drained)
        self._next_timeout_check = 0.0
        self.overlap = False  # text of requests without stop strings waits for `emit_pending`
        self.pending_text: list[tuple[SeqState, int]] = []
        # A decoding sequence for which `paused` holds (its reader is behind) takes no row and
        # keeps its KV until it does not; `n_paused` counts them at the last `schedule`.
        self.paused = paused
        self.n_paused = 0
        self.parked: list[SeqState] = []  # paused sequences set aside, their KV freed (`_set_aside`)

    @property
    def kv_unified(self) -> bool:
        return self.kv.unified

    @property
    def cache_enabled(self) -> bool:
        return self.reuse.enabled

    # ---- what the owner calls ----

    def add(self, seq: SeqState, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(seq)
        self.blocked = False

    def set_cap(self, cap: int, adaptive: bool | None = None, start: int | None = None,
                reason: str | None = None) -> None:
        """A user's cap: with a limiter, its ceiling (the limit starts at `start`, else there)."""
        if self.limiter is not None:
            self.limiter.set_ceiling(cap, adaptive, start, reason)
            cap = self.limiter.limit
        self.cap = cap
        self.blocked = False

    def has_effects(self) -> bool:
        """KV ops, unplaced or finished sequences wait to be taken."""
        return bool(self._ops or self._unplaced or self._finished)

    def take_ops(self) -> list[KvOp]:
        ops, self._ops = self._ops, []
        return ops

    def take_finished(self) -> list[Finished]:
        done, self._finished = self._finished, []
        return done

    def take_unplaced(self) -> list[SeqState]:
        """Sequences that left the running set without finishing (their samplers go)."""
        out, self._unplaced = self._unplaced, []
        return out

    def cancel(self, ids) -> None:
        """Cancel queued or running requests by id (finished ones are ignored)."""
        for s in [s for s in self.waiting if s.req.id in ids]:
            self.waiting.remove(s)
            self._finish(s, RequestStatus.FINISHED_CANCELLED)
        for s in [s for s in self.running if s.req.id in ids]:
            self._finish(s, RequestStatus.FINISHED_CANCELLED)
        for s in [s for s in self.parked if s.req.id in ids]:
            self.parked.remove(s)
            self._finish(s, RequestStatus.FINISHED_CANCELLED)

    def has_work(self) -> bool:
        """Something to plan: a running sequence that is not paused, or an admission."""
        return len(self.running) > self.n_paused or (bool(self.waiting) and len(self.running) < self.cap
                                                      and not self.blocked)

    def schedule(self) -> Plan:
        """Admit what fits, then plan one step. KV ops to apply first are in `take_ops()`;
        requests that ended while planning (timeouts, no room) in `take_finished()`."""
        plan = Plan()
        if self.queue_timeout_s:
            self._expire_waiting()
        self._queue_turns()
        if self.waiting and not self.blocked:
            self._admit(plan)
        if not self.running:
            return plan
        self._shed_idle_cache()
        # One pass over the running set per step: decode rows, prefills, and the cells the
        # running sequences own (`SeqState.prefilling` and `kv_cells_used`, inlined).
        decoding, prefilling = [], []
        own, paused, self.n_paused = 0, self.paused, 0
        yielding: list[SeqState] = []
        for s in self.running:
            n_past = s.n_past
            own += n_past - s.n_shared
            left = len(s.tokens) - n_past
            if left > 1 or n_past < s.n_prompt:
                prefilling.append(s)
            elif left:
                if paused is not None and paused(s):
                    self.n_paused += 1
                    yielding = self._pause(s, yielding)
                else:
                    s.paused_at = 0.0
                    decoding.append(s)
            else:  # its input is in and its token not yet known: a grammar search (`SEARCHING`)
                plan.searching.append(s)
        for s in yielding:
            self._set_aside(s)
        self.kv.decode_order(decoding)
        free = self.kv.free_cells(self.cache, own)  # `_free_cells()`
        if len(decoding) > free:
            decoding = self._room_for_decode(decoding)
            prefilling = [s for s in prefilling if s.status == RequestStatus.RUNNING]
            plan.searching = [s for s in plan.searching if s.status == RequestStatus.RUNNING]
            free = self._free_cells()
        plan.decode = decoding
        free -= len(decoding)
        budget = self.prefill_budget - len(decoding)
        if prefilling:
            others = len(self.running) + len(self.waiting) > 1
            for s in prefilling:
                if budget <= 0:
                    break
                left = len(s.tokens) - s.n_past
                k = min(left, budget, self.busy_chunk if others else left)
                if k > free:
                    self._evict_cells(k - free)
                    free = self._free_cells() - plan.n_tokens
                    k = min(k, free)
                    if k <= 0:
                        break
                done = s.n_past + k == len(s.tokens)
                plan.chunks.append((s, s.n_past, k, done and not s.warm))
                budget -= k
                free -= k
        # The step's invariants (vLLM asserts its own at the end of `schedule`).
        assert budget >= 0 or not plan.chunks, "step over the prefill budget"
        assert free >= 0, "KV over capacity"
        return plan

    def update_from_output(self, plan: Plan, sampled, logprobs: dict | None = None,
                           seconds: float = 0.0) -> list[Finished]:
        """Apply a decoded plan: `sampled[i]` is the token of the i-th row that asked for
        logits (decode rows, then chunks that ended their prompt), or None when the runner
        took the token back (an end token under `ignore_eos`: decode that input again).
        `sampled[i]` may also be `SEARCHING` (the token is not known yet); after the rows come
        the `searching` sequences' tokens, in order (`SEARCHING` again while not known).
        `logprobs[i]` is row i's `TokenLogprob`, for the rows whose request asked for them.
        `seconds`: the step's time, which drives the limiter."""
        if self.limiter is not None and seconds > 0:
            self._adapt(self.limiter, plan, seconds)
        now = self.clock()
        running, on_token = RequestStatus.RUNNING, self._sampled
        for s, tok in zip(plan.decode, sampled):  # decode rows first, one token each
            s.n_past += 1
            if s.status is running:
                on_token(s, tok, now)
        i = len(plan.decode)
        for s, _, k, logits in plan.chunks:
            s.n_past += k
            if s.status != RequestStatus.RUNNING:
                continue
            if s.n_past - k < s.n_prompt <= s.n_past and not s.warm and self.reuse.publishes(s):
                self._publish(s)
            if s.warm and s.n_past == len(s.tokens):
                self._finish(s, RequestStatus.FINISHED_STOPPED)
            elif logits:
                tok = sampled[i]
                i += 1
                self._sampled(s, tok, now)
        for s in plan.searching:
            tok = sampled[i]
            i += 1
            if s.status is running and tok != SEARCHING:
                on_token(s, tok, now)
        if logprobs:
            self._record_logprobs(plan, sampled, logprobs)
        self.prefill_budget = self.n_batch
        return self.take_finished()

    def _record_logprobs(self, plan: Plan, sampled, logprobs: dict) -> None:
        """Keep each row's logprob with its sequence, once its token was applied; an end
        token that ended the request has no text and gets none (OpenAI lists none)."""
        rows = list(plan.decode) + [s for s, _, _, lg in plan.chunks if lg]
        for i, lp in logprobs.items():
            s, tok = rows[i], sampled[i]
            if tok is None or s.logprobs is None or len(s.logprobs) >= s.generated:
                continue
            if not s.sp.ignore_eos and self.is_eog(tok):
                continue
            s.logprobs.append(lp)

    def decode_failed(self, plan: Plan) -> None:
        """llama.cpp server's answer to "no KV room": a smaller prefill budget, else give up
        the youngest sequence's room (preempt it, or fail it when it runs alone)."""
        if plan.chunks and self.prefill_budget > 1:
            self.prefill_budget //= 2
            return
        youngest = self.running[-1]
        if len(self.running) > 1:
            self._preempt(youngest)
        else:
            self._finish(youngest, RequestStatus.FINISHED_ERROR,
                         f"backend {self.name}: the context ran out of KV cells for this request")

    def _pause(self, s: SeqState, yielding: list[SeqState]) -> list[SeqState]:
        """`s` is paused for its reader: note since when, and whether it now yields its place
        (to another client's queued request: yielding to its own client's, whose readers are
        as slow, would only make it compute prompts it cannot send)."""
        now = self.clock()
        if not s.paused_at:
            s.paused_at = now
        elif now - s.paused_at > PAUSE_YIELD_S and any(w.req.client != s.req.client or not w.req.client
                                                        for w in self.waiting):
            yielding.append(s)
        return yielding

    def _set_aside(self, s: SeqState) -> None:
        """Free a long-paused sequence's KV and keep it out of the queue until its reader
        catches up (then it queues again, what it generated becoming its prompt)."""
        self._forget(s)
        s.status = RequestStatus.WAITING
        s.preemptions += 1
        self.preemptions += 1
        self.n_paused -= 1
        self.parked.append(s)

    def _queue_turns(self) -> None:
        """Before admission: parked sequences whose readers caught up queue again, and another
        client's request may go first (`_fair_head`)."""
        if self.parked:
            self._take_back_parked()
        if len(self.waiting) > 1 and self.running:
            self._fair_head()

    def _fair_head(self) -> None:
        """When the queue's head is of a client that already runs sequences, the first queued
        request of a client that runs fewer goes first (`Request.client`; "" is never moved):
        40 streams of n=16 from one address queued everyone else's chats behind 640 sequences."""
        head = self.waiting[0].req.client
        if not head:
            return
        running = collections.Counter(s.req.client for s in self.running)
        least = running[head]
        if not least:
            return
        for i, s in enumerate(self.waiting):
            client = s.req.client
            if client and running[client] < least:
                del self.waiting[i]
                self.waiting.appendleft(s)
                return

    def _take_back_parked(self) -> None:
        """Parked sequences whose readers caught up queue again (at the back)."""
        ready = [s for s in self.parked if self.paused is None or not self.paused(s)]
        for s in ready:
            self.parked.remove(s)
            s.paused_at = 0.0
            self.add(s)

    def _adapt(self, lim: ConcurrencyLimiter, plan: Plan, seconds: float) -> None:
        """Feed the step to the limiter; at a window's end, give it the KV room."""
        n_prefill = plan.n_tokens - len(plan.decode)
        if not lim.observe(len(plan.decode), n_prefill, seconds, len(self.running), len(self.waiting)):
            return
        free, per_seq = self.kv.cap_room(self.cache, self.running, self.free_ids, ADMIT_HEADROOM)
        if lim.decide(free, per_seq):
            self.cap = lim.limit
            self.blocked = False

    def emit_pending(self) -> None:
        """Text for the tokens `update_from_output` left pending (overlap mode)."""
        pending, self.pending_text = self.pending_text, []
        for s, tok in pending:
            if s.status == RequestStatus.RUNNING:
                self._emit(s, tok)

    def flush_cache(self) -> None:
        self._apply_evictions(self.cache.flush())

    def set_cache_enabled(self, enabled: bool) -> None:
        self.reuse = self._cache_on if enabled else NULL_CACHE
        if not enabled:
            self.flush_cache()

    def drain(self, unstarted: bool = False) -> tuple[list[SeqState], list[SeqState]]:
        """Take every queued request, and every running one that may restart elsewhere
        (nothing produced yet, and `retry` unless `unstarted`), out of the scheduler without
        finishing them: `(movable, rest)`; `rest` are the running ones left."""
        queued = list(self.waiting)
        self.waiting.clear()
        movable = [s for s in self.running if (unstarted or s.req.retry) and s.generated == 0]
        for s in queued + movable:
            self._forget(s)
        return queued + movable, list(self.running)

    def shutdown(self, status: RequestStatus, why: str) -> None:
        """End everything with `status` and free every cached sequence."""
        for s in list(self.running) + list(self.waiting):
            if s in self.waiting:
                self.waiting.remove(s)
            self._finish(s, status, why)
        self._apply_free(self.cache.clear())

    def fail(self, s: SeqState, why: str, kind: str = "server_error") -> None:
        if s in self.waiting:
            self.waiting.remove(s)
        self._finish(s, RequestStatus.FINISHED_ERROR, why, kind)

    def kv_cells_used(self, running=None) -> int:
        """Cells in use by the cache and the running sequences (engine/sched/kv_layout.py)."""
        return self.kv.cells_used(self.cache, self.running if running is None else running)

    def lowest_free_ids(self, n: int) -> list[int]:
        return heapq.nsmallest(max(n, 0), self.free_ids)

    def match_tokens(self, tokens) -> int:
        return self.reuse.match_length(self.cache, tokens)

    def match_resumed(self, tokens) -> tuple[int, int]:
        """`match_tokens`, and of it an earlier request's own part that this prompt resumes."""
        return self.reuse.match_resumed(self.cache, tokens)

    def pin_prefix(self, tokens) -> tuple[int, Pin | None]:
        """The cached prefix a request of `tokens` about to be queued reuses, pinned (Reuse.pin)."""
        return self.reuse.pin(self.cache, tokens)

    # ---- admission ----

    def _admit(self, plan: Plan) -> None:
        if self.blocked:
            return
        i = 0  # requests deferred behind a running prefill of their prefix stay in place
        defer = self.reuse.defers
        spare = self._holder_free()
        # Donors: prompt prefills cached at their end (a choice's; with `defer`, others' with an id, warm ones').
        donors = [s for s in self.running if s.n_past < s.n_prompt and (s.choice or (defer and (spare or s.warm)))]
        while i < len(self.waiting) and len(self.running) < self.cap:
            seq = self.waiting[i]
            if donors and self._deferred(seq, donors, defer):
                i += 1
                if i >= self.cap:
                    return
                continue
            placed = self._place(seq)
            if placed is None:  # failed, and taken out of the queue
                continue
            if not placed:
                return
            del self.waiting[i]
            self.running.append(seq)
            if (defer or seq.choice) and seq.n_past < seq.n_prompt:
                donors.append(seq)  # the next of its tenant (or of its choices) waits for this prefill
            plan.admitted.append(seq)
            if seq.warm and seq.n_past == len(seq.tokens):  # all of it is cached already
                self._finish(seq, RequestStatus.FINISHED_STOPPED)

    def _place(self, seq: SeqState) -> bool | None:
        """Give `seq` a sequence id and its cached prefix, if KV room allows."""
        n = len(seq.tokens)
        match = self.cache.match(seq.tokens, max_len=self.reuse.usable(seq))
        lock = self.cache.pin(match) if match.length else None  # keeps it through evictions
        hit = match.length
        if not self.running and hit < SHARE_MIN_TOKENS:
            self._shed_unrelated()
        need = n - hit + (0 if seq.warm else min(ADMIT_HEADROOM, self.n_ctx_seq - n))
        if not self._make_room(need + self._prefill_owed() + len(self.running)):
            if lock is not None:
                self.cache.unpin(lock)
            if not self.running and self._unpin_queued(seq):
                return self._place(seq)  # once more, with what the queue behind it pinned evictable
            if not self.running:  # nothing will free cells: waiting would be forever
                self.waiting.remove(seq)
                self._finish(seq, RequestStatus.FINISHED_ERROR,
                             f"backend {self.name}: needs {need} KV cells and the context has "
                             f"{self.n_ctx - self.kv_cells_used()} free "
                             f"({self.cache.pinned_tokens} held for queued requests)")
                return None
            self.blocked = True  # retry when a running request ends
            return False
        seq.seq_id = seq.ran_on = self._take_id(seq)
        if lock is not None:  # a hit
            self._reuse_prefix(self._holder(lock.node), seq.seq_id, hit)
        seq.lock = lock
        self._release_pin(seq)
        seq.n_past = seq.n_shared = seq.n_hit = hit
        self.cache.record_query(n, hit, seq.tokens)
        if not seq.t_admit:
            seq.t_admit = self.clock()
            seq.admit_cap = self.cap
            seq.admit_reason = self.limiter.reason if self.limiter is not None else "fixed"
        seq.status = RequestStatus.RUNNING
        return True

    def _holder(self, node: TreeNode) -> int:
        """The seq whose cells hold a matched prefix of at least one token."""
        holder = self.cache.holder_for(node)
        if holder is None:
            raise RuntimeError(f"backend {self.name}: an empty match has no cells to share")
        return holder

    def _deferred(self, seq: SeqState, donors: list[SeqState], defer: bool) -> bool:
        """`seq` waits for a donor's prompt prefill: a choice behind a choice holding all its
        prompt but the last token; with `defer`, when that reuses `SHARE_MIN_TOKENS` more of it
        and the donor has no more prompt left than `seq` would compute now (see the module doc)."""
        if seq.warm or not (defer or seq.choice):
            return False
        limit = len(seq.tokens) - 1
        cached = self.match_tokens(seq.tokens)
        own = len(seq.tokens) - cached
        for s in donors:
            shared = _common_length(seq.tokens, s.tokens, min(limit, s.n_prompt))
            if seq.choice and s.choice and shared == limit > cached:
                return True
            if defer and shared - cached >= SHARE_MIN_TOKENS and s.n_prompt - s.n_past <= own:
                return True
        return False

    def _holder_free(self) -> bool:
        """A sequence id is free for a published prompt's holder beyond those the cap may still
        admit (holders never take a running sequence's id)."""
        return len(self.free_ids) > self.cap - len(self.running)

    def _publish(self, s: SeqState) -> None:
        """`s` has just computed its whole prompt: alias a copy the cache got meanwhile, then put
        the prompt into the cache under a holder id of its own (see the module doc)."""
        prompt, n = s.tokens[:s.n_prompt], s.n_prompt
        least = 1 if s.choice else SHARE_MIN_TOKENS  # `n` promises one prefill, however short
        if s.choice and not self._holder_free() and self.cache.match_length(prompt) < n:
            self._apply_evictions(self.cache.evict(need_seqs=1))  # an idle cached prefix makes way
        match = self.cache.match(prompt)
        shared = s.n_shared
        if match.length > shared:
            # Another sequence published (or finished) this prefix while `s` computed its own
            # copy: drop the copy and alias those cells, so the prefix exists once.
            ops = self.kv.share_copy(s.seq_id, self._holder(match.node), match.length)
            if ops:
                self._ops += ops
                shared = match.length
        if n - match.length >= least and self._holder_free():
            holder = max(self.free_ids)
            self.free_ids.remove(holder)
            heapq.heapify(self.free_ids)
            self._reuse_prefix(s.seq_id, holder, n)
            self._apply_free(self.cache.insert(prompt, holder).free_seqs)
            match = self.cache.match(prompt)
            shared = n
            if self.blocked and any(_common_length(q.tokens, prompt, n) >= least
                                    for q in itertools.islice(self.waiting, self.cap)):
                self.blocked = False  # queued requests of this prefix now need fewer cells
        if shared > s.n_shared:
            lock = self.cache.pin(match)  # pinned while `s` runs: its shared cells stay counted
            if s.lock is not None:
                self.cache.unpin(s.lock)
            s.lock = lock
            s.n_shared = shared

    def _unpin_queued(self, head: SeqState | None) -> bool:
        """Drop the routing-time pins of the requests queued (behind `head`, if given); True if
        any was held.

        Those pins are estimates made when each request was routed, not promises: with nothing
        running, nothing else will free cells, and a head that fits once their prefixes may be
        evicted must not fail for them (a 2,048-cell engine failed a 1,237-token request with
        1,222 cells pinned for two queued tenants' prefixes). Nor may a running sequence that
        needs a cell to grow be preempted or failed for them (`_room_for_decode`: the soak's lone
        779-cell request failed with 1,852 cells pinned for the queue). They find what is still
        cached when their turn comes."""
        held = False
        for s in self.waiting:
            if s is not head and s.pin is not None:
                self._release_pin(s)
                held = True
        return held

    def _take_id(self, seq: SeqState) -> int:
        """A free seq id for `seq`, as the KV layout prefers it."""
        return self.kv.take_id(self.free_ids, seq, self.preferred_ids)

    def _reuse_prefix(self, holder: int, seq_id: int, n: int) -> None:
        """Give `seq_id` the KV of the holder's first `n` tokens."""
        self._ops += self.kv.reuse_prefix(holder, seq_id, n)

    def _free_cells(self) -> int:
        return self.kv.free_cells(self.cache, sum(s.n_past - s.n_shared for s in self.running))

    def _prefill_owed(self) -> int:
        """Cells running prefills will still take."""
        return self.kv.prefill_owed(self.running)

    def _make_room(self, need_cells: int) -> bool:
        """Evict unpinned cached prefixes until `need_cells` cells and one seq id are free
        (split KV: only the id, its free cells being unbounded)."""
        deficit = need_cells - self._free_cells()
        if deficit > 0:
            self._apply_evictions(self.cache.evict(need_tokens=deficit))
            if need_cells > self._free_cells():
                return False
        if not self.free_ids:
            self._apply_evictions(self.cache.evict(need_seqs=1))
        return bool(self.free_ids)

    def _evict_cells(self, deficit: int) -> None:
        if deficit > 0:
            self._apply_evictions(self.cache.evict(need_tokens=deficit))

    def _shed_idle_cache(self) -> None:
        """Evict least recently used cached sequences that no running sequence uses down to
        the layout's budget for idle cells (unified KV: `idle_cache_cells / B`)."""
        budget = self.kv.idle_budget(self.idle_cache_cells, len(self.running))
        self._apply_evictions(self.reuse.shed(self.cache, budget))

    def _shed_unrelated(self) -> None:
        """Work that uses (almost) nothing cached starts on an idle context: what the cache
        holds belongs to other work, so all of it but the few tokens this request matched
        (pinned) goes down to the layout's budget for that (unified KV: nothing) before the
        new cells are placed. Kept, every decode step of the new work would scan it (unified KV
        without flash attention: every cell up to the highest in use): a tiny-model context that had served 4 conversations held 858 cells through
        the study's workload where a fresh one held 384 (tests/test_history.py). A prefix
        another queued request was routed to stays pinned; a new conversation sharing the
        cached system prompt keeps the other conversations' histories."""
        evicted = self.reuse.shed(self.cache, self.kv.unrelated_budget())
        if evicted:
            self._apply_evictions(evicted)
            self.unrelated_sheds += 1

    # ---- growth and preemption ----

    def _room_for_decode(self, decoding: list[SeqState]) -> list[SeqState]:
        """A cell for every decode row; evict, then preempt the youngest (only unified KV gets
        here: split KV's free cells are unbounded)."""
        while decoding and len(decoding) > self._free_cells():
            self._evict_cells(len(decoding) - self._free_cells())
            if len(decoding) <= self._free_cells():
                break
            if self._unpin_queued(None):
                continue  # a running sequence comes before a queued request's routing-time estimate
            victim = self.running[-1]
            if len(self.running) == 1:
                self._finish(victim, RequestStatus.FINISHED_ERROR,
                             f"backend {self.name}: the context ran out of KV cells for this request "
                             f"({victim.n_past} cells; {self.cache.pinned_tokens} held for queued requests)")
            else:
                self._preempt(victim)
            decoding = [s for s in decoding if s.status == RequestStatus.RUNNING]
        return decoding

    def _preempt(self, s: SeqState) -> None:
        """Free `s`'s cells and queue it first again; what it generated becomes its prompt."""
        self._forget(s)
        s.status = RequestStatus.WAITING
        s.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(s)
        self.blocked = True  # nothing is admitted before someone finishes (vLLM's rule)
        if self.limiter is not None and self.limiter.kv_full(len(self.running)):
            self.cap = self.limiter.limit

    def _forget(self, s: SeqState) -> None:
        """Take `s` out of the running set and free its KV, without finishing it."""
        self._leave(s, keep=False)
        s.estimate = 0
        self._unplaced.append(s)

    def _leave(self, s: SeqState, keep: bool) -> None:
        """Hand `s`'s KV to the prefix cache (`keep`) or free it, drop its pins, and take it
        out of the running set: what finishing and preempting share."""
        if s.seq_id >= 0:
            self._retire(s, keep)
        elif s.lock is not None:
            self.cache.unpin(s.lock)
            s.lock = None
        self._release_pin(s)
        if s in self.running:
            self.running.remove(s)

    # ---- finish rules ----

    def _sampled(self, s: SeqState, tok: int | None, now: float) -> None:
        if tok == SEARCHING:  # its input is in (n_past counts it); a search in a later step gives the token
            return
        if tok is None:  # taken back: the same input is decoded again next step
            s.n_past -= 1
            self._ops.append(KvOp("rm", s.seq_id, -1, s.n_past, -1))
            return
        s.tokens.append(tok)
        s.generated += 1
        if s.generated == 1:
            s.t_first = now
        else:
            s.itl_sum += now - s.t_last
        s.t_last = now
        if (not s.sp.ignore_eos and self.is_eog(tok)) or s.generated == s.req.stop_after:
            self._finish(s, RequestStatus.FINISHED_STOPPED)
            return
        if self.overlap and not s.sp.stop:  # no stop string can end it: its text can wait
            self.pending_text.append((s, tok))
        elif self._emit(s, tok):
            self._finish(s, RequestStatus.FINISHED_STOPPED)
            return
        if s.generated >= s.max_new or s.n_past + 1 >= self.n_ctx_seq:
            self._finish(s, RequestStatus.FINISHED_LENGTH)

    def _emit(self, s: SeqState, tok: int) -> bool:
        """Push a token's text to the request's stream; True if a stop string ended it."""
        delta = s.stream.push(self.piece(tok))
        if delta:
            s.handle._deliver_text(delta)
        return s.stream.stopped

    def _finish(self, s: SeqState, status: RequestStatus, error: str | None = None,
                kind: str = "server_error") -> None:
        """End a sequence: stream the rest, keep or free its KV, queue its `Finished`."""
        if self.pending_text:
            mine = [p for p in self.pending_text if p[0] is s]
            if mine:
                self.pending_text = [p for p in self.pending_text if p[0] is not s]
                for _, tok in mine:
                    self._emit(s, tok)
        if status == RequestStatus.FINISHED_LENGTH or (status == RequestStatus.FINISHED_STOPPED
                                                       and not s.stream.stopped):
            # Release what the stream held back (a partial stop string, a split character).
            rest = s.stream.flush()
            if rest:
                s.handle._deliver_text(rest)
        self._leave(s, keep=status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH))
        s.n_shared = s.n_hit  # the record reports what it reused
        self.blocked = False
        s.status = status
        s.error = error
        self._finished.append(Finished(s, status, error, kind))

    def _retire(self, s: SeqState, keep: bool) -> None:
        """Hand a sequence's KV to the prefix cache, or free it."""
        sid, s.seq_id = s.seq_id, -1
        if not (keep and self.reuse.keeps(s)):
            self._apply_free([sid])
        else:
            in_kv = s.tokens[:s.n_past]
            match = self.cache.match(in_kv)
            if match.length < len(in_kv) and not any(i > sid for i in self.free_ids):
                # It will be kept, and `_park` needs a free id above: the least recently used
                # cached sequence makes way (else this one would stay on a chained id).
                self._apply_evictions(self.cache.evict(need_seqs=1))
                match = self.cache.match(in_kv)
            if match.length > s.n_shared:
                # The sequence computed its own copy of a prefix the cache already holds:
                # drop the copy and alias the cached cells, so shared cells exist once.
                self._ops += self.kv.share_copy(sid, self._holder(match.node), match.length)
            if match.length < len(in_kv):  # it will be kept, on an id of its own
                sid = self._park(sid)
            result = self.cache.insert(in_kv, sid, prompt_end=s.n_prompt)
            self._apply_free(result.free_seqs)
        if s.lock is not None:
            self.cache.unpin(s.lock)
            s.lock = None
            self._apply_evictions(self.reuse.released(self.cache))  # cache off: what it held goes
        s.n_shared = s.n_past = 0

    def _park(self, sid: int) -> int:
        """Move a finished sequence's KV to the highest free id, which the cache then holds;
        returns that id. Running sequences keep the low ids, and with them the sampler chains
        attached there (SamplerSlots): a cache holder left on a chained id would send the next
        request to an id without one, and each attach costs a graph reserve. In split KV it
        also keeps the running ids consecutive (one ubatch per decode step). Unified KV: the
        cells gain and lose a sequence id, nothing moves; split KV: one stream is copied on
        the device."""
        top = max(self.free_ids, default=-1)
        if top < sid:
            return sid
        self.free_ids.remove(top)
        heapq.heapify(self.free_ids)
        self._ops.append(KvOp("cp", sid, top, -1, -1))
        self._ops.append(KvOp("rm", sid, -1, -1, -1))
        heapq.heappush(self.free_ids, sid)
        return top

    def _apply_free(self, seq_ids) -> None:
        for sid in seq_ids:
            self._ops.append(KvOp("rm", sid, -1, -1, -1))
            heapq.heappush(self.free_ids, sid)

    def _apply_evictions(self, actions) -> None:
        for a in actions:
            if a.keep == 0:
                self._apply_free([a.seq_id])
            else:
                self._ops.append(KvOp("rm", a.seq_id, -1, a.keep, -1))

    def _release_pin(self, s: SeqState) -> None:
        if s.pin is not None:
            self.cache.unpin(s.pin)
            s.pin = None

    def _expire_waiting(self) -> None:
        now = self.clock()
        if now < self._next_timeout_check:
            return
        self._next_timeout_check = now + 0.05
        limit = self.queue_timeout_s
        for s in [s for s in self.waiting if now - s.t_submit > limit]:
            self.waiting.remove(s)
            self._finish(s, RequestStatus.FINISHED_ERROR,
                         f"backend {self.name}: waited more than {limit:g} s in the queue")


def _common_length(a, b, limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit` (slices compare in C)."""
    limit = min(limit, len(a), len(b))
    head = min(SHARE_MIN_TOKENS, limit)
    if a[:head] != b[:head]:  # distinct prompts mostly differ early: no long slices for them
        lo, hi = 0, head
    elif a[:limit] == b[:limit]:
        return limit
    else:
        lo, hi = head, limit
    while lo < hi - 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
