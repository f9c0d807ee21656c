"""`finish-first`: each request goes where it finishes first; `finish-first:pack`, the default
policy (`default`), also packs a device's contexts while its requests start fresh.

Everything that decides when the request's last token comes is counted, per backend:

- the queue ahead of it, admitted first come first served under the backend's live cap and
  the KV room admission needs (the uncached prompt plus headroom; decode budgets are not
  reserved, as the scheduler reserves none), each admission paying its uncached prefill;
- its own prefill, less what that backend has cached for it: what its prefix cache holds,
  or a prefix routed there moments ago and still queued or in prefill (the scheduler defers a
  request behind a running prefill of its prefix and reuses it), so a tenant's or a
  conversation's requests stay where their prefix lives as long as that is where they finish
  first;
- its own decode, at the per-sequence speed of the batch it joins: one token per step of
  `Rates.step_s(b)`, the calibrated step at batch b, as the batch shrinks while others finish.

The lowest predicted finish wins; a backend that cannot finish the request sooner gets
nothing, and a backend that can (the study's M2, where the GPU's 4 slots are full and the CPU
is idle) gets it. Running and queued requests are priced at their whole remaining budget (a
stop string is not foreseen), the same on every backend. A CPU backend whose peak decode is
under `MIN_PEAK_SHARE` of a GPU device's takes no part: priced from an idle calibration, it
decodes far slower beside busy GPU contexts, and one misjudged request there decides a run.

The contexts one device runs share its compute: the device whose best context finishes first
wins, then one of its contexts. `finish-first` lets `cache-aware` choose among them.
`finish-first:pack` packs them while the device's requests start fresh (`FinishFirst._in_use`:
each context's step reads all the weights and runs its own host work, so a few contexts that
hold the load run fastest), and shares new work out once it serves conversations
(`FinishFirst._conversing`: a context keeps thinking conversations' histories cached only when
it holds a few). Why `seed-score` is not the default, and what each rule was measured against:
docs/design/routing.md.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import deque
from dataclasses import dataclass

from engine.core.snapshot import BackendSnapshot, Rates

from .cache_aware import CacheAware, RecentPrefixes, live_ids
from .policy import Policy, fmt_s, from_spec, make_score, seconds_for, step_seconds
from .types import BackendScore, RouteQuery

NAME = "finish-first"
HELP = ("Each request goes where its last token comes first, counting the queue ahead of it under "
        "the live cap, its prefill less what is cached there, and its decode at the per-sequence "
        "speed of the batch it joins; among a device's contexts, cache-aware chooses.")
PACK_NAME = NAME + ":pack"
PACK_HELP = ("The default: finish-first, with a device's contexts filled before another opens (new work "
             "joins the three contexts kept in use until each holds 32 requests, its cap or half its pool), "
             "while its requests do not resume conversations; a device serving conversations shares its "
             "new work out over its contexts.")
HEADROOM_CELLS = 16  # KV cells admission keeps free beyond a prompt (engine/sched/scheduler.py)
# A CPU backend whose peak decode is under this share of a GPU device's (the sum over its contexts)
# gets nothing (an H200's 15-thread CPU is ~4 % of one context; the study's M2 CPU, 15 % of its GPU, keeps its work).
MIN_PEAK_SHARE = 0.10
# `finish-first:pack`: of a device's contexts, a request goes to those in use (holding requests, or
# its prefix); another opens only when every one in use is full (`FinishFirst._full`): its live cap
# taken, or its pool used past OPEN_KV_SHARE (every step of a unified pool attends over the cells in
# use).
OPEN_KV_SHARE = 0.5
# At least MIN_CONTEXTS of a device's contexts stay in use, and one in use is full at FILL requests
# (or its live cap, if lower; `fill=0` in the spec: the live cap alone). A context filled to a live
# cap that had climbed to 64 decoded every token slower than two contexts at 32; one kept in use
# took a fresh server's whole first burst. Three, not two, because long prompts' private cells
# make every step of a unified pool attend over more: they ran fastest on three contexts, and
# tenants and the study lost nothing (docs/design/routing.md; docs/performance.md has the figures).
MIN_CONTEXTS = 3
FILL = 32
# STRICT (`strict=1`): a full context takes no new work while one in use is not full, and once all
# are, the request goes to the context that opens; `strict=0`: `cache-aware` chooses among every one in
# use, full or not, and the one that opens.
STRICT = 0
# ...unless the device serves conversations: at least CONVERSING_SHARE of the last CONVERSING_WINDOW
# requests routed to it resumed an earlier request's own history there (RouteQuery.resumed_on, at
# least RESUMED_MIN tokens: a turn's message and reply, not a chat template's few tokens).
# Conversations keep their histories cached between turns only where each context holds a few
# (`FinishFirst._conversing`), so the device's new work is shared out over its contexts.
CONVERSING_SHARE = 0.25
CONVERSING_WINDOW = 32
RESUMED_MIN = 64
# ...and one of its last CONVERSING_RECENT did: once they stop (the chats ended, tenants came), the
# device packs again after as many requests, not after the CONVERSING_WINDOW it took to forget
# them. A chat workload resumes 7 requests of 8 in steady state.
CONVERSING_RECENT = 8


@functools.lru_cache(maxsize=256)
def _peak_decode(rates: Rates, up_to: int) -> float:
    """`Rates.peak_decode_tok_s` (up to `up_to` step times), once per rates and ceiling: it is
    asked of every backend for every request on a GPU machine with a CPU backend, and the rates
    change only when they are measured again."""
    return rates.peak_decode_tok_s(up_to)


@dataclass(frozen=True, slots=True)
class Finish:
    """When the new request would finish on one backend, and its parts (seconds from now)."""

    finish_s: float
    wait_s: float  # until it is admitted (the queue ahead of it, their prefills included)
    prefill_tokens: int  # its own uncached prompt
    prefill_s: float  # its own prefill
    batch: int  # the batch it joins
    decode_s: float  # from its first token's step to its last
    all_prefill_tokens: int  # prefill counted until it finishes (the queue's and its own)
    all_decode_tokens: int  # tokens every sequence decodes until then
    all_prefill_s: float
    all_decode_s: float


def finish_time(query: RouteQuery, snap: BackendSnapshot, cached: int | None = None) -> Finish:
    """The new request's finish on `snap`'s backend if it were sent there now.

    An event per sequence completion: O(items x cap). `cached` overrides the query's cached
    prefix on this backend."""
    rates = snap.rates
    cap = max(snap.cap, 1)
    hit = query.cached_on(snap.name) if cached is None else min(max(int(cached), 0), query.prompt_tokens)
    room = snap.kv_cells_total - snap.cache.pinned_tokens if snap.kv_cells_total else math.inf
    t = 0.0
    prefill_tokens = decode_tokens = 0
    prefill_s = decode_s = 0.0
    active: list[list] = []  # [decode left, is the new request, private KV cells now]
    for item in snap.running:
        prefill_tokens += item.prefill_left
        if item.decode_left > 0:
            active.append([item.decode_left, False, item.prompt_tokens - item.cached_tokens + item.generated])
    own = query.prompt_tokens - hit
    queue = deque((i.prefill_left, i.decode_left, False) for i in snap.waiting)
    queue.append((own, max(query.max_tokens, 1), True))
    pre = seconds_for(prefill_tokens, rates.prefill_tok_s)
    prefill_s += pre
    t += pre
    admitted_at = own_prefill_s = -1.0
    batch = 0
    used = sum(e[2] for e in active)
    while True:
        while queue and len(active) < cap and (not active or used + queue[0][0] + HEADROOM_CELLS <= room):
            p, d, is_new = queue.popleft()
            s = seconds_for(p, rates.prefill_tok_s)
            if is_new:
                admitted_at, own_prefill_s = t, s
            prefill_tokens += p
            prefill_s += s
            t += s
            used += p
            if d > 0:
                active.append([d, is_new, p])
            if is_new:
                batch = len(active)
        if not active:
            break
        b = len(active)
        k = min(e[0] for e in active)
        dt = k * step_seconds(rates, b)
        decode_s += dt
        t += dt
        decode_tokens += k * b
        used += k * b  # every running sequence took k cells
        done = False
        left = []
        for e in active:
            e[0] -= k
            e[2] += k
            if e[0] > 0:
                left.append(e)
            else:
                used -= e[2]  # a finished sequence's cells are freed (or cached, so evictable)
                done = done or e[1]
        active = left
        if done:
            break
    return Finish(finish_s=t, wait_s=admitted_at, prefill_tokens=own, prefill_s=own_prefill_s, batch=batch,
                  decode_s=t - admitted_at - own_prefill_s, all_prefill_tokens=prefill_tokens,
                  all_decode_tokens=decode_tokens, all_prefill_s=prefill_s, all_decode_s=decode_s)


class FinishFirst(Policy):
    """Lowest `finish_time()` wins, device by device; ties go to the first backend in order. The
    budget mode is ignored. Prefixes routed to a backend in the last `RecentPrefixes.window`
    requests count as cached there (they are computed once, then shared).

    The contexts one spec made on one device (`contexts=N`, the default on a GPU; their
    snapshots share a `group`) are not separate machines: they share its compute, so one
    context's finish, priced as if it had the device alone, says little about its neighbours'.
    The device whose best context finishes first wins; among its contexts that also finish
    before any other device would, `cache-aware` picks, keeping a tenant or a conversation
    where its prefix is cached while their loads stay in balance. Contexts chosen by finish
    alone moved conversations to slightly lighter contexts, leaving a private copy of each on
    two of them, where cache-aware kept them home."""

    name = NAME
    uses_budget = False

    def __init__(self, recent: RecentPrefixes | None = None, *, pack: bool = False,
                 min_contexts: int = MIN_CONTEXTS, fill: int = FILL, strict: int = STRICT):
        if min_contexts < 1 or fill < 0 or strict not in (0, 1):
            raise ValueError("min_contexts must be at least 1, fill at least 0 and strict 0 or 1")
        self.recent = recent or RecentPrefixes()
        self.pack = pack  # `finish-first:pack`: a device's contexts in use first (`_in_use`)
        self.min_contexts = min_contexts  # contexts kept in use, at least
        self.fill = fill  # requests a context in use holds before another opens (or its live cap; 0: that alone)
        self.strict = bool(strict)  # a full context takes no new work while another can (`_in_use`)
        if pack:
            self.name = PACK_NAME
        self.within = CacheAware()  # among the contexts of one device
        self._query: RouteQuery | None = None
        self._hashes: list[int] = []
        self._parts: dict[str, tuple[Finish, int, int]] = {}  # backend -> (finish, cached, of which in flight)
        self._group: dict[str, str] = {}  # backend -> the group of contexts sharing its device
        self._within: dict[str, BackendScore] = {}  # grouped backend -> its cache-aware score
        self._speed: dict[str, tuple[Rates, int]] = {}  # backend -> its rates and cap ceiling
        self._snaps: dict[str, BackendSnapshot] = {}  # grouped backend -> its snapshot (`_in_use`)
        self._resumes: dict[str, deque[bool]] = {}  # group -> whether its last requests resumed one

    def score(self, query, snap, budget):
        if self._query is not query:
            self._query = query
            self._parts, self._group, self._within, self._speed, self._snaps = {}, {}, {}, {}, {}
            self._hashes = self.recent.hashes(query.tokens) if query.tokens else []
        held = query.cached_on(snap.name)
        routed = self.recent.match_on(self._hashes, snap.name, live_ids(snap))
        hit = max(held, min(routed, query.prompt_tokens))
        f = finish_time(query, snap, hit)
        self._parts[snap.name] = (f, hit, hit - held)
        self._speed[snap.name] = (snap.rates, snap.cap_ceiling or snap.cap)
        if snap.group:
            self._group[snap.name] = snap.group
            self._within[snap.name] = self.within.score(query, snap, budget)
            self._snaps[snap.name] = snap
        return make_score(snap, hit, f.all_prefill_tokens, f.all_decode_tokens, f.all_prefill_s, f.all_decode_s)

    def choose(self, query, scores):
        eligible, slow = self._fast_enough([s for s in scores if s.eligible], query)
        first = min(eligible, key=lambda s: s.score_s)  # min() keeps the first of equal scores
        group = self._group.get(first.name) if self._query is query else None
        grouped = [s for s in eligible if group is not None and self._group.get(s.name) == group]
        # The device's best context stands for it against the other devices; a context that
        # would finish later than another device does not take part.
        others = sorted((s for s in eligible if s not in grouped and s is not first), key=lambda s: s.score_s)
        contexts = [s for s in grouped if not others or s.score_s <= others[0].score_s]
        narrowed = ""
        if self.pack and group is not None:
            resumes = any(query.resumed_on(s.name) >= RESUMED_MIN for s in grouped)
            conversing = self._conversing(group, resumes)
            if conversing and resumes:
                narrowed = f"{conversing}this one resumes one: "
            elif conversing:
                contexts = [min(contexts, key=lambda s: len(self._snaps[s.name].items))]  # the first of equals
                narrowed = f"{conversing}a new one goes to the context holding fewest: "
            elif len(contexts) > 1:
                contexts, narrowed = self._in_use(contexts, query, resumes)
        if len(contexts) > 1:
            best_name, why = self.within.choose(query, [self._within[s.name] for s in contexts])
            best = next(s for s in contexts if s.name == best_name)
            reason = (f"{group} finishes first: {self._explain(first)}; {narrowed}of its {len(contexts)} contexts, "
                      f"cache-aware: {why}")
        elif narrowed:
            best = contexts[0]
            reason = f"{group} finishes first: {self._explain(first)}; {narrowed}sent to {best.name}"
            self.within.pinned(query, best.name)
        else:
            best = first
            reason = f"{best.name} finishes first: {self._explain(best)}"
            if self._within.get(best.name) is not None:
                self.within.pinned(query, best.name)  # its memory of where prompts went stays whole
        if others:
            rel = "ties with" if others[0].score_s == first.score_s else "before"
            reason += f"; {rel} {self._explain(others[0])}"
            if rel == "ties with":
                reason += f" (the tie goes to {first.name}, first in order)"
        if slow:
            reason += f"; {slow}"
        skipped = [s.name for s in scores if not s.eligible]
        if skipped:
            reason += f" ({', '.join(skipped)} unhealthy)"
        self._record(query, best.name)
        return best.name, reason

    def _conversing(self, group: str, resumes: bool) -> str:
        """Whether `group`'s device serves conversations, as a phrase ("" if not), counting
        this request (`resumes`: it resumes an earlier one's own history on one of the
        device's contexts): at least CONVERSING_SHARE of its last CONVERSING_WINDOW requests
        did. Then each new conversation goes to the context holding the fewest requests, and a
        resumed one where cache-aware sends it (home). Packed, chats went onto a few contexts,
        which could not keep every thinking conversation's history cached; shared out, nearly
        all later turns found theirs (docs/design/routing.md). Rules that judged a context full
        once it shed or recomputed histories came too late: a conversation is placed at its
        first turn. A tenant's request or a one-shot prompt
        resumes nothing, so such traffic stays packed."""
        window = self._resumes.setdefault(group, deque(maxlen=CONVERSING_WINDOW))
        window.append(resumes)
        n = sum(window)
        if n == 0 or n < CONVERSING_SHARE * len(window):
            return ""
        if not any(itertools.islice(reversed(window), CONVERSING_RECENT)):
            return ""  # the conversations ended
        return f"it serves conversations ({n} of its last {len(window)} requests resumed one); "

    def _in_use(self, contexts: list[BackendScore], query, resumes: bool = False) -> tuple[list[BackendScore], str]:
        """The contexts of one device a request may go to, and a phrase on why ("" or ending in
        a space): those in use (holding requests, or at least half of this prompt cached or
        routed there); while fewer than `min_contexts` are in use, the first idle one alone, unless
        the request `resumes` its own history on one of them (left to cache-aware beside them, the
        idle one got nothing: the contexts holding a long prompt's shared prefix drew every
        request; a shared prefix is copied once, a conversation's history stays home); and, when
        every one in use is full (`_full`), the first idle one too. Each context's step reads all
        the weights and runs its own host work, so a device runs fastest on the fewest contexts
        that hold its load (spread over eight, four tenants ran slower than on two), and opens
        more as they fill."""
        need = max(1, query.prompt_tokens // 2)
        busy = self._holding_the_load([s for s in contexts if self._snaps[s.name].items or s.cached_tokens >= need])
        busy += [s for s in contexts if s not in busy and resumes and query.resumed_on(s.name) >= RESUMED_MIN]  # its home
        idle = [s for s in contexts if s not in busy and not self._snaps[s.name].items]
        if not idle:
            return busy, ""
        if not busy:
            first = idle[:self.min_contexts]
            return first, f"all {len(idle)} idle, the first{f' {len(first)}' if len(first) > 1 else ''}: "
        if len(busy) < self.min_contexts and not resumes:
            return idle[:1], f"{len(busy)} in use, so {idle[0].name} opens ({self.min_contexts} kept in use): "
        full = [self._full(s, query) for s in busy]
        if all(full):
            why = "; ".join(f"{s.name} {f}" for s, f in zip(busy, full))
            opened = idle[:1] if self.strict else busy + idle[:1]
            return opened, f"every context in use is full ({why}), so {idle[0].name} opens; "
        if self.strict and any(full):
            room = [s for s, f in zip(busy, full) if not f]
            why = "; ".join(f"{s.name} {f}" for s, f in zip(busy, full) if f)
            return room, f"{len(room)} of {len(busy)} in use not full ({why}); "
        return busy, f"{len(busy)} in use, {len(idle)} idle until those are full; "

    def _holding_the_load(self, busy: list[BackendScore]) -> list[BackendScore]:
        """Of the contexts in use, the busiest that hold the device's requests (each up to its
        live cap or `fill`), at least `min_contexts`; the others take no new work and drain.
        After a burst spread over more contexts (96 chats over eight, then tenants that
        resumed nothing), every context still held requests, so all of them stayed in use and
        stepped side by side with small batches; this brings the device back to the fewest
        contexts that hold its load."""
        if len(busy) <= self.min_contexts:
            return busy
        held = [len(self._snaps[s.name].items) for s in busy]
        total = sum(held) + 1  # this request too
        order = sorted(range(len(busy)), key=lambda i: -held[i])  # the busiest first, ties in order
        keep: list[int] = []
        room = 0
        for i in order:
            keep.append(i)
            snap = self._snaps[busy[i].name]
            room += min(max(snap.cap, 1), self.fill) if self.fill else max(snap.cap, 1)
            if len(keep) >= self.min_contexts and room >= total:
                break
        return [busy[i] for i in sorted(keep)]

    def _full(self, s: BackendScore, query) -> str:
        """Why a context takes no more new work before another opens ("" if it does): the
        requests it holds reach its live cap or `fill`, or its pool would be used past
        OPEN_KV_SHARE with this prompt."""
        snap = self._snaps[s.name]
        own = query.prompt_tokens - s.cached_tokens
        total = snap.kv_cells_total
        if len(snap.items) >= max(snap.cap, 1):
            return f"holds {len(snap.items)} at cap {snap.cap}"
        if self.fill and len(snap.items) >= self.fill:
            return f"holds {len(snap.items)}, filled at {self.fill}"
        if total > 0 and snap.kv_cells_used + own + HEADROOM_CELLS > OPEN_KV_SHARE * total:
            return f"would use {snap.kv_cells_used + own:,} of {total:,} KV cells"
        return ""

    def _fast_enough(self, eligible: list[BackendScore], query) -> tuple[list[BackendScore], str]:
        """The eligible backends less a CPU whose peak decode is under MIN_PEAK_SHARE of a GPU
        device's, and a sentence on those left out ("" if none). A device's peak is the sum of
        its contexts' (the backends of one `group` share it): under online rates each context
        measures only its share of the GPU, and one context's peak set beside a CPU's let a
        15-thread CPU back into the default's choice on an H200 running eight contexts.
        Only a CPU beside a GPU: that is what was measured (a CPU
        slowed by the GPU's own host threads), and backends of one kind, such as a fleet's
        engines, differ by the noise of their calibrations rather than by what they can do on a
        loaded machine. Peaks are worked out only when a CPU and a GPU are both eligible."""
        speed = self._speed if self._query is query else {}
        known = [s for s in eligible if s.name in speed]
        kinds = {s.device for s in known}
        if "cpu" not in kinds or not any(k.startswith("gpu") for k in kinds):
            return eligible, ""
        peak = {s.name: _peak_decode(*speed[s.name]) for s in known}
        devices: dict[str, float] = {}  # each GPU device (a group, or a backend of its own): its peak
        for s in known:
            if s.device.startswith("gpu"):
                device = self._group.get(s.name) or s.name
                devices[device] = devices.get(device, 0.0) + peak[s.name]
        top, top_peak = max(devices.items(), key=lambda kv: kv[1])
        out = [s for s in known if s.device == "cpu" and peak[s.name] < MIN_PEAK_SHARE * top_peak]
        if not out:
            return eligible, ""
        names = "; ".join(f"{self._explain(s)}, peak {peak[s.name]:,.0f} tok/s ({peak[s.name] / top_peak:.1%})"
                          for s in out)
        why = f"left out, under {MIN_PEAK_SHARE:.0%} of {top}'s peak decode of {top_peak:,.0f} tok/s: {names}"
        return [s for s in eligible if s not in out], why

    def pinned(self, query, backend):
        if self._within.get(backend) is not None and self._query is query:
            self.within.pinned(query, backend)
        self._record(query, backend)

    def _record(self, query, backend):
        if self._hashes and self._query is query:
            self.recent.record(self._hashes, backend, query.request_id)
        self._query = None

    def _explain(self, s: BackendScore) -> str:
        q = self._query
        part = self._parts.get(s.name) if q is not None else None
        if q is None or part is None:
            return f"{s.name} in {fmt_s(s.score_s)}"
        f, hit, in_flight = part
        if not math.isfinite(f.finish_s):
            return f"{s.name} never (no rate)"
        cached = ""
        if hit:
            cached = f", {hit:,} cached" + (f" ({in_flight:,} routed there, in flight)" if in_flight else "")
        per_seq = q.max_tokens / f.decode_s if f.decode_s > 0 else math.inf
        return (f"{s.name} in {f.finish_s:.3f} s (waits {f.wait_s:.3f} s behind {s.n_running} running + "
                f"{s.n_waiting} queued under cap {s.cap}; prefills {f.prefill_tokens:,} of {q.prompt_tokens:,} "
                f"tokens in {f.prefill_s:.3f} s{cached}; decodes {q.max_tokens:,} tokens at batch {f.batch} "
                f"in {f.decode_s:.3f} s, {per_seq:.0f} tok/s for it)")


PACK_PARAMS: dict[str, type[int] | type[float]] = {"min_contexts": int, "fill": int, "strict": int}


def pack_from_spec(spec: str) -> FinishFirst:
    """`finish-first:pack:KEY=VALUE,...`: the packed policy with `min_contexts` (a device's contexts
    kept in use, at least; MIN_CONTEXTS) and `fill` (the requests a context in use holds before
    another opens, or its live cap if lower; FILL; 0: the live cap alone) and `strict` (1: a full context
    takes no new work while another can; STRICT)."""
    return from_spec(spec, PACK_NAME, PACK_PARAMS, lambda **kw: FinishFirst(None, pack=True, **kw))
