"""`cache-aware`: prefix affinity for whole tenants (requests sharing a hit-sized prefix),
balanced by moving small tenants off a busier backend; a new prefix, or one whose backend is
beyond balance, goes where its predicted first token is soonest, which prices the prefill a
cache hit saves against the queueing delay. SGLang router's `cache_aware` and Dynamo's KV
router are its models. `cache-aware:KEY=VALUE,...` tunes it (`from_spec`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace

from engine.core.request import CHARS_PER_TOKEN

from .policy import Policy, fmt_s, seconds_for
from .policy import from_spec as parse_spec
from .predicted_finish import predicted_first_token
from .types import BackendScore, RouteQuery

HELP = ("Keeps each tenant (requests sharing a prompt prefix) on the backend that caches it, moving "
        "small tenants off a busier backend; otherwise the soonest first token, pricing the cached "
        "prefill against the queue.")


def live_ids(snap) -> frozenset[str]:
    """The request ids `snap`'s backend holds, queued or running."""
    return frozenset(i.request_id for i in snap.items)


class RecentPrefixes:
    """Which backends recent prompts were routed to, by prefix blocks.

    A backend's prefix cache learns a prompt only once its prefill has run; until then a
    second request with the same prefix would find it nowhere. This remembers, for the last
    `window` routed requests, the chain of hashes of each prompt's `block`-token blocks (block
    k's hash covers tokens [0, (k+1) * block), so equal hashes mean equal prefixes: Dynamo's
    and vLLM's block hashing) and where that request went. `match()` answers, per backend, the
    longest remembered prefix in whole blocks. SGLang's router keeps such an approximate tree
    as its only cache knowledge; here it only fills the gap before the real cache reports
    (`match_on`): a route counts only while its request is still held there, queued or
    running (the request ids of the backend's snapshot items). Once it finished,
    the backend's cache says whether the prefix stayed; counted for the whole window (256
    requests, 6 s at 40 requests a second), a prefix the cache had since shed still drew a
    tenant's requests there, to compute it again.

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
        self._blocks: OrderedDict[int, dict[str, tuple[int, str]]] = OrderedDict()  # hash -> {backend: (serial, request id)}

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
        """Backend name -> prefix tokens routed there within the window (whole blocks),
        backends in the order they were first sent the matched prefix (the same in every process)."""
        oldest = self._serial - self.window
        found: dict[str, int] = {}
        alive: list[str] | None = None  # a list, not a set: the answer's order is the same in every process
        for k, h in enumerate(hashes):
            seen = self._blocks.get(h) or {}
            alive = [b for b, (serial, _) in seen.items() if serial > oldest and (alive is None or b in alive)]
            if not alive:
                break
            for b in alive:
                found[b] = (k + 1) * self.block
        return found

    def match_on(self, hashes: Sequence[int], backend: str, held: AbstractSet[str]) -> int:
        """Prefix tokens routed to `backend` within the window (whole blocks) by requests it
        still `held` (request ids): what its cache may not report yet."""
        oldest = self._serial - self.window
        n = 0
        for h in hashes:
            serial, rid = (self._blocks.get(h) or {}).get(backend, (0, ""))
            if serial <= oldest or rid not in held:
                break
            n += self.block
        return n

    def record(self, hashes: Sequence[int], backend: str, request_id: str = "") -> None:
        """Remember that a prompt with these block hashes (request `request_id`) was routed to
        `backend`; of several routed there with one prefix, the last stands for them (while it
        runs, so do the earlier ones' prefix cells: the cache holds them)."""
        self._serial += 1
        for h in hashes:
            seen = self._blocks.get(h)
            if seen is None:
                seen = self._blocks[h] = {}
            else:
                self._blocks.move_to_end(h)
            seen[backend] = (self._serial, request_id)
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

    Why whole tenants (two H200s, 8 Zipf tenants at 60/s, `bash scripts/gpu/run.sh fleet`): both
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
    engines at cap 32, 32 items gave the lowest makespan of 4, 32
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
        self._per_token = 1  # tokens per remembered unit (text prompts: characters)
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
        remembered = min(self._remembered_on(snap), query.prompt_tokens)
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
        self._per_token = per_token
        self._group = self._tenant(self._hashes, self._memory.block // per_token, query.prompt_tokens)

    def _remembered_on(self, snap) -> int:
        """Prompt tokens routed to `snap`'s backend by a request it still holds (`RecentPrefixes`)."""
        return self._memory.match_on(self._hashes, snap.name, live_ids(snap)) // self._per_token

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
            self._memory.record(self._hashes, backend, query.request_id)
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
        own = seconds_for(query.prefill_on(s.name), s.rates.prefill_tok_s)
        delay = self.delay_weight * load * own if load else 0.0
        return s.score_s + delay, delay

    @staticmethod
    def _explain_price(s: BackendScore, price: dict, load: dict) -> str:
        _total, delay = price[s.name]
        n = load[s.name]
        return (f"{s.name} first token in {fmt_s(s.score_s)} + {fmt_s(delay)} delay to its {n} item{'' if n == 1 else 's'} "
                f"({s.cached_tokens:,} cached)")

    def pinned(self, query, backend):
        self._remember(query, backend, home=False)

    @staticmethod
    def _where(query: RouteQuery, s: BackendScore) -> str:
        """Whether a hit is in the backend's cache or only remembered as routed there."""
        return "cached" if query.cached_on(s.name) >= s.cached_tokens else "routed there, in flight"


_CACHE_AWARE_PARAMS: dict[str, type[int] | type[float]] = {"cache_threshold": float, "balance_abs": int, "balance_rel": float, "delay_weight": float,
                       "move_abs": int, "move_rel": float}


def from_spec(spec: str) -> CacheAware:
    """`cache-aware:KEY=VALUE,...`, with `CacheAware`'s parameters (`_CACHE_AWARE_PARAMS`)."""
    return parse_spec(spec, "cache-aware", _CACHE_AWARE_PARAMS, CacheAware)
