"""Defaults that never lose, on simulated hardware (engine/sim/simulate.py: the real router, the real
schedulers and the real limiter on a virtual clock; no model).

- The h200 profile (the default layout: GPU and 15-thread CPU, adaptive caps) under `default`
  against the GPU alone at fixed caps 16 / 32 / 64, on issue 25's workloads.
- The study's M2, where the CPU pays: `default` still offloads request 8 and is no slower than
  `seed-score`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.sched.limiter import CEILING
from engine.sim.benchmark import run_metrics
from engine.sim.simulate import PROFILES, Simulation, apply_overrides, simulate
from engine.sim.workload import TOKEN_HIGH, WorkloadSpec, build_workload, seed_workload, with_requests

STUDY = seed_workload(1, prefix_tokens=496, suffix_tokens=20, gen_tokens=128, interval_s=0.05)
WORKLOADS = {
    "study N=48": (STUDY, 48),
    "long prompts N=64": (WorkloadSpec(n_requests=1, prompt_tokens=1516, shared_tokens=1000, output="uniform",
                                       min_output=32, max_output=512, arrival="poisson", rate=20.0), 64),
    **{f"{k} tenants N=200": (WorkloadSpec(n_requests=1, prompt_tokens=1550, shared_tokens=1500, output="uniform",
                                           min_output=32, max_output=256, arrival="poisson", rate=40.0, tenants=k),
                              200) for k in (4, 16, 32)},
}


def workload(name: str, run: int = 0):
    spec, n = WORKLOADS[name]
    return build_workload(replace(with_requests(spec.validate(), n), vocab_size=TOKEN_HIGH), run)


def makespan(profile, wl, policy) -> tuple[float, float, int]:
    got = simulate(profile, wl, policy)
    m = run_metrics(got.records)
    return m.makespan_s, m.ttft_p50_s, sum(1 for r in got.records if r.backend == "cpu")


def fixed(cap: int):
    return apply_overrides(PROFILES["h200"], [f"gpu.cap={cap}", "gpu.kv_cells=65536"])


def test_the_h200_profile_is_the_default_layout():
    assert [(b.name, b.cap, b.adaptive) for b in PROFILES["h200"].backends] == [("gpu", 0, True), ("cpu", 0, True)]
    assert PROFILES["h200"].backend("gpu").most == CEILING["gpu"]


@pytest.mark.parametrize("name", WORKLOADS)
def test_the_default_sends_nothing_to_a_cpu_that_cannot_finish_sooner(name):
    """On the H200 every request finishes first on the GPU: the default equals the GPU alone at
    its adaptive cap, where seed-score sends some to the CPU on the long-prompt and tenant rows."""
    wl = workload(name)
    default = makespan(apply_overrides(PROFILES["h200"], ["gpu.kv_cells=65536"]), wl, "default")
    alone = makespan(apply_overrides(PROFILES["h200"], ["gpu.kv_cells=65536"]), wl, "gpu-only")
    assert default[2] == 0
    assert default[0] == pytest.approx(alone[0], rel=1e-9)


@pytest.mark.parametrize("name", WORKLOADS)
def test_with_its_ceiling_at_64_the_default_is_within_3_percent_of_the_best_fixed_cap(name):
    wl = workload(name)
    best = min(makespan(fixed(cap), wl, "gpu-only")[0] for cap in (16, 32, 64))
    default = makespan(apply_overrides(PROFILES["h200"], ["gpu.kv_cells=65536", "gpu.ceiling=64"]), wl, "default")
    assert default[0] <= 1.03 * best, (name, default, best)


def test_the_adaptive_cap_climbs_past_16_while_requests_wait():
    """4 tenants at 40/s: requests wait and decode tok/s still grows, so the limit climbs to its
    ceiling instead of sitting where a fixed cap of 16 does."""
    sim = Simulation(apply_overrides(PROFILES["h200"], ["gpu.kv_cells=65536"]), workload("4 tenants N=200"), "default")
    sim.run()
    lim = sim.by_name["gpu"].sched.limiter
    assert lim.moves >= 2
    assert max(lim.rates) > 16  # mean decode batches measured beyond 16
    four = makespan(fixed(16), workload("4 tenants N=200"), "gpu-only")[0]
    assert makespan(apply_overrides(PROFILES["h200"], ["gpu.kv_cells=65536"]), workload("4 tenants N=200"),
                    "default")[0] < 0.8 * four


def test_a_fixed_cap_profile_has_no_limiter():
    sim = Simulation(fixed(16), workload("study N=48"), "gpu-only")
    assert sim.by_name["gpu"].sched.limiter is None and sim.by_name["cpu"].sched.limiter is not None


@pytest.mark.parametrize("n", [4, 8, 48])
def test_on_the_m2_the_default_is_no_slower_than_seed_score(n):
    wl = build_workload(replace(with_requests(STUDY, n), vocab_size=TOKEN_HIGH), 0)
    seed = makespan(PROFILES["study-m2"], wl, "seed-score")
    mine = makespan(PROFILES["study-m2"], wl, "default")
    assert mine[0] <= seed[0] * (1 + 1e-9)
    if n >= 8:
        assert mine[2] > 0  # the CPU pays there, and gets work


def test_on_the_m2_the_default_offloads_from_request_8():
    wl = build_workload(replace(with_requests(STUDY, 8), vocab_size=TOKEN_HIGH), 0)
    got = simulate(PROFILES["study-m2"], wl, "default")
    chosen = [d["chosen"] for d in got.decisions]
    assert chosen == ["gpu"] * 7 + ["cpu"]
    cpu = next(c for c in got.decisions[7]["candidates"] if c["backend"] == "cpu")
    assert round(cpu["score"], 3) == 3.118
