"""The continuous-batching scheduler of one backend: pure planning, no llama.cpp, no threads.

vLLM v1's split (`vllm/v1/core/sched/scheduler.py`): `schedule()` returns a `Plan` value,
the runner (engine/llama/runner.py) executes it on a llama.cpp context, and
`update_from_output(plan, output)` applies the sampled tokens and returns what finished.
Every effect on the KV cache (alias a cached prefix, free a sequence, park it on another id,
evict a cached prefix) is a `KvOp` its `KvLedger` (engine/sched/kv_ledger.py) queues and the
runner applies (`take_ops`), in order, before it decodes. Its collaborators, each with one job:
the ledger (ids, cells, evictions), `FinishRules` (engine/sched/finish_rules.py: stops and
text), `PromptSharing` (engine/sched/sharing.py: prompts shared while they run) and the
`ConcurrencyLimiter` (the live cap). Its settings are one frozen `SchedulerConfig`. Time comes from an injected `clock`, text from an injected
`piece(token)`, so the same scheduler runs against simulated runners and in unit tests
(tests/test_scheduler.py, milliseconds, no model).

The rules, in the order each step applies them, and why: docs/design/sched.md.

Thread contract: none. The owner (engine/backends/local.py's worker) calls everything from one
thread; only the queues (`waiting`, `running`), `kv_cells_used` and the counters are read by
other threads, under the owner's lock."""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from engine.core.request import RequestStatus, SamplingParams, TokenLogprob
from engine.sched.finish_rules import FinishRules
from engine.sched.kv_layout import KvOp, kv_layout
from engine.sched.kv_ledger import KvLedger
from engine.sched.limiter import ConcurrencyLimiter
from engine.sched.prefix_cache import Pin, PrefixCache
from engine.sched.reuse import NULL_CACHE, RadixReuse, Reuse
from engine.sched.sequence import SeqState
from engine.sched.sharing import SHARE_MIN_TOKENS, PromptSharing, donors_of

__all__ = ["ADMIT_HEADROOM", "Finished", "KvOp", "Plan", "Scheduler", "SchedulerConfig", "SeqState",
           "default_seq_slots"]

# Cells a request needs free beyond its uncached prompt to be admitted: its first few decode
# tokens, so that a fresh admission is not preempted at once.
ADMIT_HEADROOM = 16
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

    decode: list[SeqState] = field(default_factory=list)
    chunks: list[tuple[SeqState, int, int, bool]] = field(default_factory=list)
    admitted: list[SeqState] = field(default_factory=list)
    searching: list[SeqState] = field(default_factory=list)

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

    def logit_rows(self) -> list[SeqState]:
        """The sequences of the rows that asked for logits, in row order (decode, then prompt ends)."""
        return list(self.decode) + [s for s, _, _, lg in self.chunks if lg]


@dataclass(slots=True)
class Finished:
    seq: SeqState
    status: RequestStatus
    error: str | None = None
    kind: str = "server_error"  # the error's kind (`EngineError.kind`): who is to blame


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What a scheduler is told once: its context's sizes and its rules' switches."""

    cap: int  # concurrent sequences (without a limiter; with one, the limiter's limit rules)
    n_ctx: int  # KV cells, all sequences together
    n_ctx_seq: int  # the most cells one sequence may hold
    n_seq_max: int  # llama.cpp sequence ids (running sequences and cached prefixes)
    n_batch: int  # tokens per step: the prefill budget
    kv_unified: bool = True  # one pool of cells (`UnifiedKv`), else a stream per id (`SplitKv`)
    cache_enabled: bool = True  # the prefix cache's switch at the start (`set_cache_enabled`)
    idle_cache_cells: int = -1  # idle cached cells kept while sequences run (-1: the layout's)
    busy_chunk: int | None = None  # the longest prompt chunk while others run (None: n_batch)
    queue_timeout_s: float = 0.0  # a queued request fails after this long (0: never)
    name: str = "backend"  # in error messages
    share_prefill: bool = True  # running prompts are published to the cache
    defer_shared: bool = True  # queued requests may wait for a running prefill of their prefix
    overlap: bool = False  # text of requests without stop strings waits for `emit_pending`


class Scheduler:
    """Queues, admission, batch plans and preemption of one backend (owner's thread)."""

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic, *,
                 piece: Callable[[int], bytes] = lambda t: b"", is_eog: Callable[[int], bool] = lambda t: False,
                 preferred_ids: Callable[[SamplingParams], list[int]] = lambda sp: [],
                 cache: PrefixCache | None = None, limiter: ConcurrencyLimiter | None = None,
                 paused: Callable[[SeqState], bool] | None = None) -> None:
        c = self.config = config
        self.name = c.name
        self.n_ctx, self.n_ctx_seq, self.n_batch = c.n_ctx, c.n_ctx_seq, c.n_batch
        # The live cap; with a `limiter` (engine/sched/limiter.py) it follows the measured steps.
        self.limiter = limiter
        self.cap = limiter.limit if limiter is not None else c.cap
        self.kv = kv_layout(c.kv_unified, c.n_ctx)  # unified or split (engine/sched/kv_layout.py)
        self.cache = cache or PrefixCache()
        self.ledger = KvLedger(self.kv, self.cache, c.n_seq_max, c.name, preferred_ids)
        self.free_ids = self.ledger.free_ids  # the same heap, for readers
        self.sharing = PromptSharing(self.ledger, self.cache)
        self.rules = FinishRules(piece, is_eog, c.n_ctx_seq, c.overlap)
        self.pending_text = self.rules.pending_text  # the same list, for readers
        # The cache switch (engine/sched/reuse.py): on, with its sharing switches, or the null cache.
        self._cache_on = RadixReuse(c.share_prefill, c.defer_shared)
        self.reuse: Reuse = self._cache_on if c.cache_enabled else NULL_CACHE
        self.busy_chunk = max(1, c.busy_chunk or c.n_batch)
        self.clock = clock
        self.waiting: collections.deque[SeqState] = collections.deque()
        self.running: list[SeqState] = []
        self.prefill_budget = c.n_batch  # halved after a "no KV room" decode
        self.blocked = False  # the queue's head waits for KV room that only a finish frees
        self.preemptions = 0
        self.unrelated_sheds = 0  # idle caches cleared for unrelated work (`_place`)
        self._finished: list[Finished] = []
        self._unplaced: list[SeqState] = []  # left the running set unfinished (preempted, drained)
        self._next_timeout_check = 0.0
        # A decoding sequence for which `paused` holds (its reader is behind) takes no row and
        # keeps its KV until it does not; `n_paused` counts them at the last `schedule`.
        self.paused = paused
        self.n_paused = 0
        self.parked: list[SeqState] = []  # paused sequences set aside, their KV freed (`_set_aside`)

    @property
    def cache_enabled(self) -> bool:
        return self.reuse.enabled

    # ---- what the owner calls ----

    def add(self, seq: SeqState, front: bool = False) -> None:
        """Queue `seq` (at the back, or first)."""
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
        return bool(self.ledger.ops or self._unplaced or self._finished)

    def take_ops(self) -> list[KvOp]:
        """The KV ops to apply, in order, before the next decode."""
        return self.ledger.take_ops()

    def take_finished(self) -> list[Finished]:
        """Sequences that ended since the last call."""
        done, self._finished = self._finished, []
        return done

    def take_unplaced(self) -> list[SeqState]:
        """Sequences that left the running set without finishing (their samplers go)."""
        out, self._unplaced = self._unplaced, []
        return out

    def cancel(self, ids: Collection[str]) -> None:
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
        if self.config.queue_timeout_s:
            self._expire_waiting()
        self._queue_turns()
        if self.waiting and not self.blocked:
            self._admit(plan)
        if not self.running:
            return plan
        # Idle cached cells that no running sequence uses go down to the layout's budget
        # (unified KV: `idle_cache_cells / B`).
        budget = self.kv.idle_budget(self.config.idle_cache_cells, len(self.running))
        self.ledger.evict(self.reuse.shed(self.cache, budget))
        decoding, prefilling, own = self._sort_running(plan)
        self.kv.decode_order(decoding)
        free = self.kv.free_cells(self.cache, own)  # `ledger.free_cells(running)`
        if len(decoding) > free:
            decoding = self._room_for_decode(decoding)
            prefilling = [s for s in prefilling if s.status == RequestStatus.RUNNING]
            plan.searching = [s for s in plan.searching if s.status == RequestStatus.RUNNING]
            free = self.ledger.free_cells(self.running)
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
                    self.ledger.evict_cells(k - free)
                    free = self.ledger.free_cells(self.running) - plan.n_tokens
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

    def _sort_running(self, plan: Plan) -> tuple[list[SeqState], list[SeqState], int]:
        """One pass over the running set: its decode rows, its prefills (searches go to
        `plan.searching`), and the cells the running sequences own (`SeqState.prefilling`
        and `kv_cells_used`, inlined); paused sequences take no row, and long-paused ones
        yield their place."""
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
                    if yields_place(s, self.clock(), self.waiting):
                        yielding.append(s)
                else:
                    s.paused_at = 0.0
                    decoding.append(s)
            else:  # its input is in and its token not yet known: a grammar search (`SEARCHING`)
                plan.searching.append(s)
        for s in yielding:
            self._set_aside(s)
        return decoding, prefilling, own

    def update_from_output(self, plan: Plan, sampled: Sequence[int | None],
                           logprobs: dict[int, TokenLogprob] | None = None,
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
            if (s.n_past - k < s.n_prompt <= s.n_past and not s.warm and self.reuse.publishes(s)
                    and self.sharing.publish(s, self.cap - len(self.running),
                                             itertools.islice(self.waiting, self.cap), self.blocked)):
                self.blocked = False  # queued requests of this prefix now need fewer cells
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
            self.rules.record_logprobs(plan.logit_rows(), sampled, logprobs)
        self.prefill_budget = self.n_batch
        return self.take_finished()

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
        """Before admission: parked sequences whose readers caught up queue again (at the
        back), and another client's request may go first (`fair_head`)."""
        if self.parked:
            for s in [s for s in self.parked if self.paused is None or not self.paused(s)]:
                self.parked.remove(s)
                s.paused_at = 0.0
                self.add(s)
        if len(self.waiting) > 1 and self.running:
            fair_head(self.waiting, self.running)

    def _adapt(self, lim: ConcurrencyLimiter, plan: Plan, seconds: float) -> None:
        """Feed the step to the limiter; at a window's end, give it the KV room."""
        n_prefill = plan.n_tokens - len(plan.decode)
        if not lim.observe(len(plan.decode), n_prefill, seconds, len(self.running), len(self.waiting)):
            return
        free, per_seq = self.kv.cap_room(self.cache, self.running, self.free_ids, ADMIT_HEADROOM)
        if lim.decide(free, per_seq):
            self.cap = lim.limit
            self.blocked = False

    def flush_cache(self) -> None:
        """Evict every unpinned cached prefix."""
        self.ledger.evict(self.cache.flush())

    def set_cache_enabled(self, enabled: bool) -> None:
        """Switch the prefix cache on or off (off: flushed)."""
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
        self.ledger.free(self.cache.clear())

    def fail(self, s: SeqState, why: str, kind: str = "server_error") -> None:
        """End `s` (queued or running) with an error of `kind`."""
        if s in self.waiting:
            self.waiting.remove(s)
        self._finish(s, RequestStatus.FINISHED_ERROR, why, kind)

    def kv_cells_used(self, running: Sequence[SeqState] | None = None) -> int:
        """Cells in use by the cache and the running sequences (engine/sched/kv_layout.py)."""
        return self.ledger.cells_used(self.running if running is None else running)

    def match_tokens(self, tokens: Sequence[int]) -> int:
        """Cached tokens a request of `tokens` would reuse (the router's estimate)."""
        return self.reuse.match_length(self.cache, tokens)

    def match_resumed(self, tokens: Sequence[int]) -> tuple[int, int]:
        """`match_tokens`, and of it an earlier request's own part that this prompt resumes."""
        return self.reuse.match_resumed(self.cache, tokens)

    def pin_prefix(self, tokens: Sequence[int]) -> tuple[int, Pin | None]:
        """The cached prefix a request of `tokens` about to be queued reuses, pinned (Reuse.pin)."""
        return self.reuse.pin(self.cache, tokens)

    # ---- admission ----

    def _admit(self, plan: Plan) -> None:
        if self.blocked:
            return
        i = 0  # requests deferred behind a running prefill of their prefix stay in place
        defer = self.reuse.defers
        donors = donors_of(self.running, defer, self.ledger.spare_ids(self.cap - len(self.running)))
        while i < len(self.waiting) and len(self.running) < self.cap:
            seq = self.waiting[i]
            if donors and self.sharing.deferred(seq, donors, defer, self.match_tokens(seq.tokens)):
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
        """Give `seq` a sequence id and its cached prefix, if KV room allows: True when placed,
        False when it waits for room, None when it failed (and left the queue)."""
        n = len(seq.tokens)
        match = self.cache.match(seq.tokens, max_len=self.reuse.usable(seq))
        lock = self.cache.pin(match) if match.length else None  # keeps it through evictions
        hit = match.length
        if not self.running and hit < SHARE_MIN_TOKENS and self.ledger.evict(
                self.reuse.shed(self.cache, self.kv.unrelated_budget())):
            self.unrelated_sheds += 1  # docs/design/sched.md: unrelated work starts on an idle context
        need = n - hit + (0 if seq.warm else min(ADMIT_HEADROOM, self.n_ctx_seq - n))
        if not self.ledger.make_room(need + self.kv.prefill_owed(self.running) + len(self.running), self.running):
            if lock is not None:
                self.cache.unpin(lock)
            if not self.running and self.ledger.unpin_queued(self.waiting, seq):
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
        seq.seq_id = seq.ran_on = self.ledger.take_id(seq)
        if lock is not None:  # a hit
            self.ledger.reuse_prefix(self.ledger.holder(lock.node), seq.seq_id, hit)
        seq.lock = lock
        self.ledger.release_pin(seq)
        seq.n_past = seq.n_shared = seq.n_hit = hit
        self.cache.record_query(n, hit, seq.tokens)
        if not seq.t_admit:
            seq.t_admit = self.clock()
            seq.admit_cap = self.cap
            seq.admit_reason = self.limiter.reason if self.limiter is not None else "fixed"
        seq.status = RequestStatus.RUNNING
        return True

    # ---- growth and preemption ----

    def _room_for_decode(self, decoding: list[SeqState]) -> list[SeqState]:
        """A cell for every decode row; evict, then preempt the youngest (only unified KV gets
        here: split KV's free cells are unbounded)."""
        ledger = self.ledger
        while decoding and len(decoding) > ledger.free_cells(self.running):
            ledger.evict_cells(len(decoding) - ledger.free_cells(self.running))
            if len(decoding) <= ledger.free_cells(self.running):
                break
            if ledger.unpin_queued(self.waiting, None):
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
            self.ledger.retire(s, keep and self.reuse.keeps(s), self.reuse)
        elif s.lock is not None:
            self.cache.unpin(s.lock)
            s.lock = None
        self.ledger.release_pin(s)
        if s in self.running:
            self.running.remove(s)

    # ---- finish rules ----

    def _sampled(self, s: SeqState, tok: int | None, now: float) -> None:
        if tok == SEARCHING:  # its input is in (n_past counts it); a search in a later step gives the token
            return
        if tok is None:  # taken back: the same input is decoded again next step
            self.ledger.take_back(s)
            return
        status = self.rules.on_token(s, tok, now)
        if status is not None:
            self._finish(s, status)

    def _finish(self, s: SeqState, status: RequestStatus, error: str | None = None,
                kind: str = "server_error") -> None:
        """End a sequence: stream the rest, keep or free its KV, queue its `Finished`."""
        self.rules.flush(s, status)
        self._leave(s, keep=status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH))
        s.n_shared = s.n_hit  # the record reports what it reused
        self.blocked = False
        s.status = status
        s.error = error
        self._finished.append(Finished(s, status, error, kind))

    def _expire_waiting(self) -> None:
        now = self.clock()
        if now < self._next_timeout_check:
            return
        self._next_timeout_check = now + 0.05
        limit = self.config.queue_timeout_s
        for s in [s for s in self.waiting if now - s.t_submit > limit]:
            self.waiting.remove(s)
            self._finish(s, RequestStatus.FINISHED_ERROR,
                         f"backend {self.name}: waited more than {limit:g} s in the queue")


def yields_place(s: SeqState, now: float, waiting: Iterable[SeqState]) -> bool:
    """`s` is paused for its reader: note since when, and whether it now yields its place
    (to another client's queued request: yielding to its own client's, whose readers are
    as slow, would only make it compute prompts it cannot send)."""
    if not s.paused_at:
        s.paused_at = now
        return False
    return now - s.paused_at > PAUSE_YIELD_S and any(w.req.client != s.req.client or not w.req.client
                                                      for w in waiting)


def fair_head(waiting: collections.deque[SeqState], running: Sequence[SeqState]) -> None:
    """When the queue's head is of a client that already runs sequences, the first queued
    request of a client that runs fewer goes first (`Request.client`; "" is never moved):
    40 streams of n=16 from one address queued everyone else's chats behind 640 sequences."""
    head = waiting[0].req.client
    if not head:
        return
    counts = collections.Counter(s.req.client for s in running)
    least = counts[head]
    if not least:
        return
    for i, s in enumerate(waiting):
        client = s.req.client
        if client and counts[client] < least:
            del waiting[i]
            waiting.appendleft(s)
            return
