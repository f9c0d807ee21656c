"""Routing: which backend takes a whole new request.

Policies are pure functions over `BackendSnapshot`s (no model, no threads), so they can be
tested with hand-built snapshots and replayed from recorded decisions. `Router` holds the
current policy, the decode-budget mode and a bounded history of `RoutingDecision`s, and
guards them with one lock. Two policies keep state of their own under that lock: `round-robin`
its turn and `cache-aware` where recent prompts and tenants went; a new policy (`set_policy`, `clear`)
starts fresh.

Policies (`POLICIES`, `make_policy()`):

- `seed-score`: the study's score, exactly (`seed_score()`; SEED.md's golden numbers).
- `predicted-finish`: when the new request would finish on each backend, simulated under the
  backend's cap with the batch-aware step time `Rates.step_s(b)` (`predicted_finish()`).
- `least-work`: fewest remaining tokens (prefill + decode), rates ignored.
- `round-robin`: cycle through the eligible backends.
- `cache-aware`: prefix affinity for whole tenants (requests sharing a hit-sized prefix),
  balanced by moving small tenants off a busier backend; a new prefix, or one whose backend is
  beyond balance, goes where its predicted first token is soonest, which prices the prefill a
  cache hit saves against the queueing delay (`CacheAware`; SGLang router's `cache_aware` and
  Dynamo's KV router are its models).
- `only:NAME`, `gpu-only`, `cpu-only`: everything to one backend.

Decode budget (`BUDGET_MODES`, applies to `seed-score` and `least-work`):

- `raw`: the study's rule, every item counts its unused `max_tokens` budget.
- `ratio`: SGLang's `new_token_ratio` heuristic. Running items' remaining budget is scaled
  by `NewTokenRatio.value`; queued items and the new request count their full budget, as
  SGLang reserves the full (clipped) budget for a request it is about to admit. The ratio
  starts at 0.7 and decays by a fixed step after each routed request toward a 0.1 floor;
  the engine calls `Router.reset_ratio()` when a backend has to retract/preempt work.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from engine.core.errors import BackendUnavailable, InvalidRequest
from engine.core.request import CHARS_PER_TOKEN
from engine.core.snapshot import BackendSnapshot, Rates, WorkItem

if TYPE_CHECKING:
    from engine.core.request import Request

BUDGET_MODES = ("raw", "ratio")
DEFAULT_POLICY = "seed-score"
DEFAULT_HISTORY = 1000


# ---- values ----


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """What the router needs to know about a new request.

    `cached` maps backend name to the prefix tokens that backend's cache already holds for
    this prompt (a missing name means 0). `backend` pins the request to one backend.
    `tokens`, when given, are the prompt's token ids: `cache-aware` remembers where recent
    prompts went, so requests sharing a prefix that is still being computed find it too, and
    groups requests by shared prefix (tenants). `text` is the prompt as text where no token ids
    are at hand (a router in front of remote engines): `cache-aware` uses it the same way, in
    blocks of characters.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    cached: Mapping[str, int] = field(default_factory=dict)
    backend: str | None = None
    tokens: tuple[int, ...] = field(default=(), repr=False)
    text: str = field(default="", repr=False)
    # A request its backend gave back (it failed or restarts): that backend's name, and the
    # output tokens it had streamed, which the new backend continues from (0: from the prompt).
    moved_from: str | None = None
    continued: int = 0

    @classmethod
    def from_request(cls, request: "Request", cached: Mapping[str, int] | None = None,
                     moved_from: str | None = None, continued: int = 0) -> "RouteQuery":
        """Build the query for an engine `Request` and its per-backend cache matches."""
        return cls(
            moved_from=moved_from,
            continued=continued,
            request_id=request.id,
            prompt_tokens=request.prompt_estimate,
            max_tokens=request.sampling.max_tokens,
            cached=dict(cached or {}),
            backend=request.backend,
            tokens=tuple(request.prompt_tokens),
            text="" if request.prompt_tokens else _prompt_text(request),
        )

    def cached_on(self, backend: str) -> int:
        """Cached prefix tokens on `backend`, clamped to [0, prompt_tokens]."""
        return min(max(int(self.cached.get(backend, 0)), 0), self.prompt_tokens)

    def prefill_on(self, backend: str) -> int:
        """Prompt tokens the new request would still have to compute on `backend`."""
        return self.prompt_tokens - self.cached_on(backend)


@dataclass(frozen=True, slots=True)
class BackendScore:
    """One backend's side of a routing decision.

    `prefill_tokens` and `decode_tokens` are the totals the score counted (work already on the
    backend plus the new request); `prefill_s + decode_s == score_s`. Lower `score_s` is better.
    For `predicted-finish`, `score_s` is the predicted finish time of the new request and
    `decode_tokens` the tokens all sequences decode until then.
    """

    name: str
    device: str
    cached_tokens: int
    prefill_tokens: float
    decode_tokens: float
    prefill_s: float
    decode_s: float
    score_s: float
    rates: Rates
    n_running: int
    n_waiting: int
    cap: int
    eligible: bool

    @property
    def work_tokens(self) -> float:
        """Prefill plus decode tokens: the `least-work` measure."""
        return self.prefill_tokens + self.decode_tokens

    def to_dict(self) -> dict:
        d = {f.name: _json_number(getattr(self, f.name)) for f in fields(self) if f.name != "rates"}
        d["rates"] = {f.name: _json_number(getattr(self.rates, f.name)) for f in fields(self.rates)}
        return d


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """Where one request went and why, with every backend's score at that instant."""

    time: float
    request_id: str
    policy: str
    backend: str
    reason: str
    scores: tuple[BackendScore, ...]
    budget: str = "raw"
    new_token_ratio: float | None = None
    pinned: bool = False
    moved_from: str | None = None  # the backend that gave the request back (`RouteQuery`)
    continued: int = 0  # output tokens streamed there, continued here

    def score_of(self, backend: str) -> BackendScore:
        """The score entry for `backend` (KeyError if it was not in the snapshot)."""
        for s in self.scores:
            if s.name == backend:
                return s
        raise KeyError(backend)

    @property
    def chosen(self) -> BackendScore:
        return self.score_of(self.backend)

    def to_dict(self) -> dict:
        return {
            "time": self.time,
            "request_id": self.request_id,
            "policy": self.policy,
            "backend": self.backend,
            "reason": self.reason,
            "budget": self.budget,
            "new_token_ratio": self.new_token_ratio,
            "pinned": self.pinned,
            "moved_from": self.moved_from,
            "continued": self.continued,
            "scores": [s.to_dict() for s in self.scores],
        }


@dataclass(frozen=True, slots=True)
class DecodeBudget:
    """How remaining decode budgets are counted: `raw`, or running items scaled by `ratio`."""

    mode: str = "raw"
    ratio: float = 1.0

    def running(self, decode_left: int) -> float:
        """The decode tokens a running item counts for."""
        return decode_left * self.ratio if self.mode == "ratio" else decode_left


RAW = DecodeBudget()


class NewTokenRatio:
    """SGLang's `new_token_ratio`: the share of running requests' budget expected to be used.

    A heuristic, not a prediction: it starts at `initial` (0.7), `step()` lowers it by `decay`
    toward `floor` (0.1), and `reset()` returns it to `initial` (SGLang does so when it had to
    retract requests, i.e. when the estimate proved too optimistic). The default decay
    reaches the floor after 60 steps. Not thread-safe on its own; `Router` holds it under its
    lock.
    """

    def __init__(self, initial: float = 0.7, floor: float = 0.1, decay: float = 0.01):
        if not 0 < floor <= initial <= 1:
            raise ValueError(f"need 0 < floor <= initial <= 1, got floor={floor}, initial={initial}")
        if decay < 0:
            raise ValueError(f"decay must be >= 0, got {decay}")
        self.initial = initial
        self.floor = floor
        self.decay = decay
        self.value = initial

    def step(self) -> float:
        """Decay once toward the floor; return the new value."""
        self.value = max(self.floor, self.value - self.decay)
        return self.value

    def reset(self) -> float:
        """Back to the initial value; return it."""
        self.value = self.initial
        return self.value

    def __repr__(self) -> str:
        return f"NewTokenRatio(value={self.value:.3f}, initial={self.initial}, floor={self.floor})"


# ---- scores: pure functions of (query, snapshot) ----


def seed_score(query: RouteQuery, snap: BackendSnapshot, budget: DecodeBudget = RAW) -> BackendScore:
    """The study's score for sending `query` to `snap`'s backend (lower wins).

    score = (sum of prefill_left over running and queued items + new prompt - cached) / prefill rate
          + (sum of decode_left over running and queued items + new max_tokens) / decode rate

    Queued items carry the cache estimate made when they were routed (`WorkItem.prefill_left`).
    With a `ratio` budget, running items' decode_left is scaled (see module docstring).
    """
    cached = query.cached_on(snap.name)
    prefill = sum(i.prefill_left for i in snap.items) + (query.prompt_tokens - cached)
    decode = sum(budget.running(i.decode_left) if i.running else i.decode_left for i in snap.items)
    decode += query.max_tokens
    prefill_s = _seconds(prefill, snap.rates.prefill_tok_s)
    decode_s = _seconds(decode, snap.rates.decode_tok_s)
    return _score(snap, cached, prefill, decode, prefill_s, decode_s)


def predicted_finish(query: RouteQuery, snap: BackendSnapshot, cached: int | None = None) -> BackendScore:
    """Seconds until the new request's last token if it were sent to `snap`'s backend now.

    Model (event-driven, one event per sequence completion, so O(items x cap) work):

    - Running items are active; any `prefill_left` they still have is paid first.
    - The queue, then the new request last (FCFS), is admitted while fewer than `cap`
      sequences are active and the KV cells they reserve fit: each reserves its uncached
      prompt plus its whole decode budget (the backend's admission rule), out of the context's
      cells minus pinned cached prefixes. So a GPU whose memory, not its cap, bounds
      concurrency is seen to queue. Admitting an item costs `prefill_left / prefill_tok_s` seconds
      during which nothing decodes: llama.cpp puts prompt chunks into the same batch as the
      decode tokens, so a step with a prompt chunk is longer by about the chunk's prefill time.
    - With `b` active sequences, one decode step takes `rates.step_s(b)` (alpha + beta*b when
      calibrated, else b / decode_tok_s) and every active sequence spends one token of its
      `decode_left`. Sequences run their whole remaining budget (the study's budget rule, no
      early stops), so the estimate is pessimistic for chatty workloads.
    - The new request needs its prompt minus the cached prefix, then `max_tokens` steps.

    `prefill_s` is the prefill time paid before the new request finishes, `decode_s` the decode
    time; `decode_tokens` counts tokens decoded by all sequences over that span.
    """
    return _simulate(query, snap, query.cached_on(snap.name) if cached is None else cached)[1]


def predicted_first_token(query: RouteQuery, snap: BackendSnapshot, cached: int | None = None) -> BackendScore:
    """Seconds until the new request's first token if it were sent to `snap`'s backend now.

    The same model as `predicted_finish()`, stopped when the new request is admitted and its
    uncached prompt computed: the wait for a slot (or KV room), the prefill of everything
    admitted before it, and its own prefill. So a cache hit is priced in seconds of prefill
    saved, against the queueing delay of a busier backend. `cached` overrides the query's
    cache estimate for this backend (`cache-aware` adds prefixes still in flight).
    """
    return _simulate(query, snap, query.cached_on(snap.name) if cached is None else cached, first_only=True)[0]


def _simulate(query: RouteQuery, snap: BackendSnapshot, cached: int,
              first_only: bool = False) -> tuple[BackendScore, BackendScore]:
    """(first token, finish) of the new request on `snap`'s backend; see `predicted_finish()`.
    With `first_only` the run stops at the first token and both entries are that."""
    rates = snap.rates
    cap = max(snap.cap, 1)
    cached = min(max(int(cached), 0), query.prompt_tokens)
    prefill_tokens = 0
    decode_tokens = 0
    decode_s = 0.0
    first: tuple[int, int, float] | None = None  # (prefill tokens, decode tokens, decode s) at admission

    room = snap.kv_cells_total - snap.cache.pinned_tokens if snap.kv_cells_total else math.inf
    # Each active entry: [decode_left, is_new, KV cells reserved]
    active: list[list] = []
    for item in snap.running:
        prefill_tokens += item.prefill_left
        if item.decode_left > 0:
            active.append([item.decode_left, False, _cells(item)])
    queue: deque[tuple[int, int, bool, int]] = deque(
        (i.prefill_left, i.decode_left, False, _cells(i)) for i in snap.waiting
    )
    n_new = max(query.max_tokens, 1)
    queue.append((query.prompt_tokens - cached, n_new, True, query.prompt_tokens - cached + n_new))

    used = sum(entry[2] for entry in active)
    while True:
        while queue and len(active) < cap and (not active or used + queue[0][3] <= room):
            p, d, is_new, cells = queue.popleft()
            prefill_tokens += p
            used += cells
            if is_new:
                first = (prefill_tokens, decode_tokens, decode_s)
            if d > 0:
                active.append([d, is_new, cells])
        if not active or (first_only and first is not None):  # (no active: nothing left to decode)
            break
        b = len(active)
        k = min(entry[0] for entry in active)
        decode_s += k * _step_s(rates, b)
        decode_tokens += k * b
        new_done = False
        remaining = []
        for entry in active:
            entry[0] -= k
            if entry[0] > 0:
                remaining.append(entry)
            else:
                used -= entry[2]
                new_done = new_done or entry[1]
        active = remaining
        if new_done:
            break

    if first is None:  # not admitted (cannot happen: the new request always has a token to decode)
        first = (prefill_tokens, decode_tokens, decode_s)
    f_prefill, f_decode, f_decode_s = first
    first_score = _score(snap, cached, f_prefill, f_decode, _seconds(f_prefill, rates.prefill_tok_s), f_decode_s)
    if first_only:
        return first_score, first_score
    finish = _score(snap, cached, prefill_tokens, decode_tokens, _seconds(prefill_tokens, rates.prefill_tok_s),
                    decode_s)
    return first_score, finish


def _cells(item: WorkItem) -> int:
    """KV cells the backend reserves for `item`: its uncached prompt and whole decode budget."""
    return item.prompt_tokens - item.cached_tokens + item.generated + item.decode_left


# ---- policies ----


class Policy:
    """Scores every backend and picks one. Subclasses override `score` and/or `choose`.

    The default scoring is the seed score, so baselines that ignore it (round-robin, only:)
    still record comparable numbers in their decisions.
    """

    name = ""
    uses_budget = True  # whether the decode-budget mode changes this policy's scores

    def score(self, query: RouteQuery, snap: BackendSnapshot, budget: DecodeBudget) -> BackendScore:
        return seed_score(query, snap, budget)

    def choose(self, query: RouteQuery, scores: Sequence[BackendScore]) -> tuple[str, str]:
        """Return (backend name, reason) among the eligible `scores` (at least one exists)."""
        raise NotImplementedError

    def pinned(self, query: RouteQuery, backend: str) -> None:
        """The request named its backend and bypassed `choose`: a stateful policy may note it."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class SeedScore(Policy):
    """The study's policy: lowest `seed_score()` wins; ties go to the first backend."""

    name = "seed-score"

    def choose(self, query, scores):
        return _lowest(scores, lambda s: s.score_s, _explain_seconds)


class PredictedFinish(Policy):
    """Lowest `predicted_finish()` wins; ties go to the first backend. Budget mode is ignored."""

    name = "predicted-finish"
    uses_budget = False

    def score(self, query, snap, budget):
        return predicted_finish(query, snap)

    def choose(self, query, scores):
        return _lowest(scores, lambda s: s.score_s, _explain_finish)


class LeastWork(Policy):
    """Fewest remaining tokens (prefill + decode, new request included); rates ignored."""

    name = "least-work"

    def choose(self, query, scores):
        return _lowest(scores, lambda s: s.work_tokens, _explain_work)


class RecentPrefixes:
    """Which backends recent prompts were routed to, by prefix blocks.

    A backend's prefix cache learns a prompt only once its prefill has run; until then a
    second request with the same prefix would find it nowhere. This remembers, for the last
    `window` routed requests, the chain of hashes of each prompt's `block`-token blocks (block
    k's hash covers tokens [0, (k+1) * block), so equal hashes mean equal prefixes: Dynamo's
    and vLLM's block hashing) and where that request went. `match()` answers, per backend, the
    longest remembered prefix in whole blocks. SGLang's router keeps such an approximate tree
    as its only cache knowledge; here it only fills the gap before the real cache reports.

    Bounded: at most `max_blocks` hashes, the oldest forgotten first. Not thread-safe alone;
    `Router` calls it under its lock.
    """

    def __init__(self, block: int = 32, window: int = 256, max_blocks: int = 1 << 16):
        if block < 1 or window < 1 or max_blocks < 1:
            raise ValueError(f"block, window and max_blocks must be >= 1 (got {block}, {window}, {max_blocks})")
        self.block = block
        self.window = window
        self.max_blocks = max_blocks
        self._serial = 0  # requests recorded so far
        self._blocks: OrderedDict[int, dict[str, int]] = OrderedDict()  # hash -> {backend: serial}

    def hashes(self, tokens: Sequence) -> list[int]:
        """Chained hashes of the prompt's whole blocks (a trailing partial block is left out):
        token ids, or a text's characters."""
        out: list[int] = []
        h = 0
        whole = isinstance(tokens, (str, tuple))  # their slices hash as they are
        for start in range(0, len(tokens) - self.block + 1, self.block):
            chunk = tokens[start:start + self.block]
            h = hash((h, chunk if whole else tuple(chunk)))
            out.append(h)
        return out

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Backend name -> prefix tokens routed there within the window (whole blocks)."""
        oldest = self._serial - self.window
        found: dict[str, int] = {}
        alive: set[str] | None = None
        for k, h in enumerate(hashes):
            seen = self._blocks.get(h)
            here = {b for b, serial in seen.items() if serial > oldest} if seen else set()
            alive = here if alive is None else alive & here
            if not alive:
                break
            for b in alive:
                found[b] = (k + 1) * self.block
        return found

    def record(self, hashes: Sequence[int], backend: str) -> None:
        """Remember that a prompt with these block hashes was routed to `backend`."""
        self._serial += 1
        for h in hashes:
            seen = self._blocks.get(h)
            if seen is None:
                seen = self._blocks[h] = {}
            else:
                self._blocks.move_to_end(h)
            seen[backend] = self._serial
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._serial = 0
        self._blocks.clear()


class CacheAware(Policy):
    """Prefix affinity for whole tenants, with their load balanced; the soonest first token
    when a prefix is new or its backend is overloaded.

    For comparable backends with different caches (two GPUs, tenants with long shared
    system prompts). Balance is counted in items, so on a GPU + CPU pair, where an item on the
    CPU costs many on the GPU, `predicted-finish` fits better. Per request:

    1. Each backend's hit is the longer of what its prefix cache holds for the prompt
       (`query.cached`) and what `RecentPrefixes` remembers routing there (prefixes still
       queued or in prefill). A hit is at least `cache_threshold` of the prompt.
    2. Requests that share a hit-sized prefix are one *tenant* (a group keyed by the hash of
       that prefix, from the token ids or, for text prompts, blocks of characters). A tenant
       has a home: the backend its last request went to. The affinity candidate `h` is the
       backend with the most cached tokens; among equal hits the tenant's home, then fewer
       items, then sooner first token, then backend order.
    3. Load is items held, running + waiting. Loads are *uneven* when `h`'s load exceeds the
       least-loaded backend's by more than `move_abs` items and by more than `move_rel` of
       the mean load; *beyond balance*, as in SGLang's router, when by more than `balance_abs`
       items AND `balance_rel` times.
    4. A hit on `h` with loads within balance: `h` wins (its cache stays warm for the tenant),
       unless loads are uneven. Then, if another backend also holds the hit and is less
       loaded, it takes the request (a hit there too, nothing lost); else, if the tenant is
       known (an earlier request of it was routed) and its own items on `h` are at most half
       the gap, the WHOLE tenant moves to the least-loaded
       backend (this request goes there, is remembered there, and becomes the tenant's home,
       so its next requests follow). Moving w items closes the gap by about 2w, so at most
       half the gap never turns the imbalance around (no move back and forth); and w is also
       about what the move costs: a Tandem engine caches a prompt when its request finishes,
       so the tenant's requests that reach the new backend before its first one there has
       finished (about as many as it holds now) each compute a private copy of the prefix.
       A tenant that is itself most of the gap stays. This is the partition of tenants by
       load: small tenants move off the busy backend until the hot ones have it to themselves.
    5. Otherwise (no real hit, or `h` is beyond balance) the cheapest backend wins. Its price
       is the predicted first token (`predicted_first_token()`: slot wait + the prefill queued
       ahead + the request's own uncached prefill, uncached meaning not in the backend's cache
       now: a prefix only remembered in flight is priced as computed again) plus the delay
       that own prefill adds to
       every item the backend already holds (`delay_weight` x items x prefill seconds: a
       prompt chunk stalls the whole batch's decoding). A new tenant lands where its first
       token is soonest; a hot tenant whose backend is saturated spills to the next one, which
       warms the same prefix, and from there equal hits spread by load (step 4). Ties go to
       fewer items, then to the backend whose cache holds fewer tokens (SGLang's smallest
       tree: cold tenants spread over the caches), then to backend order.

    Why whole tenants (docs/results/gpu/fleet2, two H200s, 8 Zipf tenants at 60/s): both
    cache-aware routers kept every tenant on one engine, but an unlucky first placement put
    the two hottest tenants (55 % of the traffic) on one engine, whose TTFT then ran 2-3x the
    other's for the whole run; loads were ~30 items apart, under SGLang's 32-item threshold, so
    nothing spilled, and at 4 items a spill of single requests of the hot tenant cost a
    private prefix copy each. Moving a small tenant closes the gap for the price of that
    tenant's first misses on the new engine.

    Defaults: `cache_threshold=0.5` (the match rate SGLang router's README gives as default);
    `balance_abs=32` items (SGLang router's default) and `balance_rel=1.5`; `move_abs=4`
    items and `move_rel=0.25` (a gap of a quarter of the mean load: between two backends of
    ~90 items each, the Poisson noise of the gap at 60/s is ~13 items, so a move answers a
    lasting imbalance more often than noise); `delay_weight=1`. On two H200s with Tandem
    engines at cap 32 (docs/results/gpu/fleet3), 32 items gave the lowest makespan of 4, 32
    and 1000 at 8 tenants (8.9 s vs 9.2 and 9.8; runs spread ±1 s) and at 32 (11.9 s vs 12.0;
    sglang-router 13.6, round-robin 14.5); 4 items spilled a tenant at every burst. In
    tests/test_router_sim.py's toy (two backends, 8 tenants, caches for 4 each), delay weights
    0, 1, 2 and 4 all beat an SGLang-style rule by 2-3 % of makespan and 15-30 % of median
    TTFT over 30 runs, and no weight won every run; 1 is the one that means something (each
    held item waits once). Scores are `predicted_first_token()` seconds, each with the hit it
    assumed; the price and any move are in `reason`.

    Memory is bounded: `RecentPrefixes`' window, the last `max_groups` tenants' homes and the
    last `max_members` requests' tenants.
    """

    name = "cache-aware"
    uses_budget = False
    max_groups = 4096
    max_members = 16384

    def __init__(self, cache_threshold: float = 0.5, balance_abs: int = 32, balance_rel: float = 1.5,
                 delay_weight: float = 1.0, recent: RecentPrefixes | None = None, *,
                 move_abs: int = 4, move_rel: float = 0.25):
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs < 0 or balance_rel < 1:
            raise ValueError(f"need balance_abs >= 0 and balance_rel >= 1, got {balance_abs}, {balance_rel}")
        if move_abs < 0 or move_rel < 0:
            raise ValueError(f"need move_abs >= 0 and move_rel >= 0, got {move_abs}, {move_rel}")
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.move_abs = move_abs
        self.move_rel = move_rel
        self.recent = recent or RecentPrefixes()
        # Text prompts (no token ids): the same memory in blocks of characters.
        self.recent_text = RecentPrefixes(block=self.recent.block * CHARS_PER_TOKEN, window=self.recent.window,
                                          max_blocks=self.recent.max_blocks)
        self.delay_weight = delay_weight
        self._query: RouteQuery | None = None  # the query the memos below belong to (held, so unique)
        self._hashes: list[int] = []
        self._memory: RecentPrefixes = self.recent
        self._remembered: dict[str, int] = {}
        self._cache_size: dict[str, int] = {}
        self._group: int | None = None  # the query's tenant (a prefix hash), None without one
        self._members: dict[str, int] = {}  # backend -> the tenant's items held there
        self._homes: OrderedDict[int, str] = OrderedDict()  # tenant -> backend of its last request
        self._tenant_of: OrderedDict[str, int] = OrderedDict()  # request id -> tenant

    def score(self, query, snap, budget):
        if self._query is not query:
            self._start(query)
        self._cache_size[snap.name] = snap.cache.cached_tokens
        if self._group is not None:
            self._members[snap.name] = sum(1 for i in snap.items if self._tenant_of.get(i.request_id) == self._group)
        held = query.cached_on(snap.name)
        remembered = min(self._remembered.get(snap.name, 0), query.prompt_tokens)
        # Priced on what the cache holds: a backend's prefix cache takes a sequence when it
        # finishes, so a request admitted while the prefix is still in flight there computes it
        # again (a cold prefill: 1,550 tokens at 73 tok/s is 21 s on one CPU core, not the
        # 1 s of a hit). The remembered prefix still draws affinity (`cached_tokens`).
        score = predicted_first_token(query, snap, held)
        return replace(score, cached_tokens=remembered) if remembered > held else score

    def _start(self, query: RouteQuery) -> None:
        """Memos for a new query: its block hashes, where they were routed, its tenant."""
        self._query = query
        self._cache_size = {}
        self._members = {}
        key: Sequence = query.tokens or query.text
        if query.tokens:
            self._memory, per_token = self.recent, 1
        else:
            self._memory, per_token = self.recent_text, CHARS_PER_TOKEN
        self._hashes = self._memory.hashes(key) if key else []
        remembered = self._memory.match(self._hashes) if self._hashes else {}
        self._remembered = {b: n // per_token for b, n in remembered.items()}
        self._group = self._tenant(self._hashes, self._memory.block // per_token, query.prompt_tokens)

    def _tenant(self, hashes: Sequence[int], block_tokens: int, prompt_tokens: int) -> int | None:
        """The tenant of a prompt: the deepest known tenant among its prefixes that cover at
        least `cache_threshold` of it, else a new one keyed by the shortest such prefix."""
        need = max(1, math.ceil(self.cache_threshold * prompt_tokens / max(block_tokens, 1)))
        if need > len(hashes):
            return None
        for k in range(len(hashes), need - 1, -1):
            if hashes[k - 1] in self._homes:
                return hashes[k - 1]
        return hashes[need - 1]

    def choose(self, query, scores):
        eligible = [s for s in scores if s.eligible]
        order = {s.name: k for k, s in enumerate(scores)}
        load = {s.name: s.n_running + s.n_waiting for s in eligible}
        price = {s.name: self._price(query, s, load[s.name]) for s in eligible}
        home = self._homes.get(self._group) if self._group is not None and self._query is query else None
        # Hits are compared in whole blocks (the memory's grain): a prefix remembered in flight
        # on the tenant's home (1,472 tokens) ties the same prefix cached elsewhere (1,500).
        grain = max(self.recent.block, 1)
        h = min(eligible, key=lambda s: (-(s.cached_tokens // grain), s.name != home, -s.cached_tokens, load[s.name],
                                         s.score_s, order[s.name]))
        least = min(eligible, key=lambda s: (load[s.name], s.score_s, order[s.name]))
        ranked = sorted(eligible, key=lambda s: (price[s.name][0], load[s.name], self._cache_size.get(s.name, 0),
                                                 order[s.name]))
        cheapest = ranked[0]
        lh, ll = load[h.name], load[least.name]
        need = max(1, self.cache_threshold * query.prompt_tokens)
        hit = h.cached_tokens >= need
        gap = lh - ll
        imbalanced = gap > self.balance_abs and lh > self.balance_rel * ll
        mean = sum(load.values()) / len(load)
        uneven = gap > self.move_abs and gap > self.move_rel * mean
        where = self._where(query, h)
        held = f"{h.name}: {h.cached_tokens:,} of {query.prompt_tokens:,} tokens {where}"
        mine = self._members.get(h.name, 0)

        if hit and not imbalanced:
            other_hits = [s for s in eligible if s is not h and s.cached_tokens >= need and load[s.name] < lh]
            lighter = min(other_hits, key=lambda s: (load[s.name], order[s.name])) if other_hits else None
            if uneven and lighter is not None and lh - load[lighter.name] > self.move_abs:
                chosen = lighter
                reason = (f"{held}, but loads {lh} vs {load[lighter.name]} on {lighter.name} are uneven "
                          f"(>{self.move_abs} apart and >{self.move_rel:.0%} of the mean {mean:.0f}); "
                          f"{lighter.name} holds {lighter.cached_tokens:,} too")
            elif uneven and home is not None and 2 * mine <= gap:
                chosen = least
                reason = (f"{held}, but loads {lh} vs {ll} on {least.name} are uneven (>{self.move_abs} apart "
                          f"and >{self.move_rel:.0%} of the mean {mean:.0f}): the tenant's {mine} item"
                          f"{'' if mine == 1 else 's'} on {h.name} are at most half the gap, so the tenant moves to {least.name} "
                          f"({least.cached_tokens:,} cached there)")
            else:
                chosen = h
                if least is h:
                    loads = f"least loaded too ({lh} items)"
                elif uneven and home is not None:
                    loads = (f"loads {lh} vs {ll} on {least.name} are uneven, but the tenant holds {mine} of "
                             f"{h.name}'s items: moving it would turn the gap around")
                else:
                    loads = f"loads {lh} vs {ll} on {least.name}, within balance"
                reason = f"{held}; {loads}"
        else:
            chosen = cheapest
            if hit:
                head = (f"{held}, but loads {lh} vs {ll} on {least.name} are beyond balance "
                        f"(>{self.balance_abs} apart and >{self.balance_rel:g}x)")
            else:
                best = (f"best {h.name}: {h.cached_tokens:,} of {query.prompt_tokens:,} tokens"
                        if h.cached_tokens else "nothing cached anywhere")
                head = f"no backend holds {self.cache_threshold:.0%} of the prompt ({best})"
            runner = ranked[1] if len(ranked) > 1 else None
            vs = f" vs {self._explain_price(runner, price, load)}" if runner else ""
            if hit and chosen is h:
                head += ", and it is still the cheapest"
            reason = f"{head}: {self._explain_price(chosen, price, load)}{vs}"
        if len(eligible) < len(scores):
            skipped = ", ".join(s.name for s in scores if not s.eligible)
            reason += f" ({skipped} unhealthy)"
        self._remember(query, chosen.name, home=True)
        return chosen.name, reason

    def _remember(self, query: RouteQuery, backend: str, home: bool) -> None:
        """Note where `query` went: its prefix blocks, its tenant's membership and home."""
        if self._query is not query:
            return
        if self._hashes:
            self._memory.record(self._hashes, backend)
        if self._group is not None:
            if home or self._group not in self._homes:
                self._homes[self._group] = backend
            self._homes.move_to_end(self._group)
            while len(self._homes) > self.max_groups:
                self._homes.popitem(last=False)
            self._tenant_of[query.request_id] = self._group
            while len(self._tenant_of) > self.max_members:
                self._tenant_of.popitem(last=False)
        self._query = None

    def _price(self, query: RouteQuery, s: BackendScore, load: int) -> tuple[float, float]:
        """(price, delay): the first-token time plus the delay its own prefill adds to the
        `load` items the backend holds (each waits that long once), weighted by `delay_weight`."""
        own = _seconds(query.prefill_on(s.name), s.rates.prefill_tok_s)
        delay = self.delay_weight * load * own if load else 0.0
        return s.score_s + delay, delay

    @staticmethod
    def _explain_price(s: BackendScore, price: dict, load: dict) -> str:
        total, delay = price[s.name]
        n = load[s.name]
        return (f"{s.name} first token in {_s(s.score_s)} + {_s(delay)} delay to its {n} item{'' if n == 1 else 's'} "
                f"({s.cached_tokens:,} cached)")

    def pinned(self, query, backend):
        self._remember(query, backend, home=False)

    @staticmethod
    def _where(query: RouteQuery, s: BackendScore) -> str:
        """Whether a hit is in the backend's cache or only remembered as routed there."""
        return "cached" if query.cached_on(s.name) >= s.cached_tokens else "routed there, in flight"


class RoundRobin(Policy):
    """Cycle through the backends in order, skipping ineligible ones."""

    name = "round-robin"

    def __init__(self):
        self._last: str | None = None

    def choose(self, query, scores):
        names = [s.name for s in scores]
        start = names.index(self._last) + 1 if self._last in names else 0
        for k in range(len(scores)):
            s = scores[(start + k) % len(scores)]
            if s.eligible:
                self._last = s.name
                return s.name, f"round-robin: {s.name}'s turn"
        raise BackendUnavailable("no healthy backend")


class OnlyBackend(Policy):
    """Everything to one backend (`only:NAME`) or to one kind of device (`gpu-only`, `cpu-only`).

    By device means the backends whose device is `cpu` (case-insensitive) for `cpu-only`, and
    those whose device is anything else (gpu, CUDA0, Metal...) for `gpu-only`: with several
    (two contexts on one GPU, several GPUs) the healthy one holding the fewest requests, the
    first in order on a tie.
    """

    def __init__(self, backend: str | None = None, device: str | None = None):
        if (backend is None) == (device is None):
            raise ValueError("give exactly one of backend, device")
        self.backend = backend
        self.device = device
        self.name = f"only:{backend}" if backend is not None else f"{device}-only"

    def choose(self, query, scores):
        if self.backend is not None:
            matches = [s for s in scores if s.name == self.backend]
            what = f"backend {self.backend!r}"
        else:
            matches = [s for s in scores if _device_kind(s.device) == self.device]
            what = f"a backend with device {self.device!r}"
        if not matches:
            raise BackendUnavailable(f"policy {self.name} needs {what}; backends: {_names(scores)}")
        if len(matches) > 1:
            healthy = [s for s in matches if s.eligible]
            if not healthy:
                raise BackendUnavailable(f"policy {self.name}: every backend of device {self.device!r} is unhealthy")
            target = min(healthy, key=lambda s: s.n_running + s.n_waiting)
            return target.name, (f"{self.name}: {target.name} holds the fewest requests "
                                 f"({target.n_running + target.n_waiting}) of {_names(matches)}")
        target = matches[0]
        if not target.eligible:
            raise BackendUnavailable(f"policy {self.name}: backend {target.name!r} is unhealthy")
        return target.name, f"{self.name}: everything goes to {target.name}"


POLICIES: dict[str, Callable[[], Policy]] = {
    "seed-score": SeedScore,
    "predicted-finish": PredictedFinish,
    "least-work": LeastWork,
    "round-robin": RoundRobin,
    "cache-aware": CacheAware,
    "gpu-only": lambda: OnlyBackend(device="gpu"),
    "cpu-only": lambda: OnlyBackend(device="cpu"),
}


def policy_names() -> list[str]:
    """Every valid policy name, with `only:NAME` and `cache-aware:KEY=VALUE,...` as patterns."""
    return [*POLICIES, "only:NAME", "cache-aware:KEY=VALUE,..."]


def make_policy(name: str) -> Policy:
    """A fresh policy for `name`; InvalidRequest otherwise.

    `name` is a `POLICIES` key, `only:NAME`, or `cache-aware:` with `CacheAware`'s parameters,
    e.g. `cache-aware:cache_threshold=0.3,balance_abs=8` (the policy's name is then that
    spec with the parameters in a fixed order, so `Router.clear()` rebuilds the same policy).
    """
    name = (name or "").strip()
    if name in POLICIES:
        return POLICIES[name]()
    if name.startswith("only:") and name[len("only:"):].strip():
        return OnlyBackend(backend=name[len("only:"):].strip())
    if name.startswith("cache-aware:"):
        return _cache_aware(name)
    raise InvalidRequest(
        f"unknown routing policy {name!r}; valid: {', '.join(policy_names())}", param="policy"
    )


_CACHE_AWARE_PARAMS = {"cache_threshold": float, "balance_abs": int, "balance_rel": float, "delay_weight": float,
                       "move_abs": int, "move_rel": float}


def _cache_aware(spec: str) -> "CacheAware":
    kw: dict = {}
    for item in filter(None, (p.strip() for p in spec[len("cache-aware:"):].split(","))):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq or key not in _CACHE_AWARE_PARAMS:
            raise InvalidRequest(f"policy {spec!r}: {item!r} is not one of "
                                 f"{', '.join(k + '=' for k in _CACHE_AWARE_PARAMS)}", param="policy")
        try:
            kw[key] = _CACHE_AWARE_PARAMS[key](value)
        except ValueError:
            raise InvalidRequest(f"policy {spec!r}: {key} must be a number", param="policy") from None
    try:
        policy = CacheAware(**kw)
    except ValueError as e:
        raise InvalidRequest(f"policy {spec!r}: {e}", param="policy") from None
    if kw:
        policy.name = "cache-aware:" + ",".join(f"{k}={kw[k]:g}" for k in _CACHE_AWARE_PARAMS if k in kw)
    return policy


# ---- router ----


class Router:
    """Routes requests with the current policy and remembers recent decisions.

    Thread-safe: `route`, `set_policy`, `set_budget`, `reset_ratio` and `recent` may be called
    from any thread; one lock serialises them (policies such as round-robin keep state).
    """

    def __init__(
        self,
        policy: str = DEFAULT_POLICY,
        budget: str = "raw",
        *,
        history: int = DEFAULT_HISTORY,
        ratio: NewTokenRatio | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._lock = threading.Lock()
        self._policy = make_policy(policy)
        self._budget = _check_budget(budget)
        self._ratio = ratio or NewTokenRatio()
        self._history: deque[RoutingDecision] = deque(maxlen=history)
        self._clock = clock

    @property
    def policy(self) -> str:
        return self._policy.name

    @property
    def budget(self) -> str:
        return self._budget

    @property
    def new_token_ratio(self) -> float:
        return self._ratio.value

    def set_policy(self, name: str) -> str:
        """Switch policy (fresh state); InvalidRequest listing valid names if unknown."""
        policy = make_policy(name)
        with self._lock:
            self._policy = policy
        return policy.name

    def set_budget(self, mode: str) -> str:
        """Switch the decode-budget mode (`raw` or `ratio`); InvalidRequest otherwise."""
        mode = _check_budget(mode)
        with self._lock:
            self._budget = mode
        return mode

    def reset_ratio(self) -> float:
        """Reset the `new_token_ratio` to its initial value (call on retraction/preemption)."""
        with self._lock:
            return self._ratio.reset()

    def route(self, query: RouteQuery, snapshots: Sequence[BackendSnapshot]) -> RoutingDecision:
        """Choose a backend for `query` among `snapshots` (in backend order) and record it.

        A pinned query (`query.backend`) bypasses the policy. Raises InvalidRequest for an
        unknown pinned backend, BackendUnavailable if the chosen/pinned backend or every
        backend is unhealthy.
        """
        if not snapshots:
            raise BackendUnavailable("no backends")
        with self._lock:
            policy = self._policy
            budget = self._budget
            ratio = self._ratio.value if budget == "ratio" else None
            decode_budget = DecodeBudget("ratio", ratio) if ratio is not None else RAW
            scores = tuple(policy.score(query, snap, decode_budget) for snap in snapshots)

            if query.backend is not None:
                backend, reason = _pin(query.backend, scores)
                policy.pinned(query, backend)
                pinned = True
            else:
                if not any(s.eligible for s in scores):
                    raise BackendUnavailable(f"no healthy backend among {_names(scores)}")
                backend, reason = policy.choose(query, scores)
                pinned = False

            if budget == "ratio":
                self._ratio.step()
            decision = RoutingDecision(
                time=self._clock(),
                request_id=query.request_id,
                policy=policy.name,
                backend=backend,
                reason=reason,
                scores=scores,
                budget=budget,
                new_token_ratio=ratio if policy.uses_budget else None,
                pinned=pinned,
                moved_from=query.moved_from,
                continued=query.continued,
            )
            self._history.append(decision)
            return decision

    def recent(self, n: int | None = None) -> list[RoutingDecision]:
        """The last `n` decisions (all kept if None), oldest first."""
        with self._lock:
            items = list(self._history)
        if n is None:
            return items
        return items[-n:] if n > 0 else []

    def clear(self) -> None:
        """Forget recorded decisions and policy state (e.g. between benchmark runs)."""
        with self._lock:
            self._history.clear()
            self._policy = make_policy(self._policy.name)
            self._ratio.reset()


# ---- internal helpers ----


def _prompt_text(request: "Request") -> str:
    """A text request's prompt as one string (messages joined role by role), for prefix hashing."""
    if request.text is not None:
        return request.text
    return "".join(f"<|{m.get('role', '')}|>{m.get('content') or ''}" for m in request.messages or ())


def _check_budget(mode: str) -> str:
    if mode not in BUDGET_MODES:
        raise InvalidRequest(
            f"unknown decode budget mode {mode!r}; valid: {', '.join(BUDGET_MODES)}", param="budget"
        )
    return mode


def _device_kind(device: str) -> str:
    return "cpu" if device.strip().lower() == "cpu" else "gpu"


def _pin(name: str, scores: Sequence[BackendScore]) -> tuple[str, str]:
    for s in scores:
        if s.name == name:
            if not s.eligible:
                raise BackendUnavailable(f"backend {name!r} is unhealthy")
            return name, f"pinned to {name} by the request (policy bypassed)"
    raise InvalidRequest(f"unknown backend {name!r}; backends: {_names(scores)}", param="backend")


def _seconds(tokens: float, rate: float) -> float:
    if tokens <= 0:
        return 0.0
    return tokens / rate if rate > 0 else math.inf


def _step_s(rates: Rates, batch: int) -> float:
    if not (rates.step_alpha_s or rates.step_beta_s) and rates.decode_tok_s <= 0:
        return math.inf
    return rates.step_s(batch)


def _score(snap, cached, prefill, decode, prefill_s, decode_s) -> BackendScore:
    return BackendScore(
        name=snap.name,
        device=snap.device,
        cached_tokens=cached,
        prefill_tokens=prefill,
        decode_tokens=decode,
        prefill_s=prefill_s,
        decode_s=decode_s,
        score_s=prefill_s + decode_s,
        rates=snap.rates,
        n_running=len(snap.running),
        n_waiting=len(snap.waiting),
        cap=snap.cap,
        eligible=snap.healthy,
    )


def _lowest(scores, key, explain) -> tuple[str, str]:
    """Eligible entry with the lowest key (first wins ties) and the explanation against the runner-up."""
    eligible = [s for s in scores if s.eligible]
    best = min(eligible, key=key)  # min() keeps the first of equal keys
    others = [s for s in eligible if s is not best]
    if not others:
        skipped = [s.name for s in scores if not s.eligible]
        why = f" ({', '.join(skipped)} unhealthy)" if skipped else ""
        return best.name, f"only eligible backend{why}: " + explain(best, None)
    runner_up = min(others, key=key)
    return best.name, explain(best, runner_up)


def _s(seconds: float) -> str:
    return f"{seconds:.3f} s" if math.isfinite(seconds) else "never (no rate)"


def _runner_up(eligible: Sequence[BackendScore], best: BackendScore) -> BackendScore:
    others = [s for s in eligible if s is not best]
    return min(others, key=lambda s: s.score_s) if others else best


def _explain_seconds(best: BackendScore, other: BackendScore | None) -> str:
    if other is None:
        return f"{best.name} {best.score_s:.3f} s"
    rel = "=" if best.score_s == other.score_s else ">"
    tie = f" (tie goes to {best.name}, first in order)" if rel == "=" else ""
    return (
        f"{other.name} {other.score_s:.3f} s {rel} {best.name} {best.score_s:.3f} s{tie}: "
        f"{_tok(other.prefill_tokens)} prefill + {_tok(other.decode_tokens)} decode tokens queued on "
        f"{other.name}, {_tok(best.prefill_tokens)} + {_tok(best.decode_tokens)} on {best.name}"
    )


def _explain_finish(best: BackendScore, other: BackendScore | None) -> str:
    if other is None:
        return f"{best.name} would finish in {best.score_s:.3f} s"
    rel = "=" if best.score_s == other.score_s else ">"
    cache = ""
    if best.cached_tokens != other.cached_tokens:
        cache = (f"; {best.cached_tokens:,} prompt tokens cached on {best.name}, "
                 f"{other.cached_tokens:,} on {other.name}")
    return (
        f"{other.name} finish {other.score_s:.3f} s {rel} {best.name} finish {best.score_s:.3f} s: "
        f"{other.n_running} running + {other.n_waiting} queued on {other.name} (cap {other.cap}), "
        f"{best.n_running} + {best.n_waiting} on {best.name} (cap {best.cap}){cache}"
    )


def _explain_work(best: BackendScore, other: BackendScore | None) -> str:
    if other is None:
        return f"{best.name} {_tok(best.work_tokens)} tokens of work"
    rel = "=" if best.work_tokens == other.work_tokens else ">"
    return (
        f"{other.name} {_tok(other.work_tokens)} tokens {rel} {best.name} {_tok(best.work_tokens)} tokens "
        f"of remaining prefill + decode work"
    )


def _tok(x: float) -> str:
    """Token counts: whole numbers plain, ratio-scaled ones with one decimal."""
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _names(scores: Sequence[BackendScore]) -> str:
    return ", ".join(s.name for s in scores)


def _json_number(x):
    """JSON has no infinity: an unreachable backend's infinite score becomes null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
