"""Routing policies on a toy multi-tenant workload: a pure event simulation, no model.

Two identical backends (cap 8) whose prefix caches hold 4 tenants' system prompts each
(LRU); 8 tenants with a 1,500-token prefix, Zipf popularity, 50 tokens of their own, 16-64
tokens out, Poisson arrivals. A step takes alpha + beta x batch plus the prompt tokens admitted
in it at the prefill rate, so a cold 1,550-token prompt costs about 5 full-batch decode steps.
Round-robin shows every tenant to both backends and thrashes their caches; cache-aware keeps
tenants where their prefix is warm while it balances load. `SGLangStyle` is SGLang router's
`cache_aware` rule, rebuilt here for comparison (the real router is not at hand in tests).
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import pytest

from engine.core.snapshot import BackendSnapshot, CacheStats, Rates, WorkItem
from engine.routing import RecentPrefixes, RouteQuery, Router
from engine.routing.seed_score import SeedScored

PREFIX, OWN, CAP, CACHE_TENANTS, TENANTS = 1500, 50, 8, 4, 8
ALPHA, BETA, PREFILL = 0.010, 0.0005, 20_000.0
# The toy's backends hold 8 sequences, a quarter of the GPU engines' 32: its balance threshold
# is scaled alike (4 items instead of the default 32), as its SGLang-style rule's is.
TOY_CACHE_AWARE = "cache-aware:balance_abs=4"
RATES = Rates(prefill_tok_s=PREFILL, decode_tok_s=1 / (ALPHA + BETA), step_alpha_s=ALPHA, step_beta_s=BETA,
              source="override")


@dataclass
class Req:
    rid: str
    tenant: int
    tokens: tuple[int, ...]
    max_tokens: int
    arrival: float
    cached_estimate: int = 0
    left: int = 0
    first: float | None = None
    done: float | None = None


@dataclass
class Sim:
    name: str
    cache: OrderedDict = field(default_factory=OrderedDict)  # tenant -> None, LRU order
    running: list = field(default_factory=list)
    waiting: deque = field(default_factory=deque)
    busy: bool = False

    def cached(self, tenant: int) -> int:
        return PREFIX if tenant in self.cache else 0

    def snapshot(self) -> BackendSnapshot:
        items = [WorkItem(r.rid, True, PREFIX + OWN, r.cached_estimate, 0, r.left, r.max_tokens - r.left)
                 for r in self.running]
        items += [WorkItem(r.rid, False, PREFIX + OWN, r.cached_estimate, PREFIX + OWN - r.cached_estimate,
                           r.max_tokens) for r in self.waiting]
        return BackendSnapshot(self.name, "gpu", CAP, 65536, RATES, tuple(items),
                               cache=CacheStats(cached_tokens=len(self.cache) * PREFIX))


def run(policy: str, n: int = 300, rate: float = 24.0, seed: int = 1, cache_tenants: int = CACHE_TENANTS,
        tenants: int = TENANTS) -> dict:
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** 1.1 for k in range(tenants)]
    backends = {name: Sim(name) for name in ("a", "b")}
    router = Router(policy)
    events: list = []  # (time, order, kind, payload)
    t = 0.0
    reqs = []
    for k in range(n):
        t += rng.expovariate(rate)
        tenant = rng.choices(range(tenants), weights)[0]
        tokens = tuple(range(tenant * 10_000, tenant * 10_000 + PREFIX)) + tuple(range(10**6 + k * OWN, 10**6 + (k + 1) * OWN))
        reqs.append(Req(f"r{k}", tenant, tokens, rng.randint(16, 64), t))
        heapq.heappush(events, (t, k, "arrive", reqs[-1]))
    order = n

    def start_step(b: Sim, now: float) -> None:
        nonlocal order
        prefill = 0
        admitted = []
        while b.waiting and len(b.running) < CAP:
            r = b.waiting.popleft()
            prefill += PREFIX + OWN - b.cached(r.tenant)
            b.cache[r.tenant] = None
            b.cache.move_to_end(r.tenant)
            while len(b.cache) > cache_tenants:
                b.cache.popitem(last=False)
            r.left = r.max_tokens
            b.running.append(r)
            admitted.append(r)
        if not b.running:
            b.busy = False
            return
        b.busy = True
        dt = ALPHA + BETA * len(b.running) + prefill / PREFILL
        order += 1
        heapq.heappush(events, (now + dt, order, "step", b))

    while events:
        now, _, kind, x = heapq.heappop(events)
        if kind == "arrive":
            q = RouteQuery(x.rid, PREFIX + OWN, x.max_tokens, {b.name: b.cached(x.tenant) for b in backends.values()},
                           tokens=x.tokens)
            b = backends[router.route(q, [s.snapshot() for s in backends.values()]).backend]
            x.cached_estimate = b.cached(x.tenant)
            b.waiting.append(x)
            if not b.busy:
                start_step(b, now)
        else:
            b = x
            for r in b.running:
                r.left -= 1
                if r.first is None:
                    r.first = now
                if r.left == 0:
                    r.done = now
            b.running = [r for r in b.running if r.left > 0]
            start_step(b, now)

    ttfts = sorted(r.first - r.arrival for r in reqs)
    used = {name: sum(d.backend == name for d in router.recent()) for name in backends}
    return {"makespan": max(r.done for r in reqs) - reqs[0].arrival, "ttft_p50": ttfts[len(ttfts) // 2],
            "ttft_mean": sum(ttfts) / len(ttfts), "used": used}


def test_cache_aware_beats_round_robin_on_a_multi_tenant_workload():
    rr = run("round-robin")
    ca = run(TOY_CACHE_AWARE)
    assert ca["makespan"] < rr["makespan"]
    assert ca["ttft_p50"] < rr["ttft_p50"]
    assert ca["ttft_mean"] < 0.8 * rr["ttft_mean"], (ca, rr)
    assert min(ca["used"].values()) >= 0.25 * sum(ca["used"].values()), ca["used"]  # both backends serve


class SGLangStyle(SeedScored):
    """SGLang router's `cache_aware` rule, for comparison: its knowledge is only where it sent
    prompts (an approximate tree, here `RecentPrefixes` with an unbounded window); balanced
    loads (abs 32, rel 1.5 in its defaults, scaled here to cap 8: abs 4) go to the best match above
    the threshold, else to the backend that was sent the fewest prompt blocks; imbalance goes
    to the shortest queue, hit or not."""

    name = "sglang-style"

    def __init__(self):
        self.recent = RecentPrefixes(window=10**9)
        self.sent: dict[str, int] = {}

    def choose(self, query, scores):
        load = {s.name: s.n_running + s.n_waiting for s in scores}
        hashes = self.recent.hashes(query.tokens)
        if max(load.values()) - min(load.values()) > 4 and max(load.values()) > 1.5 * min(load.values()):
            name = min(load, key=load.get)
        else:
            match = self.recent.match(hashes)
            best = max(match, key=match.get) if match else None
            if best is not None and match[best] / query.prompt_tokens > 0.5:
                name = best
            else:
                name = min((s.name for s in scores), key=lambda n: self.sent.get(n, 0))
        self.recent.record(hashes, name)
        self.sent[name] = self.sent.get(name, 0) + len(hashes)
        return name, "sglang-style"


@pytest.mark.parametrize("tenants,cache_tenants", [(8, 4), (32, 8)])
def test_cache_aware_beats_an_sglang_style_rule_over_seeds(monkeypatch, tenants, cache_tenants):
    # One seed is noisy either way (a few requests decide a makespan); over six seeds at the
    # loaded rate, total makespan and summed median TTFT must both be lower. Measured: 8
    # tenants, caches for 4: 13.47 s vs 13.82 s mean makespan, 0.43 s vs 0.55 s TTFT p50;
    # 32 tenants, caches for 8: 14.77 s vs 15.50 s, 0.98 s vs 1.13 s. Both are the same in
    # every process: `RecentPrefixes.match` answers in a fixed order, so ties do not follow
    # string hashing (PYTHONHASHSEED once moved the SGLang-style sum from 80.7 s to 86.4 s).
    import engine.routing.registry as router

    monkeypatch.setitem(router.POLICIES, "sglang-style", SGLangStyle)
    kw = dict(tenants=tenants, cache_tenants=cache_tenants)
    sg = [run("sglang-style", seed=seed, **kw) for seed in range(1, 7)]
    ca = [run(TOY_CACHE_AWARE, seed=seed, **kw) for seed in range(1, 7)]
    assert sum(r["makespan"] for r in ca) < sum(r["makespan"] for r in sg)
    assert sum(r["ttft_p50"] for r in ca) < sum(r["ttft_p50"] for r in sg)
