"""Workload generation (`engine.sim.workload`): pure, deterministic, no model."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from dataclasses import replace

import pytest

from engine.sim.workload import (
    TOKEN_LOW,
    WorkloadSpec,
    build_workload,
    seed_workload,
    shared_tokens_for,
    tokenized,
    with_requests,
)


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TestSeedWorkload:
    def test_the_study_exactly(self):
        wl = build_workload(seed_workload(8))
        assert len(wl.prefix) == 496
        assert [len(r.prompt) for r in wl.requests] == [516] * 8
        assert all(r.prompt[:496] == wl.prefix for r in wl.requests)
        assert [(r.max_tokens, r.output_tokens) for r in wl.requests] == [(128, 128)] * 8
        assert [r.arrival_s for r in wl.requests] == pytest.approx([0.05 * i for i in range(8)])
        assert wl.spec.shared_fraction == pytest.approx(496 / 516)

    def test_suffixes_are_each_requests_own_so_every_hit_is_the_prefix(self):
        wl = build_workload(seed_workload(16))
        suffixes = {r.prompt[496:] for r in wl.requests}
        assert len(suffixes) == 16
        # no request shares more than the warmed prefix with another (the golden state)
        assert max(common_prefix(a.prompt, b.prompt) for a in wl.requests for b in wl.requests if a is not b) < 500

    def test_identical_prompts_as_the_study_sent_them(self):
        wl = build_workload(seed_workload(5, identical=True))
        assert len({r.prompt for r in wl.requests}) == 1
        assert wl.requests[0].prompt[:496] == wl.prefix

    def test_a_workload_is_reproducible_per_seed_per_run(self):
        spec = seed_workload(6)
        a, b = build_workload(spec, 0), build_workload(spec, 0)
        assert a == b
        c = build_workload(spec, 1)
        assert c.prefix == a.prefix  # the same warm-up work every run
        assert [r.prompt for r in c.requests] != [r.prompt for r in a.requests]  # no full hits from old runs
        d = build_workload(replace(spec, seed=7), 0)
        assert d.prefix != a.prefix

    def test_shrunk_for_tests(self):
        wl = build_workload(seed_workload(3, prefix_tokens=48, suffix_tokens=8, gen_tokens=8, interval_s=0.01))
        assert [len(r.prompt) for r in wl.requests] == [56] * 3
        assert wl.duration_s == pytest.approx(0.02)

    def test_tokens_stay_inside_a_small_vocabulary(self):
        wl = build_workload(replace(seed_workload(4), vocab_size=512))
        assert all(TOKEN_LOW <= t < 512 for r in wl.requests for t in r.prompt)


class TestSharedFraction:
    @pytest.mark.parametrize("fraction, shared", [(0.0, 0), (0.5, 258), (0.96, 496), (1.0, 516)])
    def test_rounding_up_gives_the_seed_prefix(self, fraction, shared):
        assert shared_tokens_for(fraction, 516) == shared

    @pytest.mark.parametrize("fraction", [0.0, 0.5, 0.96])
    def test_prompts_share_exactly_that_much(self, fraction):
        shared = shared_tokens_for(fraction, 516)
        wl = build_workload(WorkloadSpec(n_requests=6, shared_tokens=shared))
        assert len(wl.prefix) == shared
        for r in wl.requests:
            assert len(r.prompt) == 516 and r.prompt[:shared] == wl.prefix
        pairs = [common_prefix(a.prompt, b.prompt) for a in wl.requests for b in wl.requests if a is not b]
        assert min(pairs) >= shared and max(pairs) < shared + 3  # random suffixes rarely agree

    def test_out_of_range(self):
        with pytest.raises(ValueError):
            shared_tokens_for(1.5, 516)


class TestOutputLengths:
    def test_uniform_outputs_stay_within_the_256_budget(self):
        wl = build_workload(WorkloadSpec(n_requests=400, output="uniform"))
        lengths = [r.output_tokens for r in wl.requests]
        assert min(lengths) >= 16 and max(lengths) <= 256
        assert {r.max_tokens for r in wl.requests} == {256}
        assert statistics.fmean(lengths) == pytest.approx(136, abs=12)
        assert len(set(lengths)) > 50

    def test_fixed(self):
        wl = build_workload(WorkloadSpec(n_requests=5, gen_tokens=64))
        assert {(r.max_tokens, r.output_tokens) for r in wl.requests} == {(64, 64)}


class TestArrivals:
    def test_poisson_offers_exactly_the_rate(self):
        spec = WorkloadSpec(n_requests=50, arrival="poisson", rate=20.0)
        times = [r.arrival_s for r in build_workload(spec).requests]
        assert times[0] == 0.0
        assert times[-1] == pytest.approx(49 / 20.0)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert min(gaps) >= 0 and len(set(round(g, 9) for g in gaps)) > 40  # not a fixed interval

    def test_rate_defaults_to_the_interval(self):
        spec = WorkloadSpec(n_requests=11, arrival="poisson", interval_s=0.1)
        assert build_workload(spec).requests[-1].arrival_s == pytest.approx(1.0)

    def test_burstiness_orders_the_spread_of_gaps(self):
        def cv(burstiness):
            spec = WorkloadSpec(n_requests=2000, arrival="gamma", rate=10.0, burstiness=burstiness)
            times = [r.arrival_s for r in build_workload(spec).requests]
            gaps = [b - a for a, b in itertools.pairwise(times)]
            return statistics.stdev(gaps) / statistics.fmean(gaps)

        bursty, poisson, smooth = cv(0.25), cv(1.0), cv(4.0)
        assert bursty > poisson > smooth
        assert poisson == pytest.approx(1.0, abs=0.1)

    def test_arrivals_are_a_function_of_the_run(self):
        spec = WorkloadSpec(n_requests=10, arrival="poisson", rate=5.0)
        assert build_workload(spec, 2).requests == build_workload(spec, 2).requests
        assert ([r.arrival_s for r in build_workload(spec, 0).requests]
                != [r.arrival_s for r in build_workload(spec, 1).requests])


class TestValidation:
    @pytest.mark.parametrize("field, value", [
        ("n_requests", 0), ("shared_tokens", 600), ("output", "random"), ("arrival", "burst"),
        ("min_output", 300), ("burstiness", 0.0), ("gen_tokens", 0), ("vocab_size", 100),
    ])
    def test_bad_fields_are_named(self, field, value):
        with pytest.raises(ValueError, match=field):
            replace(WorkloadSpec(n_requests=1), **{field: value}).validate()

    def test_with_requests(self):
        assert with_requests(seed_workload(1), 48).n_requests == 48

    def test_names(self):
        assert seed_workload(4).name() == "seed"
        spec = WorkloadSpec(n_requests=4, shared_tokens=258, output="uniform", arrival="poisson", rate=20)
        assert spec.name() == "shared 50%, out 16-256, poisson 20/s"
        assert spec.to_dict()["max_tokens"] == 256


def tenant_spec(**kw) -> WorkloadSpec:
    base = dict(n_requests=300, prompt_tokens=1550, shared_tokens=1500, tenants=8, output="uniform",
                min_output=32, max_output=256, arrival="poisson", rate=60.0)
    return WorkloadSpec(**{**base, **kw}).validate()


class TestTenants:
    def test_each_request_is_its_tenants_prefix_plus_its_own_suffix(self):
        wl = build_workload(tenant_spec())
        assert len(wl.prefixes) == 8 and len({p for p in wl.prefixes}) == 8
        assert wl.prefix == ()  # nothing is warmed: a router must learn where prefixes live
        for r in wl.requests:
            assert 0 <= r.tenant < 8 and len(r.prompt) == 1550
            assert r.prompt[:1500] == wl.prefixes[r.tenant]
            assert r.text[:r.prefix_chars] == wl.prefix_texts[r.tenant]
            assert len(r.text.split()) == 1550 and r.text.startswith(" ")
        assert len({r.prompt[1500:] for r in wl.requests}) == 300

    def test_zipf_makes_tenant_zero_the_most_popular(self):
        wl = build_workload(tenant_spec(n_requests=3000))
        counts = Counter(r.tenant for r in wl.requests)
        assert counts[0] > counts[1] > counts[7]
        # weight of tenant 0 under zipf:1 over 8 tenants: 1 / H(8) = 0.368
        assert counts[0] / 3000 == pytest.approx(1 / sum(1 / k for k in range(1, 9)), abs=0.03)

    def test_the_tenant_skew_shapes_the_tenant_counts(self):
        steep = Counter(r.tenant for r in build_workload(tenant_spec(n_requests=2000, tenant_skew="zipf:2")).requests)
        flat = Counter(r.tenant for r in build_workload(tenant_spec(n_requests=2000, tenant_skew="uniform")).requests)
        assert steep[0] / 2000 > 0.55
        assert max(flat.values()) - min(flat.values()) < 100  # 250 each, give or take

    def test_only_requests_change_with_the_run(self):
        a, b = build_workload(tenant_spec(), 0), build_workload(tenant_spec(), 1)
        assert a == build_workload(tenant_spec(), 0)
        assert a.prefixes == b.prefixes and a.prefix_texts == b.prefix_texts
        assert [r.text for r in a.requests] != [r.text for r in b.requests]

    def test_poisson_at_sixty_per_second(self):
        wl = build_workload(tenant_spec())
        assert wl.duration_s == pytest.approx(299 / 60)
        assert all(32 <= r.output_tokens <= 256 and r.max_tokens == 256 for r in wl.requests)

    def test_tokenized_prompts_share_their_tenants_prefix_tokens(self):
        # A stand-in tokenizer with the model's contract: one id per character (the real one is
        # exercised by the fleet and grid tests); BOS only when asked.
        def tokenize(text, first):
            return ([1] if first else []) + [ord(c) for c in text]

        wl = tokenized(build_workload(tenant_spec(n_requests=20, shared_tokens=40, prompt_tokens=45)), tokenize)
        for r in wl.requests:
            prefix = wl.prefixes[r.tenant]
            assert prefix[0] == 1 and r.prompt[:len(prefix)] == prefix
            assert r.prompt[len(prefix):] == tuple(ord(c) for c in r.text[r.prefix_chars:])

    @pytest.mark.parametrize("field, value", [("tenant_skew", "pareto"), ("tenant_skew", "zipf:-1"),
                                              ("tenant_skew", "uniform:2"), ("tenants", -1)])
    def test_bad_tenant_fields_are_named(self, field, value):
        with pytest.raises(ValueError, match=field):
            tenant_spec(**{field: value})

    def test_tenants_need_a_prefix(self):
        with pytest.raises(ValueError, match="tenants"):
            tenant_spec(shared_tokens=0)

    def test_name_says_tenants(self):
        assert tenant_spec().name() == "8 tenants x 1500 (zipf) + 50, out 32-256, poisson 60/s"
