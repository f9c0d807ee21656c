"""The default policy, finish-first:pack (engine/routing/default.py), on synthetic router states:
no model, no threads. Properties over random states (hypothesis) and the study's and the
H200's decisions by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.errors import InvalidRequest
from engine.core.snapshot import BackendSnapshot, CacheStats, Rates, WorkItem
from engine.routing import DEFAULT_POLICY, RouteQuery, Router, finish_time, seed_score
from engine.routing.default import (
    CONVERSING_RECENT,
    CONVERSING_SHARE,
    CONVERSING_WINDOW,
    FILL,
    MIN_CONTEXTS,
    MIN_PEAK_SHARE,
    OPEN_KV_SHARE,
    RESUMED_MIN,
)
from engine.routing.default import PACK_NAME as PACK

M2_GPU = Rates(prefill_tok_s=2551, decode_tok_s=293, source="override")
M2_CPU = Rates(prefill_tok_s=73, decode_tok_s=45, source="override")
# The simulator's h200 profile: what the router is told (engine/sim/simulate.py, docs/results/gpu/grid2).
H200_GPU = Rates(53514.1, 3115.6, 0.0010097, 0.00029451, "calibrated",
                 (0.0012400, 0.0016133, 0.0017627, 0.0019968, 0.0023091, 0.0025667, 0.0028006, 0.0030280,
                  0.0045841, 0.0046991, 0.0047219, 0.0048108, 0.0049083, 0.0049837, 0.0050488, 0.0051355))
H200_CPU = Rates(1969.7, 128.0, 0.0208902, 0.0026692, "calibrated", (0.0230551, 0.0269214, 0.0290254, 0.0312511))


def snap(name, device, rates, items=(), cap=4, n_ctx=0, healthy=True, pinned=0, group="") -> BackendSnapshot:
    return BackendSnapshot(name=name, device=device, cap=cap, n_ctx=n_ctx or 65536, rates=rates, items=tuple(items),
                           kv_cells_total=n_ctx, cache=CacheStats(pinned_tokens=pinned), healthy=healthy,
                           group=group)


def running(n, decode_left, prompt=516, cached=496, prefix="r", generated=0):
    return [WorkItem(f"{prefix}{k}", True, prompt, cached, 0, decode_left, generated) for k in range(n)]


def queued(n, prompt=516, cached=496, decode_left=128, prefix="q"):
    return [WorkItem(f"{prefix}{k}", False, prompt, cached, prompt - cached, decode_left, 0) for k in range(n)]


def query(rid="req", prompt=516, max_tokens=128, cached=None, tokens=(), resumed=None):
    return RouteQuery(rid, prompt, max_tokens, cached or {}, tokens=tuple(tokens), resumed=resumed or {})


# ---- the decisions the issue names ----


def test_the_default_is_finish_first_packing_a_devices_contexts():
    assert DEFAULT_POLICY == PACK == "finish-first:pack"
    assert Router().policy == Router("default").policy == PACK


def test_the_studys_request_8_still_goes_to_the_idle_cpu():
    """The M2: 4 running on the GPU with 122 tokens left and 3 queued; the CPU would finish
    request 8 sooner (3.118 s), so it still gets it."""
    g = snap("gpu", "gpu", M2_GPU, running(4, 122) + queued(3))
    c = snap("cpu", "cpu", M2_CPU)
    q = query("req-8", cached={"gpu": 496, "cpu": 496})
    d = Router().route(q, [g, c])
    assert d.backend == "cpu", d.reason
    assert round(d.score_of("cpu").score_s, 3) == 3.118  # idle: its prefill then its decode
    assert d.score_of("gpu").score_s > d.score_of("cpu").score_s
    assert d.reason.startswith("cpu finishes first: cpu in 3.118 s")


def test_the_studys_request_7_stays_on_the_gpu():
    g = snap("gpu", "gpu", M2_GPU, running(4, 124) + queued(2))
    c = snap("cpu", "cpu", M2_CPU)
    d = Router().route(query("req-7", cached={"gpu": 496, "cpu": 496}), [g, c])
    assert d.backend == "gpu", d.reason


def test_a_long_reply_is_not_sent_to_a_slow_cpu_that_seed_score_prefers():
    """Issue 25's decision: the tokens queued on the GPU (about 16,500 prefill + 12,000 decode there)
    make seed-score pick the CPU, whose one sequence decodes at ~30 tok/s; the GPU finishes a
    256-token reply far sooner."""
    tenant = dict(prompt=1550, cached=1000)
    g = snap("gpu", "gpu", H200_GPU, running(16, 256, **tenant) + queued(32, decode_left=256, **tenant), cap=16,
             n_ctx=65536)
    cpu_rates = Rates(1969.7, 180.0, 0.030, 0.0025, "calibrated")  # 15 threads: ~30 tok/s for one sequence
    c = snap("cpu", "cpu", cpu_rates, running(1, 491, prompt=1550, cached=1500), cap=4, n_ctx=4096)
    q = query(prompt=1550, max_tokens=256, cached={"gpu": 1500, "cpu": 1500})
    assert Router("seed-score").route(q, [g, c]).backend == "cpu"
    d = Router().route(q, [g, c])
    assert d.backend == "gpu", d.reason
    gpu_s, cpu_s = d.score_of("gpu").score_s, d.score_of("cpu").score_s
    assert gpu_s < 0.6 * cpu_s
    assert "at batch 2" in d.reason and "tok/s for it" in d.reason


def test_a_cached_prefix_keeps_its_tenant_where_it_finishes_first():
    """Two equal backends, one holding the tenant's 1,500-token prefix: the request goes there
    even with a request more in its queue, since its prefill there is 50 tokens, not 1,550."""
    rates = Rates(prefill_tok_s=2000, decode_tok_s=100, source="override")
    a = snap("a", "gpu", rates, running(1, 50, prompt=1550, cached=1500), cap=8)
    b = snap("b", "gpu", rates, cap=8)
    d = Router().route(query(prompt=1550, max_tokens=64, cached={"a": 1500}), [b, a])
    assert d.backend == "a", d.reason
    assert "1,500 cached" in d.reason


def test_a_prefix_routed_moments_ago_counts_as_cached_there():
    """The tenant's first request is still in flight on `a` (nothing cached yet): its second
    one follows it, priced with the prefix computed once."""
    rates = Rates(prefill_tok_s=2000, decode_tok_s=100, step_alpha_s=0.01, step_beta_s=0.0001, source="override")
    prompt = tuple(range(1000, 2500))
    r = Router()
    first = r.route(query("t1", prompt=1550, max_tokens=64, tokens=prompt + tuple(range(50))),
                    [snap("a", "gpu", rates, cap=8), snap("b", "gpu", rates, cap=8)])
    assert first.backend == "a"
    # t1 is mid-prefill on a: 500 of its 1,550 tokens to go
    a = snap("a", "gpu", rates, [WorkItem("t1", True, 1550, 0, 500, 64, 0)], cap=8)
    b = snap("b", "gpu", rates, cap=8)
    second = r.route(query("t2", prompt=1550, max_tokens=64, tokens=prompt + tuple(range(60, 110))), [a, b])
    assert second.backend == "a", second.reason
    assert "routed there, in flight" in second.reason


def test_a_conversation_stays_on_its_context_when_a_lighter_one_would_finish_a_little_sooner():
    """Four contexts of one H200 (the default layout): the conversation's 1,700 tokens are
    cached on gpu-a, which runs 12 sequences; gpu-b runs 8. Priced as separate machines, gpu-b
    finishes first (a smaller batch decodes faster than 1,650 tokens prefill); sharing one
    device, the turn stays where its prefix is (cache-aware among the contexts)."""
    ctx = [snap("gpu-a", "gpu", H200_GPU, running(12, 120, prompt=1800, cached=1700, prefix="a"), cap=32, group="gpu"),
           snap("gpu-b", "gpu", H200_GPU, running(8, 120, prompt=1800, cached=1700, prefix="b"), cap=32, group="gpu")]
    q = query(prompt=1750, max_tokens=150, cached={"gpu-a": 1700})
    alone = [snap(s.name, s.device, s.rates, s.items, cap=s.cap) for s in ctx]  # no group: separate machines
    assert Router().route(q, alone).backend == "gpu-b"
    d = Router().route(q, ctx)
    assert d.backend == "gpu-a", d.reason
    assert "gpu finishes first" in d.reason and "cache-aware" in d.reason


def _contexts(*items_per_context, cap=32, used=(), total=65536):
    """One H200 as four (or more) contexts of a group, holding these many running requests."""
    used = tuple(used) + (0,) * (len(items_per_context) - len(used))
    return [replace(snap(f"gpu-{chr(97 + k)}", "gpu", H200_GPU, running(n, 100, prefix=f"{k}-"), cap=cap,
                         n_ctx=total, group="gpu"), kv_cells_used=u)
            for k, (n, u) in enumerate(zip(items_per_context, used))]


def test_a_devices_requests_stay_on_its_contexts_in_use_until_they_are_full():
    """New work joins the MIN_CONTEXTS contexts already running (larger batches of three contexts,
    not eight small ones each stepping on its own), even though an idle one would finish it sooner."""
    ctx = _contexts(6, 6, 6, 0, 0)
    q = query(prompt=1550, max_tokens=128)
    assert finish_time(q, ctx[3]).finish_s < finish_time(q, ctx[0]).finish_s
    d = Router(PACK).route(q, ctx)
    assert d.backend in ("gpu-a", "gpu-b", "gpu-c"), d.reason
    assert "3 in use, 2 idle until those are full" in d.reason


def test_three_contexts_are_kept_in_use():
    """An idle device's first request goes to its first context; while fewer than MIN_CONTEXTS
    are in use, the next opens the first idle one, though a shared prefix is cached on those in
    use (a long prompt's 1,000 shared tokens drew every request to two contexts otherwise)."""
    assert MIN_CONTEXTS == 3
    r = Router(PACK)
    d = r.route(query(prompt=1550, max_tokens=128), _contexts(0, 0, 0, 0))
    assert d.backend == "gpu-a" and "all 4 idle, the first 3" in d.reason, d.reason
    shared = {"gpu-a": 1000, "gpu-b": 1000}
    d = r.route(query(prompt=1516, max_tokens=512, cached=shared), _contexts(6, 6, 0, 0))
    assert d.backend == "gpu-c", d.reason
    assert "2 in use, so gpu-c opens (3 kept in use)" in d.reason
    d = Router(f"{PACK}:min_contexts=1").route(query(prompt=1550, max_tokens=128), _contexts(6, 0, 0, 0))
    assert d.backend == "gpu-a", d.reason
    assert "1 in use, 3 idle until those are full" in d.reason


def test_an_idle_context_opens_when_every_context_in_use_holds_its_cap():
    d = Router(PACK).route(query(prompt=1550, max_tokens=128), _contexts(16, 16, 16, 0, cap=16))
    assert d.backend == "gpu-d", d.reason
    assert ("every context in use is full (gpu-a holds 16 at cap 16; gpu-b holds 16 at cap 16; gpu-c holds 16 "
            "at cap 16), so gpu-d opens") in d.reason


def test_a_context_is_full_at_fill_though_its_live_cap_climbed():
    """A live cap of 64 (climbed while requests waited) does not fill one context to 64: at FILL,
    another opens. `fill=0` leaves the live cap alone."""
    q = query(prompt=1550, max_tokens=128)
    d = Router(PACK).route(q, _contexts(FILL, FILL, FILL, 0, cap=64))
    assert d.backend == "gpu-d", d.reason
    assert f"gpu-a holds {FILL}, filled at {FILL}" in d.reason
    assert Router(PACK).route(q, _contexts(FILL - 1, FILL, FILL, 0, cap=64)).backend == "gpu-a"
    assert Router(f"{PACK}:fill=0").route(q, _contexts(FILL, FILL, FILL, 0, cap=64)).backend != "gpu-d"
    d = Router(f"{PACK}:fill=16").route(q, _contexts(16, 16, 16, 0, cap=64))
    assert d.backend == "gpu-d" and "gpu-a holds 16, filled at 16" in d.reason, d.reason


def test_strict_keeps_new_work_off_a_full_context():
    """`strict=1`: a context at `fill` takes nothing while another in use has room, though it holds
    the prompt's prefix; once every one in use is full, the request goes to the one that opens.
    Without it, cache-aware sends the prefix home to the full context."""
    q = query(prompt=1550, max_tokens=128, cached={"gpu-a": 1500})
    assert Router(f"{PACK}:fill=16").route(q, _contexts(16, 10, 10, 0, cap=64)).backend == "gpu-a"
    d = Router(f"{PACK}:fill=16,strict=1").route(q, _contexts(16, 10, 10, 0, cap=64))
    assert d.backend in ("gpu-b", "gpu-c"), d.reason
    assert "2 of 3 in use not full (gpu-a holds 16, filled at 16)" in d.reason
    d = Router(f"{PACK}:fill=16,strict=1").route(q, _contexts(16, 16, 16, 0, cap=64))
    assert d.backend == "gpu-d" and "so gpu-d opens" in d.reason, d.reason


@pytest.mark.parametrize("spec, error", [("min_contexts=0", "at least 1"), ("fill=x", "whole number"),
                                         ("open=2", "not one of min_contexts=, fill=, strict="),
                                         ("strict=2", "strict 0 or 1")])
def test_a_bad_pack_parameter_is_a_clear_error(spec, error):
    with pytest.raises(InvalidRequest, match=error):
        Router(f"{PACK}:{spec}")


def test_pack_parameters_name_the_policy_in_a_fixed_order():
    assert Router(f"{PACK}:fill=16,min_contexts=1").policy == f"{PACK}:min_contexts=1,fill=16"


def test_a_context_whose_pool_is_half_used_is_full():
    """Past OPEN_KV_SHARE of its pool, a context takes no new prefix: every step attends over
    the cells in use."""
    q = query(prompt=1550, max_tokens=128)
    room = int(OPEN_KV_SHARE * 65536) - 1550 - 16
    assert Router(PACK).route(q, _contexts(4, 4, 4, 0, used=(room,) * 3)).backend != "gpu-d"
    assert Router(PACK).route(q, _contexts(4, 4, 4, 0, used=(room + 1,) * 3)).backend == "gpu-d"


def test_a_prompt_cached_on_an_idle_context_goes_back_there():
    """A conversation whose context has gone idle is still at home there: its history counts
    that context as in use, and it opens no other to keep MIN_CONTEXTS in use, though the
    device does not serve conversations (one resumed request in nine)."""
    r = Router(PACK)
    for k in range(8):
        r.route(query(f"one-shot{k}", prompt=1550, max_tokens=128), _contexts(6, 6, 6))
    q = query(prompt=1800, max_tokens=128, cached={"gpu-c": 1700}, resumed={"gpu-c": 1600})
    d = r.route(q, _contexts(6, 0, 0))
    assert d.backend == "gpu-c", d.reason
    assert "serves conversations" not in d.reason


def _new_conversation(k):
    return query(f"new{k}", prompt=1400, max_tokens=128, cached={"gpu-a": 1246})


def _next_turn(k):
    return query(f"turn{k}", prompt=2400, max_tokens=128, cached={"gpu-a": 2300}, resumed={"gpu-a": 1050})


def test_a_device_serving_conversations_shares_its_new_work_out():
    """Packed until its requests resume conversations: past CONVERSING_SHARE of the last
    CONVERSING_WINDOW, a new conversation goes to the context holding fewest (an idle one), not
    onto the busy ones, whose pools must keep the histories of those they hold."""
    r = Router(PACK)
    resumes = int(CONVERSING_SHARE * CONVERSING_WINDOW)
    for k in range(CONVERSING_WINDOW - resumes):
        d = r.route(_new_conversation(k), _contexts(6, 6, 6, 0))
        assert d.backend == "gpu-a", d.reason
    for k in range(resumes - 1):
        assert r.route(_next_turn(k), _contexts(6, 6, 6, 0)).backend == "gpu-a"
    d = r.route(_new_conversation("a"), _contexts(6, 6, 6, 0))
    assert d.backend == "gpu-a", d.reason  # 7 of the last 32 resumed one: still packed
    assert r.route(_next_turn("b"), _contexts(6, 6, 6, 0)).backend == "gpu-a"  # a turn goes home
    d = r.route(_new_conversation("c"), _contexts(6, 3, 0, 0))
    assert d.backend == "gpu-c", d.reason
    assert (f"it serves conversations ({resumes} of its last {CONVERSING_WINDOW} requests resumed one); "
            "a new one goes to the context holding fewest: sent to gpu-c") in d.reason
    d = r.route(_next_turn("d"), _contexts(6, 3, 0, 0))
    assert d.backend == "gpu-a", d.reason
    assert "this one resumes one" in d.reason


def test_a_device_packs_again_once_its_conversations_end():
    """A device that served conversations (every context holding some) gets requests that
    resume nothing: after CONVERSING_RECENT of them it packs again, onto the busiest contexts
    that hold its load, and the others drain."""
    r = Router(PACK)
    for k in range(CONVERSING_WINDOW):
        r.route(_next_turn(k), _contexts(6, 6, 6, 6, 6, 6))
    spread = _contexts(3, 5, 2, 4, 1, 1, 0)
    for k in range(CONVERSING_RECENT - 1):  # with the next, the last CONVERSING_RECENT resumed nothing
        d = r.route(query(f"t{k}", prompt=1550, max_tokens=128), spread)
        assert "serves conversations" in d.reason, d.reason
    d = r.route(query("t-next", prompt=1550, max_tokens=128), spread)
    assert "serves conversations" not in d.reason
    assert d.backend in ("gpu-b", "gpu-d", "gpu-a"), d.reason
    assert "3 in use" in d.reason, d.reason


def test_a_resumed_conversation_goes_home_to_a_draining_context():
    r = Router(PACK)
    q = query(prompt=1800, max_tokens=128, cached={"gpu-e": 1700}, resumed={"gpu-e": 1600})
    d = r.route(q, _contexts(9, 8, 7, 6, 2))
    assert d.backend == "gpu-e", d.reason


def test_a_tenants_requests_resume_nothing_so_they_stay_packed():
    """Every request shares the tenant's cached prefix, none resumes an earlier one's own part."""
    r = Router(PACK)
    for k in range(2 * CONVERSING_WINDOW):
        q = query(f"t{k}", prompt=1550, max_tokens=128, cached={"gpu-a": 1500})
        d = r.route(q, _contexts(6, 6, 6, 0))
        assert d.backend == "gpu-a", d.reason


def test_a_chat_templates_few_tokens_are_no_resumed_history():
    r = Router(PACK)
    for k in range(CONVERSING_WINDOW):
        q = query(f"n{k}", prompt=1400, max_tokens=128, cached={"gpu-a": 1250}, resumed={"gpu-a": RESUMED_MIN - 1})
        assert r.route(q, _contexts(6, 6, 6, 0)).backend == "gpu-a"


def test_finish_first_alone_spreads_a_devices_work_over_its_contexts():
    """Without `:pack` a new prompt goes where cache-aware finds its first token soonest: an
    idle context, not the busy one."""
    assert Router("finish-first").route(query(prompt=1550, max_tokens=128), _contexts(6, 0, 0, 0)).backend != "gpu-a"


def test_the_first_request_to_an_idle_device_goes_to_its_first_context():
    d = Router(PACK).route(query(prompt=1550, max_tokens=128), _contexts(0, 0, 0, 0))
    assert d.backend == "gpu-a", d.reason
    assert "all 4 idle, the first" in d.reason


def test_a_context_that_would_finish_after_another_device_gets_nothing():
    """gpu-a holds the prefix but is full with a queue; gpu-b is free but has nothing cached,
    and the CPU, empty, finishes before gpu-a: the request goes to gpu-b, never gpu-a."""
    busy = running(4, 400, prompt=600, cached=500, prefix="a") + queued(6, decode_left=400, prefix="qa")
    ctx = [snap("gpu-a", "gpu", M2_GPU, busy, cap=4, group="gpu"),
           snap("gpu-b", "gpu", M2_GPU, cap=4, group="gpu"),
           snap("cpu", "cpu", Rates(prefill_tok_s=2000, decode_tok_s=90, source="override"))]  # 15 % of the GPU's two
    q = query(prompt=520, max_tokens=32, cached={"gpu-a": 496})
    finish = {s.name: finish_time(q, s).finish_s for s in ctx}
    assert finish["gpu-b"] < finish["cpu"] < finish["gpu-a"], finish
    d = Router().route(q, ctx)
    assert d.backend == "gpu-b", d.reason


def test_the_h200s_cpu_gets_nothing_even_when_it_would_finish_first():
    """Its peak decode is 4 % of one GPU context's: predicted from an idle calibration, it ran at
    ~3 tok/s beside busy GPU contexts (docs/results/gpu/contexts1). The M2's CPU, at 15 %, still
    takes request 8 (above)."""
    g = snap("gpu", "gpu", H200_GPU, running(16, 512) + queued(64, decode_left=512), cap=16, n_ctx=65536)
    c = snap("cpu", "cpu", H200_CPU, cap=4, n_ctx=16384)
    q = query(max_tokens=16)
    assert finish_time(q, c).finish_s < finish_time(q, g).finish_s  # the CPU would finish first
    d = Router().route(q, [g, c])
    assert d.backend == "gpu"
    assert "left out, under 10% of gpu's peak decode" in d.reason and "cpu in" in d.reason
    assert Router().route(q, [c]).backend == "cpu"  # alone, it serves


def test_a_gpu_of_many_contexts_is_weighed_whole_against_the_cpu():
    """Eight contexts share one GPU: with online rates each measures only its share, and one
    context's peak is under ten times the CPU's. The device's peak, all eight together, is what
    the CPU is weighed against, so it still gets nothing (docs/results/gpu/defaults3: a
    15-thread CPU took 1-2 of 200 requests beside eight contexts and held a row for 13 s)."""
    share = Rates(53514.1 / 8, 3115.6 / 8, source="override",
                  step_table=tuple(t * 8 for t in H200_GPU.step_table))  # one eighth of the GPU
    cpu = H200_CPU
    assert cpu.peak_decode_tok_s(4) >= MIN_PEAK_SHARE * share.peak_decode_tok_s(16)  # against one context: in
    ctx = [snap(f"gpu-{c}", "gpu", share, running(16, 512) + queued(8, decode_left=512), cap=16, group="gpu")
           for c in "abcdefgh"]
    c = snap("cpu", "cpu", cpu, cap=4, n_ctx=16384)
    q = query(max_tokens=16)
    assert all(finish_time(q, c).finish_s < finish_time(q, g).finish_s for g in ctx)  # it would finish first
    d = Router().route(q, [*ctx, c])
    assert d.backend != "cpu", d.reason
    assert "left out, under 10% of gpu's peak decode" in d.reason
    alone = [snap(s.name, s.device, s.rates, s.items, cap=s.cap) for s in ctx]  # no group: eight machines
    assert Router().route(q, [*alone, c]).backend == "cpu"


def test_backends_of_one_kind_are_never_left_out_for_being_slower():
    """Two engines of a fleet (or two CPU backends) measured apart by a loaded machine's noise:
    the slower still takes work when it finishes first."""
    fast = Rates(60000, 4000, source="override")
    slow = Rates(600, 40, source="override")  # 1 %
    for device in ("remote", "cpu", "gpu"):
        a = snap("a", device, fast, running(4, 512) + queued(40, decode_left=512), cap=4)
        b = snap("b", device, slow, cap=4)
        q = query(max_tokens=4)
        assert finish_time(q, b).finish_s < finish_time(q, a).finish_s
        assert Router().route(q, [a, b]).backend == "b", device


def test_a_full_kv_pool_makes_the_request_wait_for_room():
    rates = Rates(prefill_tok_s=10000, decode_tok_s=1000, source="override")
    roomy = snap("roomy", "gpu", rates, running(2, 100, prompt=1000, cached=0), cap=8, n_ctx=100000)
    full = snap("full", "gpu", rates, running(2, 100, prompt=1000, cached=0), cap=8, n_ctx=2100)
    q = query(prompt=1000, max_tokens=50)
    assert finish_time(q, full).wait_s > finish_time(q, roomy).wait_s
    assert Router().route(q, [full, roomy]).backend == "roomy"


def test_kv_room_counts_the_cells_running_sequences_grow_into():
    """920 cells: A (500 cells, 10 tokens to go) and B (300 cells, 100 to go) run. When A ends,
    B holds 310 cells, so a 600-token prompt (+16 headroom) fits only once B is done too."""
    rates = Rates(prefill_tok_s=1e9, decode_tok_s=100, step_alpha_s=0.01, source="override")
    items = [WorkItem("A", True, 500, 0, 0, 10, 0), WorkItem("B", True, 300, 0, 0, 100, 0)]
    f = finish_time(query(prompt=600, max_tokens=5), snap("x", "gpu", rates, items, cap=8, n_ctx=920))
    assert f.batch == 1  # it runs alone, after B
    assert f.wait_s == pytest.approx(100 * 0.01, rel=1e-6)
    assert f.finish_s == pytest.approx(105 * 0.01, rel=1e-6)


def test_an_unreachable_backend_is_never_chosen():
    dead = snap("dead", "gpu", Rates(prefill_tok_s=0, decode_tok_s=0))
    d = Router().route(query(), [dead, snap("cpu", "cpu", M2_CPU)])
    assert d.backend == "cpu"
    assert "never (no rate)" in d.reason
    assert d.to_dict()["scores"][0]["score_s"] is None


def test_scores_add_up():
    d = Router().route(query(cached={"gpu": 496}), [snap("gpu", "gpu", M2_GPU, running(4, 60) + queued(2)),
                                                    snap("cpu", "cpu", M2_CPU)])
    for s in d.scores:
        assert s.score_s == pytest.approx(s.prefill_s + s.decode_s)


def test_the_seed_score_golden_number_is_untouched():
    assert round(seed_score(query(cached={"cpu": 496}), snap("cpu", "cpu", M2_CPU)).score_s, 3) == 3.118


# ---- properties over random states ----

RATES = st.builds(
    lambda prefill, decode, alpha, beta: Rates(prefill, decode, alpha, beta, "override"),
    st.floats(50, 60000), st.floats(10, 5000), st.sampled_from([0.0, 0.001, 0.02]),
    st.sampled_from([0.0, 0.0003, 0.003]))


@st.composite
def items(draw, prefix: str):
    out = []
    for k in range(draw(st.integers(0, 10))):
        prompt = draw(st.integers(1, 2000))
        cached = draw(st.integers(0, prompt - 1))
        run = draw(st.booleans())
        generated = draw(st.integers(0, 50)) if run else 0
        prefill_left = draw(st.integers(0, prompt - cached)) if run else prompt - cached
        out.append(WorkItem(f"{prefix}{k}", run, prompt, cached, prefill_left, draw(st.integers(0, 512)), generated))
    return sorted(out, key=lambda i: not i.running)


@st.composite
def backends(draw):
    snaps = []
    for k in range(draw(st.integers(2, 4))):
        name = f"b{k}"
        snaps.append(snap(name, draw(st.sampled_from(["gpu", "cpu"])), draw(RATES), draw(items(name)),
                          cap=draw(st.integers(1, 32)), n_ctx=draw(st.sampled_from([0, 4096, 16384])),
                          healthy=draw(st.booleans()) if k else True,
                          group=draw(st.sampled_from(["", "gpu"]))))  # "gpu": contexts of one device
    return snaps


@st.composite
def queries(draw, names):
    prompt = draw(st.integers(1, 3000))
    cached = {n: draw(st.integers(0, prompt)) for n in names}
    return RouteQuery("new", prompt, draw(st.integers(1, 512)), cached)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_request_never_goes_where_it_would_finish_later(data):
    # Later than any backend on another device; among one device's contexts cache-aware picks.
    # A CPU too slow to take part (peak decode under MIN_PEAK_SHARE of a GPU device's) gets nothing.
    snaps = data.draw(backends())
    q = data.draw(queries([s.name for s in snaps]))
    d = Router().route(q, snaps)
    finish = {s.name: finish_time(q, s).finish_s for s in snaps}
    device = {s.name: s.group or s.name for s in snaps}
    peak = {s.name: s.rates.peak_decode_tok_s(s.cap) for s in snaps if s.healthy}
    kind = {s.name: s.device for s in snaps}
    gpus: dict[str, float] = {}  # each GPU device (its contexts together): its peak
    for n, p in peak.items():
        if kind[n] == "gpu":
            gpus[device[n]] = gpus.get(device[n], 0.0) + p
    top = max(gpus.values(), default=0.0)
    eligible = [n for n, p in peak.items() if not (kind[n] == "cpu" and p < MIN_PEAK_SHARE * top)]
    assert d.backend in eligible, (d.reason, peak)
    elsewhere = [n for n in eligible if device[n] != device[d.backend]]
    assert all(finish[d.backend] <= finish[n] for n in elsewhere), (d.reason, finish)
    if not any(s.group for s in snaps):
        assert all(finish[d.backend] <= finish[n] for n in eligible), (d.reason, finish)
    assert d.score_of(d.backend).score_s == pytest.approx(finish[d.backend])


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_more_work_ahead_never_makes_a_request_finish_sooner(data):
    s = data.draw(backends())[0]
    q = data.draw(queries([s.name]))
    extra = WorkItem("extra", False, 600, 0, 600, data.draw(st.integers(1, 512)), 0)
    busier = snap(s.name, s.device, s.rates, s.items + (extra,), cap=s.cap, n_ctx=s.kv_cells_total)
    assert finish_time(q, busier).finish_s >= finish_time(q, s).finish_s - 1e-9


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_a_longer_cached_prefix_never_makes_a_request_finish_later(data):
    s = data.draw(backends())[0]
    q = data.draw(queries([s.name]))
    more = data.draw(st.integers(q.cached_on(s.name), q.prompt_tokens))
    assert finish_time(q, s, more).finish_s <= finish_time(q, s).finish_s + 1e-9
