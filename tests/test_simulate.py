"""The what-if simulation (engine/sim/simulate.py): the real router and schedulers on simulated
hardware. Pure and fast: no model, no threads, a virtual clock."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from engine.core.errors import InvalidRequest
from engine.sim.benchmark import run_metrics
from engine.sim.simulate import PROFILES, Profile, apply_overrides, scaled_profile, simulate
from engine.sim.workload import WorkloadSpec, build_workload, seed_workload

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def _seed(n: int):
    return build_workload(seed_workload(n), 0)


def _records_key(run):
    return sorted((r.index, r.backend, round(r.ttft_s, 9), round(r.e2e_s, 9), r.output_tokens,
                   round(r.itl_s or 0.0, 9)) for r in run.records)


def test_m2_first_requests_go_to_the_gpu():
    run = simulate(PROFILES["study-m2"], _seed(8), "seed-score")
    assert [d["chosen"] for d in run.decisions[:7]] == ["gpu"] * 7


def test_m2_idle_cpu_scores_exactly_the_articles_3118_s():
    run = simulate(PROFILES["study-m2"], _seed(8), "seed-score")
    cpu = next(c for c in run.decisions[0]["candidates"] if c["backend"] == "cpu")
    assert cpu["score"] == 20 / 73 + 128 / 45
    assert round(cpu["score"], 3) == 3.118


def test_m2_first_offload_lands_at_request_8():
    run = simulate(PROFILES["study-m2"], _seed(8), "seed-score")
    assert [d["chosen"] for d in run.decisions] == ["gpu"] * 7 + ["cpu"]


def test_m2_slow_reproduces_the_articles_states_before_the_first_offload():
    """With the decode speed the article's makespans imply, the GPU's scores at requests 7
    and 8 land within 0.05 s of its 3.027 s and 3.444 s."""
    run = simulate(PROFILES["study-m2-slow"], _seed(8), "seed-score", record_states=True)
    gpu7, gpu8 = (next(c for c in run.decisions[k]["candidates"] if c["backend"] == "gpu") for k in (6, 7))
    assert gpu7["score"] == pytest.approx(3.027, abs=0.05)
    assert gpu8["score"] == pytest.approx(3.444, abs=0.05)
    assert run.states[6]["gpu"]["queued"] == 2 and run.states[7]["gpu"]["queued"] == 3


def test_m2_n48_offloads_six_requests_as_the_article():
    run = simulate(PROFILES["study-m2"], _seed(48), "seed-score")
    assert run_metrics(run.records).routed == {"gpu": 42, "cpu": 6}


@pytest.mark.parametrize("profile", ["study-m2", "h200"])
def test_fast_forward_gives_the_step_by_step_records(profile):
    wl = build_workload(WorkloadSpec(40, 300, 150, output="uniform", max_output=96, arrival="poisson", seed=5), 1)
    fast = simulate(PROFILES[profile], wl, "predicted-finish")
    slow = simulate(PROFILES[profile], wl, "predicted-finish", fast=False)
    assert _records_key(fast) == _records_key(slow)
    assert [d["chosen"] for d in fast.decisions] == [d["chosen"] for d in slow.decisions]


def test_every_request_finishes_with_its_drawn_length():
    wl = build_workload(WorkloadSpec(30, 200, 100, output="uniform", max_output=64, seed=2), 0)
    run = simulate(PROFILES["h200"], wl, "round-robin")
    assert sorted((r.index, r.output_tokens) for r in run.records) == [
        (q.index, q.output_tokens) for q in wl.requests]


def test_a_smaller_kv_budget_lengthens_the_makespan():
    wl = build_workload(WorkloadSpec(24, 516, 0, seed=1), 0)
    per_seq = 516 + 128
    roomy = apply_overrides(PROFILES["h200"], [f"gpu.kv_cells={16 * per_seq}"])
    tight = apply_overrides(PROFILES["h200"], [f"gpu.kv_cells={2 * per_seq}"])
    t_roomy = run_metrics(simulate(roomy, wl, "gpu-only").records).makespan_s
    t_tight = run_metrics(simulate(tight, wl, "gpu-only").records).makespan_s
    assert t_tight > 1.5 * t_roomy


def test_speed_override_scales_the_hardware_only():
    p = apply_overrides(PROFILES["study-m2"], ["cpu.speed=3"])
    cpu = p.backend("cpu")
    assert cpu.rates == PROFILES["study-m2"].backend("cpu").rates
    assert cpu.hw.decode_tok_s == pytest.approx(135.0)
    assert cpu.step_seconds(1, 0) == pytest.approx(1 / 135.0)


def test_scaled_profile_moves_the_router_too():
    p = scaled_profile(PROFILES["study-m2"], "cpu", 2.0)
    assert p.backend("cpu").rates.prefill_tok_s == pytest.approx(146.0)


def test_unknown_override_is_refused():
    with pytest.raises(InvalidRequest, match="unknown field"):
        apply_overrides(PROFILES["study-m2"], ["gpu.colour=3"])


def test_override_of_unknown_backend_is_refused():
    with pytest.raises(InvalidRequest, match="no backend 'tpu'"):
        apply_overrides(PROFILES["study-m2"], ["tpu.cap=3"])


def test_profile_survives_a_json_round_trip():
    p = replace(PROFILES["study-m2-slow"], name="copy")
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_profile_without_backends_is_refused():
    with pytest.raises(InvalidRequest, match="backends"):
        Profile.from_dict({"name": "empty", "backends": []})


def test_replay_routes_the_committed_h200_run_like_it_went():
    from bench.simulate import replay

    rows = replay(RESULTS / "gpu" / "speed11" / "n48", hardware=PROFILES["h200"])
    assert rows and all(r["same_backend"] >= 0.9 for r in rows)
    gpu_only = next(r for r in rows if r["policy"] == "gpu-only")
    assert abs(gpu_only["makespan_s"]["error"]) <= 0.10


def test_profile_file_loads_with_its_edits(tmp_path):
    from bench.simulate import load_profile

    path = tmp_path / "m2.json"
    path.write_text(json.dumps(PROFILES["study-m2"].to_dict()))
    p = load_profile(str(path), ["gpu.kv_cells=1288", "cpu.cap=2"])
    assert (p.backend("gpu").kv_cells, p.backend("cpu").cap) == (1288, 2)


def test_this_machine_is_the_latest_stored_calibration(tmp_path):
    from bench.simulate import this_machine
    from engine.rates.store import RateStore

    store = RateStore(tmp_path / "rates.json")
    store.save("abc", "cpu:threads=1", {"backend": "cpu0", "device": "cpu", "cap": 4, "prefill_tok_s": 95.0,
                                        "decode_tok_s": 38.0, "step_alpha_s": 0.015, "step_beta_s": 0.022,
                                        "step_s": {"1": 0.032, "2": 0.07}, "measured_at": "2026-12-01T03:27:07",
                                        "fingerprint": "abc", "also_for": ["cpu1"]})
    p = this_machine(store)
    assert [b.name for b in p.backends] == ["cpu0", "cpu1"]
    assert p.backend("cpu1").rates.step_s(2) == 0.07


def _calibrated(store, fingerprint: str, model: str, measured_at: str, prefill: float) -> None:
    store.save(fingerprint, "cpu:threads=1", {"backend": "cpu0", "device": "cpu", "cap": 4, "model": model,
                                               "prefill_tok_s": prefill, "decode_tok_s": 38.0,
                                               "measured_at": measured_at, "also_for": ["cpu1"]})


def test_this_machine_for_a_recorded_run_is_its_models_calibration(tmp_path):
    from bench.simulate import this_machine
    from engine.rates.store import RateStore

    store = RateStore(tmp_path / "rates.json")
    _calibrated(store, "small", "SmolLM2", "2026-12-01T03:00:00", 95.0)
    _calibrated(store, "tiny", "synthetic-tiny", "2026-12-01T04:00:00", 9000.0)  # calibrated later
    p = this_machine(store, model={"fingerprint": "small", "name": "SmolLM2"})
    assert p.backend("cpu0").rates.prefill_tok_s == 95.0


def test_this_machine_without_the_recorded_models_calibration_says_so(tmp_path):
    from bench.simulate import this_machine
    from engine.rates.store import RateStore

    store = RateStore(tmp_path / "rates.json")
    _calibrated(store, "tiny", "synthetic-tiny", "2026-12-01T04:00:00", 9000.0)
    with pytest.raises(InvalidRequest, match=r"no calibration of the recorded model .SmolLM2.*tandem calibrate --model default"):
        this_machine(store, model={"fingerprint": "small", "name": "SmolLM2", "spec": "default"})


def test_replaying_a_simulated_run_says_it_is_one(tmp_path):
    from app.cli import build_parser
    from bench.simulate import replay

    args = build_parser().parse_args(["simulate", "seed", "--profile", "study-m2", "--requests", "8", "--runs", "1",
                                      "--policies", "seed-score", "--no-plots", "--out", str(tmp_path)])
    assert args.func(args) == 0
    with pytest.raises(InvalidRequest, match=r"a simulated run .tandem simulate seed.; replay predicts a recorded"):
        replay(tmp_path)


def test_replaying_files_that_are_not_a_bench_run_is_refused(tmp_path):
    from bench.simulate import replay

    (tmp_path / "summary.json").write_text(json.dumps({"tool": "tandem bench seed", "workloads": []}))
    (tmp_path / "requests.csv").write_text("workload,policy\n")
    with pytest.raises(InvalidRequest, match=r"not a bench run's files .KeyError"):
        replay(tmp_path)
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(InvalidRequest, match=r"summary\.json is not JSON"):
        replay(tmp_path)


def test_simulate_seed_writes_the_benchs_files(tmp_path):
    from app.cli import build_parser

    args = build_parser().parse_args(["simulate", "seed", "--profile", "study-m2", "--requests", "8", "--runs", "1",
                                      "--policies", "seed-score,gpu-only", "--no-plots", "--out", str(tmp_path)])
    assert args.func(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tool"] == "tandem simulate seed"
    routed = {r["policy"]: r["routed"] for r in summary["results"]}
    assert routed["seed-score"] == {"gpu": 7, "cpu": 1}
    assert len((tmp_path / "decisions.jsonl").read_text().splitlines()) == 16
    assert len((tmp_path / "requests.csv").read_text().splitlines()) == 17


def test_crossover_gain_changes_sign_from_the_h200_to_the_m2():
    from bench.simulate import crossover

    h200 = crossover(PROFILES["h200"], [0.04], [16], ["seed-score"], 48)
    m2 = crossover(PROFILES["study-m2"], [0.15], [4], ["seed-score"], 48)
    assert h200[0]["gain"] == pytest.approx(0.0, abs=1e-9) and h200[0]["to_second"] == 0
    assert m2[0]["gain"] > 0.05 and m2[0]["to_second"] > 0


def test_a_512_token_prompt_alone_costs_what_the_calibrated_rate_says():
    """The fixed cost per prompt chunk is inside the calibrated rate once, not added to it."""
    gpu = PROFILES["h200"].backend("gpu")
    assert gpu.step_seconds(0, 512) == pytest.approx(512 / gpu.hw.prefill_tok_s)


def test_a_short_chunk_pays_the_fixed_cost_whole():
    gpu = PROFILES["h200"].backend("gpu")
    assert gpu.step_seconds(0, 16) - 16 / gpu.hw.prefill_tok_s > 0.9 * gpu.chunk_fixed_s


def test_each_admitted_request_adds_its_setup_to_the_step():
    gpu = PROFILES["h200"].backend("gpu")
    assert gpu.step_seconds(4, 64, 2) - gpu.step_seconds(4, 64, 0) == pytest.approx(2 * gpu.admit_s)


def test_h200_device_steps_at_the_engines_measured_decode_speeds():
    """docs/results/gpu/round2/overhead_gpu_sampling.txt: engine_b1 808, engine_b16 3679,
    engine_b128 8614 tok/s."""
    gpu = PROFILES["h200"].backend("gpu")
    assert [round(b / gpu.step_seconds(b, 0)) for b in (1, 16, 128)] == [808, 3679, 8614]


def test_h200_router_keeps_the_committed_calibration():
    gpu = PROFILES["h200"].backend("gpu")
    assert gpu.rates.step_s(16) == pytest.approx(0.0051355)


def test_chunk_cost_override_applies_to_the_device():
    p = apply_overrides(PROFILES["h200"], ["gpu.chunk_fixed_s=0", "gpu.admit_s=0"])
    gpu = p.backend("gpu")
    assert gpu.step_seconds(0, 100, 1) == pytest.approx(100 / gpu.hw.prefill_tok_s)


def test_h200_profile_survives_a_json_round_trip():
    p = PROFILES["h200"]
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_replay_of_the_committed_grid_open_run_meets_the_bar_in_most_rows():
    """docs/results/gpu/grid2/grid-open: the run the per-request setup cost was fitted on."""
    from bench.simulate import replay

    rows = replay(RESULTS / "gpu" / "grid2" / "grid-open", hardware=PROFILES["h200"])
    assert sum(r["ok"] for r in rows) >= 20


def test_speed_override_divides_the_fixed_step_costs_too():
    p = apply_overrides(PROFILES["h200"], ["gpu.speed=2"])
    fast, base = p.backend("gpu"), PROFILES["h200"].backend("gpu")
    assert fast.step_seconds(4, 16, 1) == pytest.approx(base.step_seconds(4, 16, 1) / 2)


# ---- the step's context term, the host cost per request, replays judged over runs ----

# A CPU backend whose steps grow with the KV cells they attend over: alpha + beta*b + gamma*b*cells.
_ALPHA, _BETA, _GAMMA = 0.004, 0.02, 4e-5


def _ctx_rates(prompt: int = 512, gen: int = 32):
    from engine.core.snapshot import Rates
    from engine.rates.fit import calibration_cells

    cells = (calibration_cells(prompt, gen),) * 8
    table = tuple(_ALPHA + _BETA * b + _GAMMA * b * c for b, c in enumerate(cells, 1))
    return Rates(110.0, 8 / table[-1], source="calibrated", step_table=table, step_gamma_s=_GAMMA, step_cells=cells)


def _ctx_profile(admit_s: float = 0.0) -> Profile:
    from engine.sim.simulate import BackendProfile

    return Profile("ctx", tuple(BackendProfile(f"cpu{k}", "cpu", _ctx_rates(), cap=8, kv_cells=4096, admit_s=admit_s)
                                for k in range(2)))


def test_context_model_fits_synthetic_points_exactly():
    from engine.rates.fit import calibration_cells, fit_context_model

    points = [(b, calibration_cells(p, g), _ALPHA + _BETA * b + _GAMMA * b * calibration_cells(p, g))
              for p, g, batches in ((512, 32, range(1, 9)), (128, 16, (1, 8))) for b in batches]
    assert fit_context_model(points) == pytest.approx((_ALPHA, _BETA, _GAMMA), rel=1e-9)


def test_context_model_where_a_longer_context_ran_faster_has_no_term():
    """Noise, not attention: the fit falls back to alpha + beta*b over the batches' means."""
    from engine.rates.fit import fit_context_model

    points = [(b, c, 0.01 + 0.02 * b - 1e-6 * b * c) for b in (1, 2, 4) for c in (100.0, 600.0)]
    alpha, beta, gamma = fit_context_model(points)
    assert (gamma, alpha, beta) == (0.0, pytest.approx(0.01), pytest.approx(0.02 - 350e-6))


def test_a_step_over_fewer_cells_than_calibrated_is_cheaper_by_gamma_per_row_per_cell():
    rates = _ctx_rates()
    ref = rates.step_cells[3]
    assert rates.step_at(4, ref) == pytest.approx(rates.step_s(4))
    assert rates.step_s(4) - rates.step_at(4, ref - 400) == pytest.approx(4 * 400 * _GAMMA)


def test_a_step_beyond_the_table_keeps_the_context_term():
    rates = _ctx_rates()
    assert rates.step_at(10, rates.step_cells[-1]) == pytest.approx(rates.step_s(10))
    assert rates.step_at(10, rates.step_cells[-1] + 100) - rates.step_s(10) == pytest.approx(10 * 100 * _GAMMA)


def test_a_profile_without_the_context_term_steps_at_its_table_at_any_context(tmp_path):
    """Calibrations stored before the context term (no `step_gamma_s`) load and keep today's model."""
    from bench.simulate import this_machine
    from engine.rates.store import RateStore

    store = RateStore(tmp_path / "rates.json")
    store.save("abc", "cpu:threads=1", {"backend": "cpu0", "device": "cpu", "cap": 4, "prefill_tok_s": 95.0,
                                        "decode_tok_s": 38.0, "step_s": {"1": 0.032, "2": 0.07},
                                        "rates": {"prefill_tok_s": 95.0, "decode_tok_s": 38.0,
                                                  "step_table": [0.032, 0.07]},
                                        "measured_at": "2026-11-30T03:27:07", "fingerprint": "abc"})
    cpu = this_machine(store).backend("cpu0")
    assert (cpu.hw.step_gamma_s, cpu.admit_s) == (0.0, 0.0)
    assert [cpu.step_seconds(2, 0, 0, cells) for cells in (10, 5000)] == [0.07, 0.07]


def test_this_machine_steps_as_its_stored_calibration_measured(tmp_path):
    from bench.simulate import this_machine
    from engine.rates.store import RateStore
    from engine.sim.simulate import _rates_dict

    rates = _ctx_rates()
    store = RateStore(tmp_path / "rates.json")
    store.save("abc", "cpu:threads=1", {"backend": "cpu0", "device": "cpu", "cap": 8, "prefill_tok_s": 110.0,
                                        "decode_tok_s": rates.decode_tok_s, "admit_s": 0.012,
                                        "step_s": {str(b): t for b, t in enumerate(rates.step_table, 1)},
                                        "rates": _rates_dict(rates), "measured_at": "2026-12-01T06:00:00",
                                        "fingerprint": "abc"})
    cpu = this_machine(store).backend("cpu1")
    assert (cpu.hw.step_gamma_s, cpu.hw.step_cells, cpu.admit_s) == (_GAMMA, rates.step_cells, 0.012)


def test_fast_forward_gives_the_step_by_step_records_with_a_context_term():
    wl = build_workload(WorkloadSpec(40, 300, 150, output="uniform", max_output=96, arrival="poisson", seed=5), 1)
    fast = simulate(_ctx_profile(0.01), wl, "predicted-finish")
    slow = simulate(_ctx_profile(0.01), wl, "predicted-finish", fast=False)
    assert _records_key(fast) == _records_key(slow)


def test_a_short_context_decodes_faster_than_the_calibrated_one():
    """The CPU grid's 128-token prompts against a table measured at 512 tokens."""
    wl = build_workload(WorkloadSpec(8, 128, 123, output="fixed", gen_tokens=32, arrival="interval", interval_s=0.2), 0)
    with_term = run_metrics(simulate(_ctx_profile(), wl, "only:cpu0").records)
    no_term = replace(_ctx_profile().backends[0], rates=replace(_ctx_rates(), step_gamma_s=0.0))
    without = run_metrics(simulate(Profile("flat", (no_term,)), wl, "only:cpu0").records)
    assert with_term.makespan_s < 0.95 * without.makespan_s


def test_replay_report_has_the_per_row_fields():
    """docs/results/simulate/cpu-grid2: 6 rows, 2 runs each."""
    from bench.simulate import replay, replay_markdown

    src = RESULTS / "simulate" / "cpu-grid2"
    rows = replay(src, hardware=_ctx_profile(), min_runs=3)
    assert len(rows) == 6
    row = rows[0]
    assert [r["run"] for r in row["per_run"]] == [0, 1]
    assert set(row["per_run"][0]) == {"run", "makespan_s", "ttft_p50_s", "ttft_p95_s"}
    assert set(row["spread"]) == {"makespan_s", "ttft_p50_s"} and row["spread"]["makespan_s"] > 0
    assert sum(row["routed_measured"].values()) == 8 and sum(row["routed_predicted"].values()) == 8
    assert all("2 run(s) recorded, 3 needed" in r["why"] for r in rows)
    assert "| runs |" in replay_markdown(src, rows)


def test_replay_names_a_host_busier_than_its_cores(tmp_path):
    import shutil

    from bench.simulate import replay

    src = RESULTS / "simulate" / "cpu-grid2"
    for f in ("requests.csv.xz",):
        shutil.copy(src / f, tmp_path / f)
    summary = json.loads((src / "summary.json").read_text())
    summary["host"] = {"cpus": 2, "load_avg": [{"workload": r["workload"], "policy": r["policy"], "requests": 8,
                                                "run": k, "load1": 5.5} for r in summary["results"] for k in (0, 1)]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    rows = replay(tmp_path, hardware=_ctx_profile(), min_runs=2)
    assert all("load average up to 5.5 on 2 CPUs" in r["why"] for r in rows if not r["ok"])
    assert all(r["host_load"] == {"load1_max": 5.5, "cpus": 2} for r in rows)


def test_profile_with_a_context_term_survives_a_json_round_trip():
    p = _ctx_profile(0.02)
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


# ---- the masked scan: delta * b * n_kv ----

_DELTA = 3e-6


def test_step_terms_fit_recovers_delta_from_synthetic_points():
    """The shared passes (the pool grows with the rows' cells) and one unshared pair."""
    from engine.rates.fit import calibration_cells, fit_step_terms

    def step(b, c, kv):
        return _ALPHA + _BETA * b + _GAMMA * b * c + _DELTA * b * kv

    points = []
    for prompt, gen, batches in ((512, 32, range(1, 9)), (128, 16, (1, 8))):
        c = calibration_cells(prompt, gen)
        points += [(b, c, prompt + b * (c - prompt), step(b, c, prompt + b * (c - prompt))) for b in batches]
    c = calibration_cells(128, 16)
    shared, unshared = 128 + 8 * (c - 128), 8 * c
    pairs = [(8, shared, step(8, c, shared), unshared, step(8, c, unshared))]
    assert fit_step_terms(points, pairs) == pytest.approx((_ALPHA, _BETA, _GAMMA, _DELTA), rel=1e-9)


def test_pool_attention_fit_recovers_its_terms_from_synthetic_points():
    """Without flash attention every row pays for the whole pool: no context term."""
    from engine.rates.fit import calibration_cells, fit_step_terms

    def step(b, kv):
        return _ALPHA + _BETA * b + _DELTA * b * kv

    points = []
    for prompt, gen, batches in ((512, 32, range(1, 9)), (128, 16, (1, 8))):
        c = calibration_cells(prompt, gen)
        points += [(b, c, prompt + b * (c - prompt), step(b, prompt + b * (c - prompt))) for b in batches]
    c = calibration_cells(128, 16)
    shared, unshared = 128 + 8 * (c - 128), 8 * c
    pairs = [(8, shared, step(8, shared), unshared, step(8, unshared))]
    assert fit_step_terms(points, pairs, pool_attention=True) == pytest.approx((_ALPHA, _BETA, 0.0, _DELTA), rel=1e-9)


def test_a_larger_pool_that_stepped_faster_gives_no_scan_term():
    from engine.rates.fit import fit_scan_term

    assert fit_scan_term([(8, 224.0, 0.096, 1120.0, 0.094)]) == 0.0


def test_an_entry_stored_before_the_masked_scan_steps_at_its_table_pool(tmp_path):
    """The cpu-grid3 store format: a context term, no `step_delta_s` or `step_kv`."""
    from bench.simulate import this_machine
    from engine.rates.store import RateStore

    rates = _ctx_rates()
    old = {k: v for k, v in {"prefill_tok_s": 110.0, "decode_tok_s": rates.decode_tok_s,
                             "step_table": list(rates.step_table), "step_gamma_s": _GAMMA,
                             "step_cells": list(rates.step_cells)}.items()}
    store = RateStore(tmp_path / "rates.json")
    store.save("abc", "cpu:threads=1", {"backend": "cpu0", "device": "cpu", "cap": 8, "prefill_tok_s": 110.0,
                                        "decode_tok_s": rates.decode_tok_s, "admit_s": 0.012,
                                        "step_s": {str(b): t for b, t in enumerate(rates.step_table, 1)},
                                        "rates": old, "measured_at": "2026-12-01T06:00:00", "fingerprint": "abc"})
    cpu = this_machine(store).backend("cpu0")
    assert (cpu.hw.step_delta_s, cpu.hw.step_kv) == (0.0, ())
    c = rates.step_cells[7]
    assert [cpu.step_seconds(8, 0, 0, c, kv) for kv in (c, 8 * c)] == [pytest.approx(rates.step_s(8))] * 2


def _scan_profile(delta: float) -> Profile:
    """A GPU-shaped backend (whole prompts in one step) whose step is the table plus delta*b*n_kv."""
    from engine.core.snapshot import Rates
    from engine.sim.simulate import BackendProfile

    rates = Rates(1e9, 200.0, source="calibrated", step_table=(0.010, 0.012), step_delta_s=delta)
    return Profile("scan", (BackendProfile("dev", "gpu", rates, cap=2, kv_cells=4096),))


@pytest.mark.parametrize("fast", [True, False])
def test_the_simulated_step_scans_the_whole_pool(fast):
    """Two unshared 100-token prompts arriving together: the first is admitted alone (its
    arrival starts a step), the second joins a step later, then both decode. Each row holds
    ~105 cells; every step pays delta per row per cell of the pool, both sequences' cells."""
    wl = build_workload(WorkloadSpec(2, 100, 0, output="fixed", gen_tokens=11, arrival="interval", interval_s=0.0), 0)
    run = simulate(_scan_profile(_DELTA), wl, "only:dev", arrivals=[0.0, 0.0], fast=fast)
    both = [0.012 + _DELTA * 2 * kv for kv in range(203, 220, 2)]  # 9 steps of 2 rows, 2 cells more each
    first = [0.010 + _DELTA * 201 + 100 / 1e9] + both  # its second token: 1 row beside the other's prompt
    second = both + [0.010 + _DELTA * 220]  # its last token: alone, the other's cells still in the pool
    assert [r.output_tokens for r in run.records] == [11, 11]
    assert sorted(r.itl_s for r in run.records) == pytest.approx(sorted([statistics.fmean(first),
                                                                           statistics.fmean(second)]), rel=1e-9)


def test_fast_forward_gives_the_step_by_step_records_with_a_scan_term():
    p = _ctx_profile(0.01)
    p = Profile("ctx-scan", tuple(replace(b, rates=replace(b.rates, step_delta_s=_DELTA,
                                                           step_kv=tuple(4 * c for c in b.rates.step_cells)))
                                  for b in p.backends))
    wl = build_workload(WorkloadSpec(40, 300, 150, output="uniform", max_output=96, arrival="poisson", seed=5), 1)
    assert _records_key(simulate(p, wl, "predicted-finish")) == _records_key(simulate(p, wl, "predicted-finish",
                                                                                     fast=False))


def test_profile_with_a_scan_term_survives_a_json_round_trip():
    p = apply_overrides(_ctx_profile(0.02), ["cpu0.step_delta_s=2e-6"])
    assert p.backend("cpu0").hw.step_delta_s == 2e-6
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
