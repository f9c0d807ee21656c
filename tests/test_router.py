"""Router policies over hand-built snapshots: no model, no threads.

The golden numbers come from the seed study (`docs/study.md`): CPU prefill 73 tok/s, decode 45 tok/s;
GPU prefill 2551 tok/s, decode 293 tok/s; cap 4 each; 516-token prompts with a 496-token
cached prefix; 128 tokens generated each.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from dataclasses import replace

import pytest

from engine.core.errors import BackendUnavailable, InvalidRequest
from engine.core.snapshot import BackendSnapshot, CacheStats, Rates, WorkItem
from engine.routing import (
    BUDGET_MODES,
    DEFAULT_POLICY,
    POLICIES,
    BackendScore,
    DecodeBudget,
    NewTokenRatio,
    OnlyBackend,
    RouteQuery,
    Router,
    RoutingDecision,
    make_policy,
    policy_names,
    predicted_finish,
    seed_score,
)

CPU_RATES = Rates(prefill_tok_s=73, decode_tok_s=45, source="override")
GPU_RATES = Rates(prefill_tok_s=2551, decode_tok_s=293, source="override")
PROMPT, CACHED, MAX_TOKENS = 516, 496, 128


# ---- helpers ----


def running(n: int, decode_left: int, prefill_left: int = 0, prefix: str = "r") -> list[WorkItem]:
    return [
        WorkItem(f"{prefix}{k}", True, PROMPT, CACHED, prefill_left, decode_left, MAX_TOKENS - decode_left)
        for k in range(n)
    ]


def queued(n: int, prefill_left: int = PROMPT - CACHED, decode_left: int = MAX_TOKENS, prefix: str = "q"):
    return [WorkItem(f"{prefix}{k}", False, PROMPT, PROMPT - prefill_left, prefill_left, decode_left)
            for k in range(n)]


def snap(name: str, device: str, rates: Rates, items=(), cap: int = 4, healthy: bool = True) -> BackendSnapshot:
    return BackendSnapshot(name=name, device=device, cap=cap, n_ctx=4096, rates=rates,
                           items=tuple(items), healthy=healthy)


def gpu(items=(), **kw) -> BackendSnapshot:
    return snap("GPU", "gpu", GPU_RATES, items, **kw)


def cpu(items=(), **kw) -> BackendSnapshot:
    return snap("CPU", "cpu", CPU_RATES, items, **kw)


def query(rid: str = "req", backend: str | None = None, cached: int = CACHED, **kw) -> RouteQuery:
    args = dict(prompt_tokens=PROMPT, max_tokens=MAX_TOKENS, cached={"GPU": cached, "CPU": cached})
    args.update(kw)
    return RouteQuery(request_id=rid, backend=backend, **args)


def clock():
    t = iter(range(10**6))
    return lambda: float(next(t))


# ---- golden numbers ----


class TestSeedGolden:
    def test_idle_cpu_score(self):
        s = seed_score(query(), cpu())
        assert round(s.score_s, 3) == 3.118
        assert (s.cached_tokens, s.prefill_tokens, s.decode_tokens) == (496, 20, 128)
        assert s.prefill_s == pytest.approx(20 / 73)
        assert s.decode_s == pytest.approx(128 / 45)

    def test_request_7_stays_on_gpu(self):
        g = gpu(running(4, decode_left=124) + queued(2))
        s = seed_score(query(), g)
        assert (s.prefill_tokens, s.decode_tokens) == (60, 880)
        assert round(s.score_s, 3) == 3.027
        assert (s.n_running, s.n_waiting) == (4, 2)

        d = Router("seed-score", clock=clock()).route(query("req-7"), [g, cpu()])
        assert d.backend == "GPU"
        assert round(d.score_of("GPU").score_s, 3) == 3.027
        assert round(d.score_of("CPU").score_s, 3) == 3.118
        assert "3.027" in d.reason and "3.118" in d.reason

    def test_request_8_goes_to_cpu(self):
        g = gpu(running(4, decode_left=122) + queued(3))
        s = seed_score(query(), g)
        assert (s.prefill_tokens, s.decode_tokens) == (80, 1000)
        assert round(s.score_s, 3) == 3.444

        d = Router("seed-score", clock=clock()).route(query("req-8"), [g, cpu()])
        assert d.backend == "CPU"
        assert d.policy == "seed-score" and not d.pinned
        assert "3.444" in d.reason and "3.118" in d.reason
        assert d.reason.startswith("GPU 3.444 s > CPU 3.118 s: 80 prefill + 1000 decode tokens")

    def test_full_gpu_alone_does_not_offload(self):
        # All 4 slots busy, nothing queued: the GPU still wins (docs/study.md: "a full GPU is not enough").
        d = Router("seed-score").route(query(), [gpu(running(4, decode_left=124)), cpu()])
        assert d.backend == "GPU"

    def test_lost_cache_discount_would_offload_earlier(self):
        # The study's disclosed bug: queued requests without their cache estimate (516 prefill
        # each) overstate GPU prefill. With the estimate kept, request 7 stays on the GPU.
        kept = seed_score(query(), gpu(running(4, 124) + queued(2)))
        lost = seed_score(query(), gpu(running(4, 124) + queued(2, prefill_left=PROMPT)))
        assert round(kept.score_s, 3) == 3.027 < 3.118 < lost.score_s  # the bug offloads request 7
        assert lost.prefill_tokens - kept.prefill_tokens == 2 * CACHED

    def test_uncached_prompt_waits_for_gpu(self):
        # A cold prompt costs the CPU 516/73 s of prefill; the busy GPU still wins.
        d = Router("seed-score").route(query(cached=0), [gpu(running(4, 122) + queued(3)), cpu()])
        assert d.backend == "GPU"

    def test_decision_to_dict_is_json(self):
        d = Router("seed-score", clock=clock()).route(query("req-8"), [gpu(running(4, 122) + queued(3)), cpu()])
        j = json.loads(json.dumps(d.to_dict()))
        assert j["backend"] == "CPU" and j["request_id"] == "req-8" and j["policy"] == "seed-score"
        gpu_score = next(s for s in j["scores"] if s["name"] == "GPU")
        assert gpu_score["prefill_tokens"] == 80 and gpu_score["decode_tokens"] == 1000
        assert gpu_score["rates"]["prefill_tok_s"] == 2551
        assert gpu_score["n_running"] == 4 and gpu_score["n_waiting"] == 3 and gpu_score["eligible"]


# ---- policy table ----


BUSY_GPU = running(4, 122) + queued(3)
CASES = [
    # (policy, gpu items, cpu items, expected backend)
    ("seed-score", (), (), "GPU"),
    ("seed-score", BUSY_GPU, (), "CPU"),
    ("least-work", (), (), "GPU"),  # equal work: first backend wins the tie
    ("least-work", running(1, 10), (), "CPU"),
    ("least-work", (), running(1, 10), "GPU"),
    ("predicted-finish", (), (), "GPU"),
    ("predicted-finish", BUSY_GPU, (), "CPU"),
    ("gpu-only", BUSY_GPU, (), "GPU"),
    ("cpu-only", (), (), "CPU"),
    ("only:CPU", (), (), "CPU"),
    ("only:GPU", BUSY_GPU, (), "GPU"),
    ("round-robin", (), (), "GPU"),
]


@pytest.mark.parametrize("policy,gpu_items,cpu_items,expected", CASES)
def test_policy_table(policy, gpu_items, cpu_items, expected):
    router = Router(policy)
    d = router.route(query(), [gpu(gpu_items), cpu(cpu_items)])
    assert d.backend == expected, d.reason
    assert d.policy == policy
    assert len(d.scores) == 2 and all(isinstance(s, BackendScore) for s in d.scores)
    assert d.reason
    for s in d.scores:
        assert s.score_s == pytest.approx(s.prefill_s + s.decode_s)


def test_every_registered_policy_is_made_by_its_name():
    assert set(POLICIES) == {"finish-first", "finish-first:pack", "seed-score", "predicted-finish", "least-work", "round-robin",
                             "cache-aware", "gpu-only", "cpu-only"}
    for name in POLICIES:
        assert make_policy(name).name == name
    assert make_policy("default").name == DEFAULT_POLICY == "finish-first:pack"
    assert Router("default").policy == Router().policy == "finish-first:pack"
    assert "default" in policy_names()
    assert make_policy("only:GPU").name == "only:GPU"
    assert make_policy(" only:CPU ").backend == "CPU"
    assert "only:NAME" in policy_names()
    assert make_policy("round-robin") is not make_policy("round-robin")  # fresh state each time


# ---- baselines ----


class TestBaselines:
    def test_device_only_policies_pick_by_device(self):
        snaps = [snap("b0", "cpu", CPU_RATES), snap("b1", "CUDA0", GPU_RATES), snap("b2", "Metal", GPU_RATES)]
        assert Router("gpu-only").route(query(), snaps).backend == "b1"
        assert Router("cpu-only").route(query(), snaps).backend == "b0"

    def test_gpu_only_over_two_contexts_picks_the_one_holding_fewer(self):
        snaps = [snap("cpu", "cpu", CPU_RATES), snap("gpu-a", "gpu", GPU_RATES, queued(3, prefix="a")),
                 snap("gpu-b", "gpu", GPU_RATES, queued(1, prefix="b"))]
        decision = Router("gpu-only").route(query(), snaps)
        assert decision.backend == "gpu-b"

    def test_gpu_only_over_two_contexts_skips_an_unhealthy_one(self):
        snaps = [snap("gpu-a", "gpu", GPU_RATES, healthy=False), snap("gpu-b", "gpu", GPU_RATES, queued(5))]
        assert Router("gpu-only").route(query(), snaps).backend == "gpu-b"

    def test_device_only_without_such_device(self):
        with pytest.raises(BackendUnavailable, match="cpu"):
            Router("cpu-only").route(query(), [gpu()])

    def test_only_name(self):
        r = Router("only:CPU")
        for k in range(5):
            assert r.route(query(f"r{k}"), [gpu(), cpu()]).backend == "CPU"
        with pytest.raises(BackendUnavailable, match="NPU"):
            Router("only:NPU").route(query(), [gpu(), cpu()])

    def test_only_unhealthy(self):
        with pytest.raises(BackendUnavailable, match="unhealthy"):
            Router("only:CPU").route(query(), [gpu(), cpu(healthy=False)])

    def test_only_backend_needs_one_target(self):
        with pytest.raises(ValueError):
            OnlyBackend()

    def test_round_robin_cycles(self):
        r = Router("round-robin")
        snaps = [gpu(), cpu(), snap("NPU", "npu", GPU_RATES)]
        got = [r.route(query(f"r{k}"), snaps).backend for k in range(7)]
        assert got == ["GPU", "CPU", "NPU", "GPU", "CPU", "NPU", "GPU"]

    def test_round_robin_skips_unhealthy(self):
        r = Router("round-robin")
        snaps = [gpu(), cpu(healthy=False), snap("NPU", "npu", GPU_RATES)]
        got = [r.route(query(f"r{k}"), snaps).backend for k in range(4)]
        assert got == ["GPU", "NPU", "GPU", "NPU"]

    def test_set_policy_restarts_round_robin(self):
        r = Router("round-robin")
        assert r.route(query(), [gpu(), cpu()]).backend == "GPU"
        r.set_policy("round-robin")
        assert r.route(query(), [gpu(), cpu()]).backend == "GPU"

    def test_least_work_counts_tokens_not_seconds(self):
        # GPU: 4 x 50 decode + 20 + 128 = 348 tokens; CPU: 20 + 128 + 1 running x 150 = 298.
        snaps = [gpu(running(4, 50)), cpu(running(1, 150))]
        d = Router("least-work").route(query(), snaps)
        assert d.backend == "CPU"
        assert d.score_of("GPU").work_tokens == 348 and d.score_of("CPU").work_tokens == 298
        assert "348" in d.reason and "298" in d.reason
        # seed-score, pricing the same work by rate, keeps it on the GPU.
        assert Router("seed-score").route(query(), snaps).backend == "GPU"


# ---- predicted-finish ----


CAL_GPU = Rates(prefill_tok_s=2551, decode_tok_s=293, step_alpha_s=0.010, step_beta_s=0.001, source="calibrated")


class TestPredictedFinish:
    def test_idle_matches_closed_form(self):
        s = predicted_finish(query(), snap("GPU", "gpu", CAL_GPU))
        assert s.score_s == pytest.approx(20 / 2551 + 128 * (0.010 + 0.001))
        assert (s.prefill_tokens, s.decode_tokens) == (20, 128)

    def test_uncalibrated_idle_equals_seed_score(self):
        assert predicted_finish(query(), cpu()).score_s == pytest.approx(seed_score(query(), cpu()).score_s)

    def test_waits_for_a_slot(self):
        # cap 1: one running item with 10 left, then the new request (prefill 20, 128 steps).
        g = snap("GPU", "gpu", CAL_GPU, running(1, 10), cap=1)
        s = predicted_finish(query(), g)
        step1 = 0.011
        assert s.score_s == pytest.approx(10 * step1 + 20 / 2551 + 128 * step1)
        assert s.decode_tokens == 138

    def test_batches_share_steps(self):
        # cap 4, 2 running (5 and 50 left): new joins at once; steps at b=3 then b=2 after 5.
        g = snap("GPU", "gpu", CAL_GPU, running(1, 5) + running(1, 50, prefix="s"), cap=4)
        s = predicted_finish(query(), g)
        expected = 20 / 2551 + 5 * (0.010 + 0.003) + 45 * (0.010 + 0.002) + 78 * (0.010 + 0.001)
        assert s.score_s == pytest.approx(expected)
        assert s.decode_tokens == 5 * 3 + 45 * 2 + 78

    def test_queue_prefill_is_paid(self):
        g = snap("GPU", "gpu", CAL_GPU, queued(2, prefill_left=100), cap=4)
        s = predicted_finish(query(), g)
        assert s.prefill_tokens == 220
        assert s.prefill_s == pytest.approx(220 / 2551)
        assert s.decode_s == pytest.approx(128 * (0.010 + 0.003))

    def test_prefers_fast_backend_when_idle(self):
        d = Router("predicted-finish").route(query(), [snap("GPU", "gpu", CAL_GPU), cpu()])
        assert d.backend == "GPU"
        assert d.score_of("GPU").score_s < 1.5

    def test_prefers_idle_slow_backend_over_long_queue(self):
        g = snap("GPU", "gpu", CAL_GPU, running(4, 128) + queued(8))
        d = Router("predicted-finish").route(query(), [g, cpu()])
        assert d.backend == "CPU"
        # Three full waves of 128 steps at b=4 come first (plus prefill).
        assert d.score_of("GPU").score_s > 3 * 128 * 0.014
        assert "finish" in d.reason and "GPU" in d.reason and "CPU" in d.reason

    def test_kv_room_not_the_cap_bounds_concurrency(self):
        # Cap 64, but the context has cells for 2 requests' reservations (uncached prompt +
        # whole budget each) besides the pinned shared prefix: the new request waits a wave.
        per = PROMPT - CACHED + MAX_TOKENS
        roomy = replace(snap("GPU", "gpu", CAL_GPU, running(2, 128), cap=64), kv_cells_total=100_000)
        tight = replace(roomy, kv_cells_total=CACHED + 2 * per + per // 2,
                        cache=CacheStats(cached_tokens=CACHED, pinned_tokens=CACHED))
        joins = predicted_finish(query(), roomy)
        waits = predicted_finish(query(), tight)
        assert joins.score_s == pytest.approx(20 / 2551 + 128 * (0.010 + 0.003))
        assert waits.score_s == pytest.approx(128 * (0.010 + 0.002) + 20 / 2551 + 128 * (0.010 + 0.001))
        d = Router("predicted-finish").route(query(), [tight, replace(cpu(), cap=4)])
        assert d.score_of("GPU").score_s == pytest.approx(waits.score_s)

    def test_ignores_budget_mode(self):
        r = Router("predicted-finish", budget="ratio")
        d = r.route(query(), [gpu(running(4, 100)), cpu()])
        assert d.new_token_ratio is None
        assert d.score_of("GPU").score_s == pytest.approx(predicted_finish(query(), gpu(running(4, 100))).score_s)

    def test_long_queue_is_fast(self):
        import time

        g = snap("GPU", "gpu", CAL_GPU, running(64, 4000) + queued(2000, decode_left=4000), cap=64)
        t0 = time.perf_counter()
        s = predicted_finish(query(), g)
        assert time.perf_counter() - t0 < 0.5
        assert s.score_s > 0


# ---- decode budget ----


class TestDecodeBudget:
    def test_the_new_token_ratio_decays_to_its_floor_until_reset(self):
        r = NewTokenRatio()
        assert r.value == 0.7
        values = [r.step() for _ in range(100)]
        assert values[0] == pytest.approx(0.69)
        assert all(a >= b for a, b in itertools.pairwise(values))
        assert r.value == pytest.approx(0.1)
        assert r.reset() == 0.7

    def test_a_new_token_ratio_starting_below_its_floor_is_refused(self):
        with pytest.raises(ValueError):
            NewTokenRatio(initial=0.05, floor=0.1)

    def test_ratio_scales_running_only(self):
        g = gpu(running(4, 124) + queued(2))
        raw = seed_score(query(), g)
        scaled = seed_score(query(), g, DecodeBudget("ratio", 0.5))
        assert raw.decode_tokens == 880
        assert scaled.decode_tokens == 4 * 124 * 0.5 + 2 * 128 + 128
        assert scaled.decode_s < raw.decode_s
        assert scaled.prefill_s == raw.prefill_s
        # An idle backend has nothing running to scale.
        assert seed_score(query(), cpu(), DecodeBudget("ratio", 0.5)).score_s == raw_cpu_score()

    def test_the_ratio_budget_lowers_the_decode_term(self):
        g = gpu(running(4, 122) + queued(3))
        raw = Router("seed-score").route(query(), [g, cpu()])
        r = Router("seed-score", budget="ratio")
        d = r.route(query(), [g, cpu()])
        assert d.budget == "ratio" and d.new_token_ratio == 0.7
        assert d.score_of("GPU").decode_s < raw.score_of("GPU").decode_s
        assert d.backend == "GPU"  # 488 x 0.7 running tokens: the GPU keeps request 8
        assert r.new_token_ratio == pytest.approx(0.69)
        assert r.reset_ratio() == 0.7

    def test_least_work_uses_ratio(self):
        g = gpu(running(4, 100))
        d = Router("least-work", budget="ratio").route(query(), [g, cpu()])
        assert d.score_of("GPU").decode_tokens == pytest.approx(4 * 100 * 0.7 + 128)

    def test_raw_mode_leaves_ratio_alone(self):
        r = Router("seed-score")
        r.route(query(), [gpu(running(4, 100)), cpu()])
        assert r.new_token_ratio == 0.7

    def test_unknown_budget(self):
        assert BUDGET_MODES == ("raw", "ratio")
        with pytest.raises(InvalidRequest, match="raw"):
            Router(budget="magic")
        with pytest.raises(InvalidRequest):
            Router().set_budget("predicted")


def raw_cpu_score() -> float:
    return seed_score(query(), cpu()).score_s


# ---- Router ----


class TestRouter:
    def test_pin_bypasses_policy(self):
        r = Router("only:GPU")
        d = r.route(query(backend="CPU"), [gpu(), cpu()])
        assert d.backend == "CPU" and d.pinned
        assert "pinned" in d.reason
        assert len(d.scores) == 2  # scores are still recorded

    def test_pin_unknown_backend(self):
        with pytest.raises(InvalidRequest, match="NPU") as e:
            Router().route(query(backend="NPU"), [gpu(), cpu()])
        assert e.value.param == "backend"

    def test_pin_unhealthy_backend(self):
        with pytest.raises(BackendUnavailable):
            Router().route(query(backend="CPU"), [gpu(), cpu(healthy=False)])

    def test_unknown_policy_lists_valid_names(self):
        for bad in ("fastest", "only:", "", "seed"):
            with pytest.raises(InvalidRequest) as e:
                make_policy(bad)
            for name in policy_names():
                assert name in e.value.message
        r = Router()
        with pytest.raises(InvalidRequest):
            r.set_policy("nope")
        assert r.policy == "finish-first:pack"  # unchanged: the default
        assert r.set_policy("least-work") == "least-work" and r.policy == "least-work"

    @pytest.mark.parametrize("policy", [p for p in POLICIES if p != "cpu-only"])
    def test_unhealthy_backend_is_skipped(self, policy):
        # The healthy GPU would lose on every score; the unhealthy CPU is not eligible.
        d = Router(policy).route(query(), [cpu(healthy=False), gpu(BUSY_GPU)])
        assert d.backend == "GPU"
        assert not d.score_of("CPU").eligible and d.score_of("GPU").eligible

    def test_pinning_policy_to_unhealthy_backend_fails(self):
        with pytest.raises(BackendUnavailable, match="unhealthy"):
            Router("cpu-only").route(query(), [cpu(healthy=False), gpu(BUSY_GPU)])

    def test_all_unhealthy(self):
        for policy in POLICIES:
            with pytest.raises(BackendUnavailable):
                Router(policy).route(query(), [gpu(healthy=False), cpu(healthy=False)])
        with pytest.raises(BackendUnavailable):
            Router().route(query(), [])

    def test_only_eligible_reason(self):
        d = Router().route(query(), [gpu(healthy=False), cpu()])
        assert d.backend == "CPU" and "GPU unhealthy" in d.reason

    def test_tie_goes_to_first(self):
        a = snap("A", "gpu", GPU_RATES)
        b = snap("B", "gpu", GPU_RATES)
        q = RouteQuery("t", PROMPT, MAX_TOKENS, {"A": 0, "B": 0})
        assert Router().route(q, [a, b]).backend == "A"
        assert Router().route(q, [b, a]).backend == "B"
        assert "tie" in Router().route(q, [a, b]).reason

    def test_zero_rate_is_never_chosen(self):
        dead = snap("X", "gpu", Rates(prefill_tok_s=0, decode_tok_s=0))
        for policy in ("seed-score", "predicted-finish"):
            d = Router(policy).route(query(), [dead, cpu()])
            assert d.backend == "CPU"
            assert json.dumps(d.to_dict())  # infinite score serialises as null
            assert d.to_dict()["scores"][0]["score_s"] is None

    def test_cached_tokens_are_clamped_to_the_prompt(self):
        q = RouteQuery("c", 100, 10, {"GPU": 500})
        assert q.cached_on("GPU") == 100 and q.prefill_on("GPU") == 0

    def test_a_backend_with_no_cache_entry_has_nothing_cached(self):
        q = RouteQuery("c", 100, 10, {"GPU": 500})
        assert q.cached_on("CPU") == 0 and q.prefill_on("CPU") == 100

    def test_recent_decisions_are_a_bounded_ordered_window(self):
        r = Router(history=3, clock=clock())
        for k in range(5):
            r.route(query(f"r{k}"), [gpu(), cpu()])
        assert [d.request_id for d in r.recent()] == ["r2", "r3", "r4"]
        assert [d.request_id for d in r.recent(2)] == ["r3", "r4"]
        assert r.recent(0) == []
        assert [d.time for d in r.recent()] == [2.0, 3.0, 4.0]
        r.clear()
        assert r.recent() == []

    def test_decisions_are_frozen(self):
        d = Router().route(query(), [gpu(), cpu()])
        assert isinstance(d, RoutingDecision)
        with pytest.raises(AttributeError):
            d.backend = "CPU"
        with pytest.raises(AttributeError):
            d.scores[0].score_s = 0.0

    def test_from_request(self):
        from engine.core.request import Request, SamplingParams

        req = Request(prompt_tokens=tuple(range(PROMPT)), sampling=SamplingParams(max_tokens=MAX_TOKENS),
                      id="req-x", backend="CPU")
        q = RouteQuery.from_request(req, {"CPU": CACHED})
        assert (q.request_id, q.prompt_tokens, q.max_tokens, q.backend) == ("req-x", PROMPT, MAX_TOKENS, "CPU")
        assert q.cached_on("CPU") == CACHED

    def test_concurrent_routes_record_every_decision(self):
        r = Router("round-robin", history=10_000)
        snaps = [gpu(), cpu()]

        def work(t):
            for k in range(200):
                r.route(query(f"t{t}-{k}"), snaps)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        decisions = r.recent()
        assert len(decisions) == 1600
        assert sum(d.backend == "GPU" for d in decisions) == 800


# ---- cache-aware ----

# Two (or more) comparable GPUs, tenants with a 1,500-token system prefix, 50 tokens each.
TENANT_PROMPT, TENANT_PREFIX, TENANT_OUT = 1550, 1500, 128
H200 = Rates(prefill_tok_s=20_000, decode_tok_s=500, step_alpha_s=0.010, step_beta_s=0.0005, source="override")


def gpus(*loads, cap: int = 8, names: str = "abcd", held: dict[str, tuple[str, ...]] | None = None
         ) -> list[BackendSnapshot]:
    """One identical GPU backend per load: `load` items, the first `cap` running, the rest queued;
    `held` names the request ids among a backend's items (the ones routed there still in flight)."""
    out = []
    for name, n in zip(names, loads):
        ids = list((held or {}).get(name, ())) + [f"{name}{k}" for k in range(n)]
        items = [WorkItem(ids[k], k < cap, TENANT_PROMPT, TENANT_PREFIX,
                          0 if k < cap else TENANT_PROMPT - TENANT_PREFIX, 100) for k in range(n)]
        out.append(snap(name, "gpu", H200, items, cap=cap))
    return out


def tenant_query(rid: str = "t", tenant: int = 0, own: int = 0, cached: dict | None = None, tokens: bool = False):
    toks = tuple(range(tenant * 10_000, tenant * 10_000 + TENANT_PREFIX)) + tuple(
        range(900_000 + own * 100, 900_000 + own * 100 + TENANT_PROMPT - TENANT_PREFIX))
    return RouteQuery(rid, TENANT_PROMPT, TENANT_OUT, cached or {}, tokens=toks if tokens else ())


CACHE_AWARE_CASES = [
    # (loads, cached per backend, expected, words in the reason)
    ((3, 4), {"b": 1500}, "b", ["b: 1,500 of 1,550 tokens cached", "loads 4 vs 3 on a, within balance"]),
    ((4, 3), {"a": 1500}, "a", ["a: 1,500 of 1,550 tokens cached", "loads 4 vs 3 on b, within balance"]),
    ((2, 2), {"a": 1500, "b": 1500}, "a", ["a: 1,500 of 1,550", "least loaded too"]),  # tie: order
    ((5, 2), {"a": 1500, "b": 1500}, "b", ["b: 1,500 of 1,550", "least loaded too"]),  # equal hits: load
    ((20, 2), {"a": 1500}, "b", ["a: 1,500 of 1,550 tokens cached, but loads 20 vs 2 on b are beyond balance",
                                 "b first token in 0.077 s", "vs a first token in 2.833 s"]),
    ((0, 0), {}, "a", ["no backend holds 50% of the prompt", "nothing cached anywhere"]),
    ((3, 1), {}, "b", ["no backend holds 50%", "b first token in 0.077 s + 0.077 s delay to its 1 item (0 cached)",
                       "vs a first token in 0.077 s + 0.232 s delay to its 3 items"]),
    # 32 % is below the threshold: priced, a's sooner first token (0.052 s) costs its 3 items more
    ((3, 1), {"a": 500}, "b", ["best a: 500 of 1,550 tokens", "b first token in 0.077 s",
                               "vs a first token in 0.052 s + 0.158 s delay to its 3 items (500 cached)"]),
    ((1, 1), {"a": 500}, "a", ["best a: 500 of 1,550 tokens", "a first token in 0.052 s"]),
    ((2, 4, 1, 4), {"c": 1500}, "c", ["c: 1,500 of 1,550 tokens cached", "least loaded too"]),
    ((1, 4, 4, 4), {"c": 1500}, "c", ["c: 1,500", "loads 4 vs 1 on a, within balance"]),
    ((1, 4, 16, 4), {"c": 1500}, "a", ["c: 1,500 of 1,550 tokens cached, but loads 16 vs 1 on a are beyond balance",
                                       "a first token in", "vs b first token in"]),
    ((1, 4, 16, 3), {"c": 1500, "d": 1500}, "d", ["d: 1,500 of 1,550 tokens cached"]),
]


# The rule's cases are written for a tight balance threshold (4 items) so that small hand-built
# loads cross it; the default (32) is checked on its own below.
TABLE_POLICY = "cache-aware:balance_abs=4"


class TestCacheAware:
    @pytest.mark.parametrize("loads,cached,expected,words", CACHE_AWARE_CASES)
    def test_table(self, loads, cached, expected, words):
        d = Router(TABLE_POLICY).route(tenant_query(cached=cached), gpus(*loads))
        assert d.backend == expected, d.reason
        for w in words:
            assert w in d.reason
        assert d.policy == TABLE_POLICY and d.new_token_ratio is None

    def test_scores_are_predicted_first_tokens_with_the_hit(self):
        snaps = gpus(0, 0)
        q = tenant_query(cached={"b": 1500})
        d = Router(TABLE_POLICY).route(q, snaps)
        assert d.score_of("b").cached_tokens == 1500 and d.score_of("a").cached_tokens == 0
        assert d.score_of("b").score_s == pytest.approx(50 / 20_000)
        assert d.score_of("a").score_s == pytest.approx(1550 / 20_000)
        for s in d.scores:
            assert s.score_s == pytest.approx(s.prefill_s + s.decode_s)

    def test_hit_outweighs_a_short_queue_beyond_balance(self):
        # a holds 6 running (cap 8: the new request joins at once) vs an idle b: beyond the
        # item thresholds, but prefill at 73 tok/s makes b's 1,550-token prompt the longer wait.
        slow = replace(H200, prefill_tok_s=73)
        snaps = [replace(s, rates=slow) for s in gpus(6, 0)]
        d = Router(TABLE_POLICY).route(tenant_query(cached={"a": 1500}), snaps)
        assert d.backend == "a"
        assert "beyond balance (>4 apart and >1.5x), and it is still the cheapest" in d.reason

    def test_prefix_in_flight_is_priced_as_a_cold_prefill(self):
        # As above, but a's hit is only remembered (the tenant's first request still runs
        # there): a request admitted now computes the prefix again, 1,550 tokens at 73 tok/s.
        slow = replace(H200, prefill_tok_s=73)
        r = Router(TABLE_POLICY)
        first = r.route(tenant_query("r0", 7, tokens=True), [replace(s, rates=slow) for s in gpus(0, 0)])
        assert first.backend == "a"
        d = r.route(tenant_query("r1", 7, own=1, tokens=True),
                    [replace(s, rates=slow) for s in gpus(6, 0, held={"a": ("r0",)})])
        assert d.backend == "b", d.reason
        assert d.score_of("a").cached_tokens == 1472  # affinity still sees it
        assert d.score_of("a").prefill_s == pytest.approx(1550 / 73)  # priced cold
        assert "routed there, in flight" in d.reason

    def test_repeat_requests_stick_while_others_spread(self):
        # Each routed request adds one running item where it went; tenant 0 is warm on b.
        r = Router(TABLE_POLICY)
        loads = [0, 0]
        got = []
        for k in range(12):
            tenant = k % 3  # tenants 1, 2 are cold everywhere
            cached = {"b": 1500} if tenant == 0 else {}
            d = r.route(tenant_query(f"r{k}", tenant, cached=cached), gpus(*loads))
            got.append((tenant, d.backend))
            loads["ab".index(d.backend)] += 1
        assert {b for t, b in got if t == 0} == {"b"}
        assert loads[0] >= 4  # the cold tenants balance the load
        assert abs(loads[0] - loads[1]) <= 4

    def test_in_flight_prefix_is_remembered(self):
        # The first request of a tenant is still queued on a (its cache reports nothing yet):
        # the second finds it through the router's memory and follows it, while balanced.
        r = Router(TABLE_POLICY)
        first = r.route(tenant_query("r0", 7, own=0, tokens=True), gpus(0, 0))
        assert first.backend == "a"
        second = r.route(tenant_query("r1", 7, own=1, tokens=True), gpus(1, 0, held={"a": ("r0",)}))
        assert second.backend == "a"
        # 46 whole blocks of 32 tokens: the 47th mixes the prefix with the request's own tokens
        assert "a: 1,472 of 1,550 tokens routed there, in flight" in second.reason
        # Another tenant's prompt shares no block: it goes to the idle backend.
        other = r.route(tenant_query("r2", 8, tokens=True), gpus(2, 0, held={"a": ("r0", "r1")}))
        assert other.backend == "b" and "nothing cached anywhere" in other.reason

    def test_the_remembered_prefixes_are_per_backend(self):
        r = Router(TABLE_POLICY)
        r.route(tenant_query("r0", 1, tokens=True), gpus(0, 0))
        d = r.route(tenant_query("r1", 1, own=1, tokens=True, cached={"b": 1500}), gpus(1, 1, held={"a": ("r0",)}))
        # b's real 1,500 cached tokens and the 1,472 remembered on a are the same 46 blocks:
        # equal hits, and a is the tenant's home (where its last request went)
        assert d.backend == "a"
        assert d.score_of("a").cached_tokens == 1472 and d.score_of("b").cached_tokens == 1500
        assert d.reason.startswith("a: 1,472 of 1,550 tokens routed there, in flight")
        r.clear()
        d = r.route(tenant_query("r2", 1, own=2, tokens=True), gpus(1, 0, held={"a": ("r1",)}))
        assert d.backend == "b" and "nothing cached anywhere" in d.reason

    def test_pinned_request_is_remembered(self):
        r = Router(TABLE_POLICY)
        pinned = replace(tenant_query("r0", 3, tokens=True), backend="b")
        d = r.route(pinned, gpus(0, 0))
        assert d.pinned and d.backend == "b"
        d = r.route(tenant_query("r1", 3, own=1, tokens=True), gpus(0, 1, held={"b": ("r0",)}))
        assert d.backend == "b" and "routed there, in flight" in d.reason

    def test_a_finished_request_leaves_its_prefix_to_the_cache(self):
        """Once the request routed to a has finished (its snapshot no longer holds it), the
        router's memory of it stops counting: a's cache says whether the prefix stayed. Shed,
        it draws nothing, and the tenant's next request goes where the prefix is cached."""
        r = Router(TABLE_POLICY)
        assert r.route(tenant_query("r0", 5, tokens=True), gpus(0, 0)).backend == "a"
        d = r.route(tenant_query("r1", 5, own=1, tokens=True, cached={"b": 1500}), gpus(1, 1))
        assert d.score_of("a").cached_tokens == 0 and d.score_of("b").cached_tokens == 1500
        assert d.backend == "b" and d.reason.startswith("b: 1,500 of 1,550 tokens cached"), d.reason
        # While r0 still ran there, a was the tenant's home and drew it (the test above).
        d = Router(TABLE_POLICY)
        d.route(tenant_query("r0", 5, tokens=True), gpus(0, 0))
        held = d.route(tenant_query("r1", 5, own=1, tokens=True, cached={"b": 1500}), gpus(1, 1, held={"a": ("r0",)}))
        assert held.backend == "a" and held.score_of("a").cached_tokens == 1472

    def test_unhealthy_backend_with_the_hit_is_skipped(self):
        snaps = gpus(0, 3)
        snaps[0] = replace(snaps[0], healthy=False)
        d = Router(TABLE_POLICY).route(tenant_query(cached={"a": 1500}), snaps)
        assert d.backend == "b" and "a unhealthy" in d.reason

    def test_parameters_are_checked(self):
        from engine.routing import CacheAware

        for bad in (dict(cache_threshold=1.5), dict(balance_abs=-1), dict(balance_rel=0.5)):
            with pytest.raises(ValueError):
                CacheAware(**bad)
        strict = CacheAware(balance_abs=0, balance_rel=1.0)
        scores = [strict.score(tenant_query(cached={"a": 1500}), s, DecodeBudget()) for s in gpus(2, 1)]
        name, reason = strict.choose(tenant_query(cached={"a": 1500}), scores)
        assert "beyond balance (>0 apart and >1x)" in reason and name == "a"


def held(name: str, ids, cap: int = 8) -> BackendSnapshot:
    """A GPU backend holding the requests `ids` (the first `cap` running), tenant-sized."""
    items = [WorkItem(rid, k < cap, TENANT_PROMPT, TENANT_PREFIX, 0 if k < cap else TENANT_PROMPT - TENANT_PREFIX, 100)
             for k, rid in enumerate(ids)]
    return snap(name, "gpu", H200, items, cap=cap)


def text_query(rid: str, tenant: int, own: int, cached: dict | None = None) -> RouteQuery:
    """A text prompt (no token ids): a tenant's 6,000-character prefix and 200 of its own."""
    text = f"tenant {tenant:03d} system prompt. " * 240 + f"question {own:05d} " * 20
    return RouteQuery(rid, len(text) // 4, TENANT_OUT, cached or {}, text=text)


def token_query(rid: str, tenant: int, own: int) -> RouteQuery:
    return tenant_query(rid, tenant, own, tokens=True)


class TestTenants:
    """`cache-aware` groups requests that share a hit-sized prefix into tenants and balances
    loads by moving whole small tenants (the default move thresholds: 4 items, 25 % of the mean)."""

    @staticmethod
    def uneven(hot: list[str], small: list[str]) -> list:
        """Both tenants' items on a, five others on b."""
        return [held("a", hot + small), held("b", [f"x{k}" for k in range(5)])]

    @staticmethod
    def seeded(make, hot: int, small: int) -> tuple[Router, list[str], list[str]]:
        """A router that has sent `hot` requests of tenant 0 and `small` of tenant 1 to a."""
        r = Router("cache-aware")
        hot_ids = [f"h{k}" for k in range(hot)]
        small_ids = [f"s{k}" for k in range(small)]
        for rid, tenant in [(i, 0) for i in hot_ids] + [(i, 1) for i in small_ids]:
            r.route(replace(make(rid, tenant, int(rid[1:])), backend="a"), [held("a", []), held("b", [])])
        return r, hot_ids, small_ids

    def test_small_tenant_moves_whole_when_loads_are_uneven(self):
        r, hot, small = self.seeded(token_query, 14, 3)
        snaps = self.uneven(hot, small)
        d = r.route(tenant_query("s9", 1, 9, cached={"a": 1500}, tokens=True), snaps)
        assert d.backend == "b", d.reason
        assert "loads 17 vs 5 on b are uneven" in d.reason
        assert "the tenant's 3 items on a are at most half the gap, so the tenant moves to b" in d.reason

    def test_moved_tenant_follows_its_new_home(self):
        r, hot, small = self.seeded(token_query, 14, 3)
        snaps = self.uneven(hot, small)
        r.route(tenant_query("s9", 1, 9, cached={"a": 1500}, tokens=True), snaps)
        snaps = [held("a", hot + small), held("b", ["x0", "x1", "x2", "x3", "x4", "s9"])]
        d = r.route(tenant_query("s10", 1, 10, cached={"a": 1500}, tokens=True), snaps)
        assert d.backend == "b", d.reason
        assert d.reason.startswith("b: 1,472 of 1,550 tokens routed there, in flight")

    def test_tenant_that_is_the_gap_stays(self):
        r, hot, small = self.seeded(token_query, 14, 3)
        snaps = self.uneven(hot, small)
        d = r.route(tenant_query("h99", 0, 99, cached={"a": 1500}, tokens=True), snaps)
        assert d.backend == "a", d.reason
        assert "the tenant holds 14 of a's items: moving it would turn the gap around" in d.reason

    def test_even_loads_keep_every_tenant_home(self):
        r, hot, small = self.seeded(token_query, 6, 3)
        snaps = [held("a", hot + small), held("b", ["x0", "x1", "x2", "x3", "x4", "x5", "x6"])]
        d = r.route(tenant_query("s9", 1, 9, cached={"a": 1500}, tokens=True), snaps)
        assert d.backend == "a" and "within balance" in d.reason

    def test_equal_hit_on_a_lighter_backend_takes_the_request(self):
        r, hot, small = self.seeded(token_query, 14, 3)
        snaps = self.uneven(hot, small)
        d = r.route(tenant_query("h99", 0, 99, cached={"a": 1500, "b": 1500}, tokens=True), snaps)
        assert d.backend == "b", d.reason
        assert "b holds 1,500 too" in d.reason

    def test_text_prompts_form_tenants(self):
        r, hot, small = self.seeded(lambda rid, t, own: text_query(rid, t, own), 14, 3)
        snaps = self.uneven(hot, small)
        q = text_query("s9", 1, 9)
        d = r.route(replace(q, cached={"a": q.prompt_tokens}), snaps)
        assert d.backend == "b", d.reason
        assert "the tenant's 3 items on a are at most half the gap" in d.reason

    def test_a_prompt_whose_hit_sized_prefix_is_its_own_moves_nothing(self):
        # 120 tokens, 60 of them a tenant's: the two 32-token blocks that cover half the prompt
        # reach into the request's own tokens, so no earlier request shares them (no tenant)
        r = Router("cache-aware")
        toks = tuple(range(60)) + tuple(range(5000, 5060))
        snaps = [held("a", [f"h{k}" for k in range(10)]), held("b", [])]
        d = r.route(RouteQuery("q", 120, 16, {"a": 60}, tokens=toks), snaps)
        assert d.backend == "a" and "within balance" in d.reason, d.reason

    def test_unrelated_prompts_are_no_tenant(self):
        r, hot, small = self.seeded(token_query, 14, 3)
        snaps = self.uneven(hot, small)
        d = r.route(tenant_query("n0", 5, 0, tokens=True), snaps)
        assert d.backend == "b" and "nothing cached anywhere" in d.reason


class TestCacheAwareParameters:
    def test_a_spec_sets_parameters_that_outlive_clear(self):
        r = Router("cache-aware:balance_abs=0, balance_rel=1 ,cache_threshold=0.3")
        assert r.policy == "cache-aware:cache_threshold=0.3,balance_abs=0,balance_rel=1"
        d = r.route(tenant_query(cached={"a": 500}), gpus(2, 1))
        assert "beyond balance (>0 apart and >1x)" in d.reason  # 32 % is a hit at 0.3
        r.clear()
        assert r.policy == "cache-aware:cache_threshold=0.3,balance_abs=0,balance_rel=1"
        assert make_policy("cache-aware:").name == "cache-aware"

    def test_move_thresholds_are_parameters(self):
        p = make_policy("cache-aware:move_abs=8,move_rel=0.5")
        assert (p.move_abs, p.move_rel) == (8, 0.5)
        assert p.name == "cache-aware:move_abs=8,move_rel=0.5"
        with pytest.raises(InvalidRequest, match="move_rel >= 0"):
            make_policy("cache-aware:move_rel=-1")

    def test_default_balance_threshold_is_sglang_routers(self):
        assert make_policy("cache-aware").balance_abs == 32

    @pytest.mark.parametrize("spec,words", [
        ("cache-aware:threshold=0.3", "is not one of cache_threshold="),
        ("cache-aware:balance_abs=x", "balance_abs must be a whole number"),
        ("cache-aware:balance_rel=0.5", "balance_rel >= 1"),
        ("cache-aware:cache_threshold", "is not one of"),
    ])
    def test_bad_spec(self, spec, words):
        with pytest.raises(InvalidRequest, match=words) as e:
            make_policy(spec)
        assert e.value.param == "policy"


class TestRecentPrefixes:
    def test_match_is_whole_blocks_of_a_common_prefix(self):
        from engine.routing import RecentPrefixes

        m = RecentPrefixes(block=4)
        m.record(m.hashes(list(range(10))), "a")
        assert m.match(m.hashes(list(range(10)))) == {"a": 8}
        assert m.match(m.hashes([0, 1, 2, 3, 9, 9, 9, 9])) == {"a": 4}
        assert m.match(m.hashes([9, 1, 2, 3])) == {}
        m.record(m.hashes(list(range(6))), "b")
        assert m.match(m.hashes(list(range(8)))) == {"a": 8, "b": 4}

    def test_records_older_than_the_window_are_forgotten(self):
        from engine.routing import RecentPrefixes

        m = RecentPrefixes(block=2, window=2, max_blocks=3)
        m.record(m.hashes([1, 1]), "a")
        m.record(m.hashes([2, 2]), "a")
        assert m.match(m.hashes([1, 1])) == {"a": 2}
        m.record(m.hashes([3, 3]), "a")  # the first record left the window
        assert m.match(m.hashes([1, 1])) == {}

    def test_past_max_blocks_the_oldest_hashes_are_forgotten(self):
        from engine.routing import RecentPrefixes

        m = RecentPrefixes(block=2, window=100, max_blocks=3)
        m.record(m.hashes([1, 1]), "a")
        m.record(m.hashes([2, 2]), "a")
        m.record(m.hashes([4, 4, 4, 4]), "b")  # two blocks: four in all, one too many
        assert m.match(m.hashes([1, 1])) == {}
        assert m.match(m.hashes([2, 2])) == {"a": 2}
        assert m.match(m.hashes([4, 4, 4, 4])) == {"b": 4}

    def test_backends_come_in_the_order_they_were_sent_the_prefix_in_every_process(self):
        # Policies break ties by this order; a set's order would follow PYTHONHASHSEED.
        import subprocess
        import sys

        code = ("from engine.routing import RecentPrefixes\n"
                "m = RecentPrefixes(block=2)\n"
                "for b in ['gpu1', 'cpu', 'gpu0', 'remote-a', 'gpu3', 'b', 'gpu2']: m.record(m.hashes([1, 2]), b)\n"
                "print(' '.join(m.match(m.hashes([1, 2]))))")
        for seed in ("0", "1", "2", "3"):
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHONHASHSEED": seed}).stdout.split()
            assert out == ["gpu1", "cpu", "gpu0", "remote-a", "gpu3", "b", "gpu2"], seed

    def test_a_block_of_zero_tokens_is_refused(self):
        from engine.routing import RecentPrefixes

        with pytest.raises(ValueError):
            RecentPrefixes(block=0)


# ---- N backends ----


class TestPredictedFinishN:
    @pytest.mark.parametrize("n", [3, 4])
    def test_hit_wins_among_equal_loads(self, n):
        loads = [2] * n
        for name in "abcd"[:n]:
            d = Router("predicted-finish").route(tenant_query(cached={name: 1500}), gpus(*loads))
            assert d.backend == name, d.reason
            assert f"1,500 prompt tokens cached on {name}, 0 on" in d.reason
            assert d.score_of(name).score_s < min(s.score_s for s in d.scores if s.name != name)

    @pytest.mark.parametrize("n", [3, 4])
    def test_least_load_wins_without_hits(self, n):
        loads = [6, 5, 7, 6][:n]
        loads[n - 1] = 1
        d = Router("predicted-finish").route(tenant_query(), gpus(*loads))
        assert d.backend == "abcd"[n - 1]
        assert f"on {d.backend} (cap 8)" in d.reason

    def test_overloaded_hit_loses_to_an_idle_third(self):
        # c holds the prefix but has a long queue; a and b are busier than d, which is idle.
        d = Router("predicted-finish").route(tenant_query(cached={"c": 1500}), gpus(4, 4, 30, 0))
        assert d.backend == "d"

    def test_all_backends_get_used(self):
        r = Router("predicted-finish")
        loads = [0, 0, 0, 0]
        for k in range(16):
            d = r.route(tenant_query(f"r{k}"), gpus(*loads))
            loads["abcd".index(d.backend)] += 1
        assert loads == [4, 4, 4, 4]

    def test_first_token_golden(self):
        from engine.routing import predicted_first_token

        assert predicted_first_token(query(), snap("GPU", "gpu", CAL_GPU)).score_s == pytest.approx(20 / 2551)
        g = snap("GPU", "gpu", CAL_GPU, running(1, 10), cap=1)
        s = predicted_first_token(query(), g)
        assert s.score_s == pytest.approx(10 * 0.011 + 20 / 2551)
        assert s.decode_tokens == 10 and s.prefill_tokens == 20
        assert predicted_first_token(query(), g, cached=0).prefill_tokens == PROMPT
