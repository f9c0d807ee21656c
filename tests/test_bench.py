"""Benchmarks: pure metric functions on hand-made records; `tandem bench seed|grid` end to end
on the real tiny model with two CPU backends; the HTTP peer client against a stub that streams
SSE and against our own server."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import math
import sys
import threading

import pytest

from app.cli import main
from bench import report as bench_report
from bench.progress import Progress
from bench.study import loaded_name
from bench.target import Target, parse_target, probe, run_target
from engine.backends.config import parse_backend_specs
from engine.engine import Engine
from engine.llama import fused_dist
from engine.sim.benchmark import (
    RequestRecord,
    aggregate,
    decision_line,
    idle_paused_s,
    makespan,
    oracle,
    output_throughput,
    percentile,
    run_metrics,
    seed_formula,
)
from engine.sim.workload import build_workload, seed_workload

BACKENDS = ["--backend", "cpu:threads=1,cap=2,ctx=512", "--backend", "cpu:threads=1,cap=2,ctx=512"]
SMALL_SEED = ["--prefix-tokens", "48", "--suffix-tokens", "8", "--gen-tokens", "8"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch, tiny_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))


def rec(t_submit, e2e, *, ok=True, backend="gpu", ttft=0.1, out=10, policy="p", run=0, n=3, workload="w"):
    return RequestRecord(workload=workload, policy=policy, run=run, requests=n, index=0, request_id="r",
                         backend=backend, success=ok, finish_reason="length" if ok else "error",
                         prompt_tokens=20, cached_tokens=10, output_tokens=out if ok else 0,
                         t_submit_s=t_submit, queue_s=0.0, ttft_s=ttft if ok else None,
                         e2e_s=e2e if ok else None, itl_s=0.01, error=None if ok else "boom")


# ---- pure metrics ----


class TestMetrics:
    @pytest.mark.parametrize("values, q, expected", [
        ([1, 2, 3, 4, 5], 50, 3), ([1, 2, 3, 4], 50, 2.5), ([10], 95, 10), ([1, 2, 3, 4, 5], 95, 4.8),
        ([5, 1, 3], 0, 1), ([5, 1, 3], 100, 5),
    ])
    def test_percentile_interpolates_like_numpy(self, values, q, expected):
        assert percentile(values, q) == pytest.approx(expected)

    def test_percentile_of_nothing_is_nan(self):
        assert math.isnan(percentile([], 50))

    def test_makespan_from_the_first_submission_to_the_last_success(self):
        records = [rec(0.0, 1.0), rec(0.05, 2.0), rec(0.1, None, ok=False)]
        assert makespan(records) == pytest.approx(2.05)
        assert output_throughput(records, 2.05) == pytest.approx(20 / 2.05)
        assert math.isnan(makespan([rec(0.0, None, ok=False)]))

    def test_run_metrics_keeps_failures_as_data(self):
        m = run_metrics([rec(0.0, 1.0, ttft=0.1), rec(0.1, 1.5, ttft=0.3, backend="cpu"),
                         rec(0.2, None, ok=False, backend="cpu")])
        assert (m.completed, m.failed, m.output_tokens) == (2, 1, 20)
        assert m.routed == {"gpu": 1, "cpu": 2}
        assert m.ttft_p50_s == pytest.approx(0.2) and m.e2e_p95_s == pytest.approx(1.475)

    def test_computed_prompt_tokens_are_the_cache_misses_of_successful_requests(self):
        m = run_metrics([rec(0.0, 1.0), rec(0.1, 1.5), rec(0.2, None, ok=False)])
        assert m.computed_prompt_tokens == 2 * (20 - 10)
        assert aggregate([m, m])["computed_prompt_tokens"]["mean"] == 20

    def test_an_idle_pause_is_left_out_of_the_makespan(self):
        # one request 0..1 s, paused 1..3 s with nothing in flight, the next 3..4 s
        m = run_metrics([rec(0.0, 1.0), rec(3.0, 1.0)], pauses=[(1.0, 3.0)])
        assert (m.makespan_s, m.paused_s) == (pytest.approx(2.0), pytest.approx(2.0))
        assert m.output_tok_s == pytest.approx(20 / 2.0)

    def test_a_pause_with_a_request_in_flight_leaves_out_only_its_idle_part(self):
        # paused 1..3 s; the first request runs on to 2 s, so only 2..3 s stood idle
        m = run_metrics([rec(0.0, 2.0), rec(3.0, 1.0)], pauses=[(1.0, 3.0)])
        assert (m.makespan_s, m.paused_s) == (pytest.approx(3.0), pytest.approx(1.0))

    def test_a_run_nobody_paused_keeps_its_wall_makespan(self):
        records = [rec(0.0, 1.0), rec(3.0, 1.0)]
        m = run_metrics(records)
        assert (m.makespan_s, m.paused_s) == (makespan(records), 0.0)

    def test_a_pause_still_open_runs_to_the_end_of_the_run(self):
        assert idle_paused_s([(1.0, None)], [(0.0, 2.0)], 0.0, 5.0) == pytest.approx(3.0)

    def test_a_request_that_timed_out_counts_as_in_flight_to_the_end(self):
        # reached a backend, no end: nothing after its submission stood idle
        m = run_metrics([rec(0.0, 1.0), rec(0.5, None, ok=False), rec(3.0, 1.0)], pauses=[(1.0, 3.0)])
        assert m.paused_s == 0.0

    def test_aggregate_gives_the_spread_over_runs(self):
        runs = [run_metrics([rec(0.0, 1.0)]), run_metrics([rec(0.0, 3.0, backend="cpu")])]
        a = aggregate(runs)
        assert a["makespan_s"]["mean"] == 2.0 and a["makespan_s"]["std"] == pytest.approx(math.sqrt(2))
        assert (a["makespan_s"]["min"], a["makespan_s"]["max"]) == (1.0, 3.0)
        assert a["routed"] == {"cpu": 0.5, "gpu": 0.5}
        assert a["routed_per_run"] == [{"gpu": 1}, {"cpu": 1}]

    def test_the_oracle_measures_each_policy_against_the_best_single_backend(self):
        def row(policy, mean, std):
            return {"workload": "w", "requests": 8, "policy": policy,
                    "makespan_s": {"mean": mean, "std": std}}

        (o,) = oracle([row("gpu-only", 10.0, 0.2), row("seed-score", 9.0, 0.1), row("cpu-only", 30.0, 1.0),
                       row("predicted-finish", 10.1, 0.05)],
                      group=("workload", "requests"), single={"gpu-only", "cpu-only"})
        assert (o["best"], o["best_single"]) == ("seed-score", "gpu-only")
        by = {p["policy"]: p for p in o["policies"]}
        assert by["gpu-only"]["gap_pct"] == pytest.approx(100 / 9)
        assert by["seed-score"]["vs_single_s"] == pytest.approx(-1.0) and by["seed-score"]["within_spread"]
        assert by["predicted-finish"]["within_spread"]  # 0.1 s worse, gpu-only's std is 0.2
        assert not by["cpu-only"]["within_spread"]

    def test_oracle_never_calls_a_run_with_failed_requests_best(self):
        # The case seen on the GPU: a peer that failed 117 of 128 requests had the lowest makespan.
        rows = [{"workload": "w", "requests": 128, "policy": "gpu-only", "failed": 0,
                 "makespan_s": {"mean": 10.0, "std": 0.1}},
                {"workload": "w", "requests": 128, "policy": "target:llama-server", "failed": 117,
                 "makespan_s": {"mean": 1.5, "std": 0.0}}]
        (o,) = oracle(rows, group=("workload", "requests"), single={"gpu-only"})
        assert (o["best"], o["best_value"]) == ("gpu-only", 10.0)
        assert [p["policy"] for p in o["policies"]] == ["gpu-only", "target:llama-server"]
        failed = o["policies"][1]
        assert failed["excluded"] and failed["failed"] == 117 and failed["value"] == 1.5
        assert "gap_pct" not in failed

    def test_oracle_with_every_row_failing_has_no_best(self):
        rows = [{"workload": "w", "requests": 4, "policy": p, "failed": 1,
                 "makespan_s": {"mean": m, "std": 0.0}} for p, m in (("a", 1.0), ("b", 2.0))]
        (o,) = oracle(rows, group=("workload", "requests"))
        assert o["best"] is None and all(p["excluded"] for p in o["policies"])

    def test_report_shows_the_failure_count_beside_an_excluded_time(self):
        rows = [{"workload": "w", "requests": 128, "policy": p, "failed": f,
                 "makespan_s": {"mean": m, "std": 0.0}} for p, f, m in (("gpu-only", 0, 10.0), ("peer", 117, 1.5))]
        summary = {"tool": "t", "results": [], "oracle": oracle(rows, group=("workload", "requests"))}
        table = bench_report.markdown(summary)
        assert "| w | 128 | gpu-only |" in table
        assert "peer 1.500 s with 117 failed (excluded)" in table


class TestDecisionLine:
    def test_format_of_the_router_issue(self):
        from engine.core.snapshot import BackendSnapshot, Rates
        from engine.routing import RouteQuery, Router

        snaps = [BackendSnapshot("gpu", "gpu", 4, 4096, Rates(2551, 293)),
                 BackendSnapshot("cpu", "cpu", 4, 4096, Rates(73, 45))]
        d = Router("seed-score", clock=lambda: 12.5).route(RouteQuery("r1", 516, 128, {"gpu": 496, "cpu": 496}), snaps)
        line = decision_line(d, t0=10.0, run=0)
        assert set(line) == {"t", "request_id", "policy", "chosen", "candidates", "run"}
        assert (line["t"], line["request_id"], line["policy"], line["chosen"]) == (2.5, "r1", "seed-score", "gpu")
        cpu = line["candidates"][1]
        assert set(cpu) == {"backend", "cached_tokens", "prefill_tokens", "decode_tokens", "prefill_rate",
                            "decode_rate", "score"}
        assert cpu["score"] == pytest.approx(3.118, abs=5e-4)
        assert cpu["score"] == pytest.approx(seed_formula(cpu), rel=1e-12)


# ---- progress and report ----


class TestProgress:
    def test_without_tqdm_a_plain_line_per_tenth(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "tqdm", None)
        out = io.StringIO()
        with Progress(20, "bench", stream=out) as bar:
            for _ in range(20):
                bar.update(1, "seed-score N=4")
        lines = out.getvalue().splitlines()
        assert lines[-1] == "seed-score N=4 20/20 (100%)"
        assert 5 <= len(lines) <= 11

    def test_total_can_grow(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "tqdm", None)
        bar = Progress(0, "x", stream=io.StringIO())
        bar.add_total(5)
        bar.update(5)
        assert (bar.n, bar.total) == (5, 5)


def test_report_without_matplotlib_says_plots_were_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    records = [rec(0.0, 1.0, policy="a"), rec(0.0, 2.0, policy="b")]
    from bench.study import summarize

    rows = summarize(records)
    summary = {"tool": "tandem bench seed", "runs": 1, "results": rows,
               "oracle": oracle(rows, group=("workload", "requests"))}
    written = bench_report.write_all(tmp_path, summary, records, [], plots=False)
    assert {p.name for p in written} == {"summary.json", "requests.csv", "decisions.jsonl", "results.md"}
    bench_report.plot_dir(tmp_path)  # what the plotting child process runs
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert "matplotlib" in saved["plots_skipped"] and saved["plots"] == []
    assert "plots skipped: matplotlib" in (tmp_path / "results.md").read_text()


# ---- real runs ----


@contextlib.contextmanager
def our_server(model, spec: str):
    """A `tandem serve` peer (our aiohttp app on an engine of `model` with one `spec` backend)
    on its own thread and event loop; yields its URL, and stops it and its engine after."""
    from app.server import create_app, start_server

    peer = Engine.load(str(model), parse_backend_specs([spec]))
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box = {}

    def serve():
        async def go():
            box["runner"], box["url"] = await start_server(create_app(peer), "127.0.0.1", 0)
            box["stop"] = asyncio.Event()
            started.set()
            await box["stop"].wait()
            await box["runner"].cleanup()

        loop.run_until_complete(go())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert started.wait(30)
        yield box["url"]
    finally:
        if "stop" in box:
            loop.call_soon_threadsafe(box["stop"].set)
        thread.join(30)
        peer.close()


def read_outputs(out):
    summary = json.loads((out / "summary.json").read_text())
    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    decisions = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    return summary, rows, decisions


POLICIES = ["seed-score", "predicted-finish", "round-robin", "only:cpu0"]


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory, tiny_path):
    """One `bench seed` invocation shared by the checks below."""
    out = tmp_path_factory.mktemp("seed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", str(out / "cache"))
        # Lopsided rates: cpu0 prefills fast but decodes slowly, so seed-score offloads to cpu1
        # as soon as cpu0 holds work; all requests at once so that queues build.
        rc = main(["bench", "seed", "--model", str(tiny_path), *BACKENDS, "--policies", ",".join(POLICIES),
                   "--requests", "2,6", "--runs", "2", "--interval-ms", "0", *SMALL_SEED,
                   "--rates", "cpu0:prefill=2551,decode=30", "--rates", "cpu1:prefill=73,decode=45",
                   "--out", str(out / "bench")])
    return rc, out / "bench"


def test_one_workload_is_drawn_as_ranked_labelled_bars(tmp_path):
    records = [rec(0.0, 1.0 + k, policy=p) for k, p in enumerate(["gpu-only@cap=8", "target:peer", "seed-score"])]
    from bench.study import summarize

    rows = summarize(records)
    summary = {"tool": "tandem bench grid", "runs": 1, "results": rows,
               "oracle": oracle(rows, group=("workload", "requests"))}
    bench_report.write_all(tmp_path, summary, records, [], plots=False)
    bench_report.plot_dir(tmp_path)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["plots"] == ["makespan.png", "ttft_cdf.png"]  # matplotlib is a test dependency
    # `_family` groups the plots' colours: a report-internal helper, tested as such
    assert bench_report._family("gpu-only@cap=8") == "gpu-only" and bench_report._family("target:x") == "target"


class TestBenchSeed:
    POLICIES = POLICIES

    @pytest.fixture
    def run(self, seed_run):
        return seed_run

    def test_a_run_writes_every_file_with_its_keys(self, run):
        rc, out = run
        assert rc == 0
        assert {p.name for p in out.iterdir()} == {"summary.json", "requests.csv", "decisions.jsonl", "results.md",
                                                   "makespan.png", "ttft_cdf.png"}
        summary, _rows, _decisions = read_outputs(out)
        assert summary["policies"] == self.POLICIES
        assert summary["requests"] == [2, 6] and summary["runs"] == 2
        assert "fresh engine state" in summary["engine_state"] and "loaded once" in summary["engine_state"]
        assert [b["rates"]["source"] for b in summary["backends"]] == ["override", "override"]
        counters = summary["engines"][0]["counters"]
        assert set(counters) == {"cpu0", "cpu1"} and all(c["steps"] >= c["graphs_reused"] for c in counters.values())
        assert sum(c["steps"] for c in counters.values()) > 0
        assert len(summary["results"]) == len(self.POLICIES) * 2
        for row in summary["results"]:
            for key in ("makespan_s", "output_tok_s", "ttft_p50_s", "ttft_p95_s", "e2e_p50_s", "e2e_p95_s"):
                assert set(row[key]) == {"mean", "std", "min", "max", "values"}
                assert len(row[key]["values"]) == 2
            assert row["makespan_s"]["mean"] > 0 and row["output_tok_s"]["mean"] > 0
            assert row["ttft_p50_s"]["mean"] <= row["ttft_p95_s"]["mean"] <= row["e2e_p95_s"]["mean"]
            assert sum(row["routed"].values()) == row["requests"]
            assert all(sum(r.values()) == row["requests"] for r in row["routed_per_run"])
            assert row["failed"] == 0 and row["completed"] == 2 * row["requests"]
        only = [r for r in summary["results"] if r["policy"] == "only:cpu0"]
        assert all(r["routed"] == {"cpu0": r["requests"]} for r in only)
        rr = [r for r in summary["results"] if r["policy"] == "round-robin" and r["requests"] == 6]
        assert rr[0]["routed"] == {"cpu0": 3, "cpu1": 3}
        assert {(o["workload"], o["requests"]) for o in summary["oracle"]} == {("seed", 2), ("seed", 6)}
        assert "| seed-score | 6 |" in (out / "results.md").read_text()

    def test_each_run_starts_one_variant_further_on(self, run):
        """Run 1 of every N takes the policies rotated by one, so no variant always runs first
        (the host's load, recorded per variant as it ran, keeps their order)."""
        _rc, out = run
        summary, _rows, _decisions = read_outputs(out)
        ran = [(e["run"], e["requests"], e["policy"]) for e in summary["host"]["load_avg"]]
        rotated = self.POLICIES[1:] + self.POLICIES[:1]
        assert ran == ([(0, n, p) for n in (2, 6) for p in self.POLICIES]
                       + [(1, n, p) for n in (2, 6) for p in rotated])

    def test_requests_csv_one_row_per_request(self, run):
        _, out = run
        _summary, rows, _ = read_outputs(out)
        assert len(rows) == len(self.POLICIES) * 2 * (2 + 6)
        for r in rows:
            assert r["success"] == "True" and r["finish_reason"] == "length"
            assert (int(r["prompt_tokens"]), int(r["cached_tokens"]), int(r["output_tokens"])) == (56, 48, 8)
            assert float(r["queue_s"]) >= 0 and 0 < float(r["ttft_s"]) <= float(r["e2e_s"])
            assert r["backend"] in ("cpu0", "cpu1")

    def test_requests_csv_names_the_live_cap_at_each_admission(self, run):
        _, out = run
        _, rows, _ = read_outputs(out)
        assert all(int(r["cap"]) >= 1 and r["cap_reason"] for r in rows)

    def test_each_request_has_one_decision_scored_by_the_formula(self, run):
        _, out = run
        summary, rows, decisions = read_outputs(out)
        assert len(decisions) == len(rows)
        assert {d["request_id"] for d in decisions} == {r["request_id"] for r in rows}
        chosen = {r["request_id"]: r["backend"] for r in rows}
        rates = {b["name"]: b["rates"] for b in summary["backends"]}
        offloaded = 0
        for d in decisions:
            assert set(d) >= {"t", "request_id", "policy", "chosen", "candidates"}
            assert d["chosen"] == chosen[d["request_id"]]  # the decision is where it ran
            assert d["t"] >= 0
            scores = {c["backend"]: c["score"] for c in d["candidates"]}
            for c in d["candidates"]:
                assert (c["prefill_rate"], c["decode_rate"]) == (rates[c["backend"]]["prefill_tok_s"],
                                                                 rates[c["backend"]]["decode_tok_s"])
            if d["policy"] == "seed-score":
                for c in d["candidates"]:
                    assert c["score"] == pytest.approx(seed_formula(c), rel=1e-12)
                    assert c["prefill_tokens"] >= 8 and c["decode_tokens"] >= 8  # the new request included
                    assert c["cached_tokens"] == 48
                offloaded += d["chosen"] == "cpu1"
            if d["policy"] in ("seed-score", "predicted-finish"):
                assert scores[d["chosen"]] == min(scores.values())
        assert offloaded >= 1  # the lopsided rates made seed-score offload at least once


def test_bench_grid_sweeps_caps_as_policies(tmp_path, tiny_path):
    out = tmp_path / "grid"
    rc = main(["bench", "grid", "--model", str(tiny_path), *BACKENDS, "--policies", "seed-score",
               "--requests", "3", "--runs", "1", "--prompt-tokens", "40", "--shared", "0,96",
               "--outputs", "fixed,uniform", "--arrivals", "poisson", "--min-output", "4", "--max-output", "12",
               "--gen-tokens", "8", "--caps", "1,2", "--kv-seqs", "3", "--warmup", "0", "--no-plots",
               "--out", str(out)])
    assert rc == 0
    summary, rows, decisions = read_outputs(out)
    workloads = {w["name"] for w in summary["workloads"]}
    assert len(workloads) == 4 and any("out 4-12" in w for w in workloads)
    assert summary["policies"] == ["seed-score", "only:cpu0@cap=1", "only:cpu0@cap=2"]
    assert len(summary["results"]) == 4 * 3
    assert all(r["workload"].endswith("kv 3 seqs") and r["kv_seqs"] == 3 for r in summary["results"])
    assert len(summary["oracle"]) == 4
    for o in summary["oracle"]:
        assert o["best_single"] in ("only:cpu0@cap=1", "only:cpu0@cap=2")
        assert {p["policy"] for p in o["policies"]} == set(summary["policies"])
        assert min(p["gap_pct"] for p in o["policies"]) == 0.0
    swept = [b for b in summary["backends"] if b["swept"]]
    assert [b["name"] for b in swept] == ["cpu0"] and swept[0]["n_ctx"] >= 3 * (40 + 12)
    assert any("KV budget 3" in n for n in summary["notes"])
    assert any("stop early at their drawn length" in n for n in summary["notes"])
    assert summary["plots_skipped"] == "--no-plots"
    uniform = [r for r in rows if "out 4-12" in r["workload"]]
    assert {int(r["output_tokens"]) for r in uniform} <= set(range(4, 13)) and len(uniform) == 2 * 3 * 3
    assert len({int(r["output_tokens"]) for r in uniform}) > 1, "drawn lengths vary"
    # The router saw the 12-token budget, not the drawn length: the first request of a run
    # meets idle backends, so its decode term is its own budget alone.
    runs = {}
    for d in decisions:
        if "out 4-12" in d["workload"]:
            key = (d["workload"], d["run"], d["label"])
            runs[key] = min(runs.get(key, d), d, key=lambda x: x["t"])
    assert runs and all(c["decode_tokens"] == 12 for d in runs.values() for c in d["candidates"])
    assert len(decisions) == len(rows)


def test_a_kv_budget_for_a_swept_backend_that_is_not_local_is_a_clear_error(tmp_path, tiny_path, capsys):
    """`--kv-seqs` sizes a llama.cpp context of this process: a null (or remote) swept backend has none."""
    rc = main(["bench", "grid", "--model", str(tiny_path), "--backend", "cpu:threads=1,cap=2,ctx=512",
               "--backend", "null", "--sweep-backend", "null", "--policies", "seed-score", "--requests", "2",
               "--runs", "1", "--prompt-tokens", "40", "--caps", "1", "--kv-seqs", "3", "--warmup", "0",
               "--no-plots", "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "--kv-seqs sizes a local backend's context: the swept backend null is not one" in capsys.readouterr().err


def test_unusable_policy_is_a_clear_error(tmp_path, tiny_path, capsys):
    rc = main(["bench", "seed", "--model", str(tiny_path), *BACKENDS, "--policies", "gpu-only",
               "--requests", "2", "--runs", "1", *SMALL_SEED, "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "gpu-only" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_overhead_prints_its_measures(tiny_path, capsys):
    rc = main(["bench", "overhead", "--model", str(tiny_path), "--threads", "1", "--batches", "1,2",
               "--repeats", "1", "--no-llama", "--prompt-tokens", "64", "--gen-tokens", "16"])
    out = _last_json(capsys)
    assert rc == 0 and out["engine_b1_tok_s"] > 0 and out["engine_b2_tok_s"] > 0
    assert set(out["graph_reuse"]) == {"b1", "b2"} and out["fused_greedy"] is True and out["eog_redos"] == 0
    assert set(out["host_gap_us"]) == {"b1", "b2"} and all(v > 0 for v in out["host_gap_us"].values())


def test_bench_overhead_sampled_prints_temperature_decode_against_greedy(tiny_path, capsys):
    """`--sampled`: temperature decode with the fused sampler and with per-sequence chains, each
    as a ratio to the greedy decode of the same round, and how the fused sampler's builds went."""
    rc = main(["bench", "overhead", "--model", str(tiny_path), "--threads", "1", "--batches", "1,2",
               "--repeats", "1", "--no-llama", "--prompt-tokens", "64", "--gen-tokens", "16", "--sampled"])
    out = _last_json(capsys)
    assert rc == 0
    for b in (1, 2):
        for key in ("fused_temp", "chain_temp"):
            assert out[f"ratio_{key}_greedy_b{b}"] == round(out[f"{key}_b{b}_tok_s"] / out[f"engine_b{b}_tok_s"], 3)
    assert out["fused_dist_builds"]["shared"] >= 1 and "host" not in out["fused_dist_builds"]


def test_bench_overhead_sampling_reports_each_mode_over_plain_greedy(tiny_path, capsys):
    rc = main(["bench", "overhead", "--model", str(tiny_path), "--threads", "1", "--batches", "2",
               "--repeats", "1", "--no-llama", "--prompt-tokens", "32", "--gen-tokens", "8",
               "--sampling", "plain,logprobs,logit_bias,penalties"])
    out = _last_json(capsys)
    assert rc == 0
    for mode in ("logprobs", "logit_bias", "penalties"):
        assert out[f"cost_{mode}_b2"] == pytest.approx(out[f"{mode}_b2_tok_s"] / out["engine_b2_tok_s"], abs=1e-3)


def test_bench_prefill_compares_each_batch_size_alone_with_beside_decoding(tiny_path, capsys):
    rc = main(["bench", "prefill", "--model", str(tiny_path), "--threads", "1", "--sizes", "64/64,256/64",
               "--prompt-tokens", "256", "--decoders", "2", "--decode-tokens", "128", "--repeats", "1"])
    out = _last_json(capsys)
    assert rc == 0 and set(out["sizes"]) == {"64/64", "256/64"}
    for r in out["sizes"].values():
        assert r["prefill_tok_s"] > 0 and 0 < r["beside_max_step_s"] <= r["beside_ttft_s"]
        assert len(r["samples"]["alone_ttft_s"]) == 1


def test_prefill_sizes_are_checked():
    from bench.prefill import parse_sizes

    assert parse_sizes("512/128, 2048") == [(512, 128), (2048, 2048)]
    for bad in ("128/512", "x/1", "0/0"):
        with pytest.raises(SystemExit):
            parse_sizes(bad)


def test_bench_together_runs_two_backends_at_once(tiny_path, capsys):
    """Smoke run on a machine without a GPU: both backends on the CPU, one thread each."""
    rc = main(["bench", "together", "--model", str(tiny_path), "--gpu-device", "cpu", "--gpu-batch", "2",
               "--cpu-batch", "2", "--cpu-threads", "1", "--repeats", "1", "--prompt-tokens", "64",
               "--gen-tokens", "16"])
    out = _last_json(capsys)
    assert rc == 0 and out["gpu_alone_tok_s"] > 0 and out["cpu_together_tok_s"] > 0
    assert out["gpu_keep"] > 0 and out["cpu_keep"] > 0


# ---- HTTP peers ----


class StubServer:
    """A tiny aiohttp server in its own thread that speaks llama-server's /completion and the
    OpenAI /v1/completions, streaming one SSE chunk per token. It records the bodies it got."""

    def __init__(self, *, llama_server=True, fail=False):
        self.llama_server = llama_server
        self.fail = fail
        self.bodies: list[dict] = []
        self.url = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _serve(self):
        from aiohttp import web

        async def props(request):
            if not self.llama_server:
                raise web.HTTPNotFound()
            return web.json_response({"default_generation_settings": {}, "total_slots": 4})

        async def models(request):
            return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

        async def stream(request, chunks):
            body = await request.json()
            self.bodies.append(body)
            if self.fail:
                return web.json_response({"error": {"message": "no", "type": "server_error"}}, status=500)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for c in chunks(body):
                await asyncio.sleep(0.002)
                await resp.write(b"data: " + json.dumps(c).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp

        async def completion(request):
            return await stream(request, lambda b: [{"content": "x", "stop": False} for _ in range(b["n_predict"])] + [
                {"content": "", "stop": True, "stop_type": "limit", "tokens_predicted": b["n_predict"],
                 "timings": {"cache_n": 5, "prompt_n": 3}}])

        async def v1(request):
            return await stream(request, lambda b: [{"choices": [{"index": 0, "text": "y", "finish_reason": None}]}
                                                    for _ in range(b["max_tokens"])] + [
                {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                {"choices": [], "usage": {"completion_tokens": b["max_tokens"],
                                          "prompt_tokens_details": {"cached_tokens": 7}}}])

        async def main_():
            app = web.Application()
            app.add_routes([web.get("/props", props), web.get("/v1/models", models),
                            web.post("/completion", completion), web.post("/v1/completions", v1)])
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

        self._loop.run_until_complete(main_())


def small_workload(n=3):
    return build_workload(seed_workload(n, prefix_tokens=6, suffix_tokens=3, gen_tokens=4, interval_s=0.01))


class TestTargetClient:
    def test_parse_target(self):
        assert parse_target("http://h:1/") == (None, "http://h:1")
        assert parse_target("peer=http://h:1") == ("peer", "http://h:1")
        with pytest.raises(ValueError):
            parse_target("h:1")

    def test_llama_server_completion_stream(self):
        with StubServer() as stub:
            target = asyncio.run(probe(stub.url))
            assert (target.label, target.api) == ("target:llama-server", "completion")
            wl = small_workload()
            records = run_target(target, wl, run=0, warm_copies=2)
        warm, sent = stub.bodies[:2], stub.bodies[2:]
        assert [b["n_predict"] for b in warm] == [1, 1] and warm[0]["prompt"] == list(wl.prefix)
        assert [b["prompt"] for b in sent] and all(b["ignore_eos"] and b["cache_prompt"] for b in sent)
        assert sorted(tuple(b["prompt"]) for b in sent) == sorted(r.prompt for r in wl.requests)
        assert [r.index for r in records] == [0, 1, 2]
        for r in records:
            assert r.success and r.backend == "target:llama-server" and r.policy == "target:llama-server"
            assert (r.output_tokens, r.cached_tokens, r.prompt_tokens) == (4, 5, 9)
            assert 0 < r.ttft_s < r.e2e_s and r.itl_s > 0 and r.queue_s is None
        assert records[2].t_submit_s == pytest.approx(0.02, abs=0.015)

    def test_an_openai_target_streams_with_usage(self):
        with StubServer(llama_server=False) as stub:
            target = asyncio.run(probe(stub.url))
            assert (target.api, target.model, target.label) == ("openai", "stub-model", f"target:{stub.url[7:]}")
            records = run_target(target, small_workload(), run=1)
        assert all(b["model"] == "stub-model" and b["max_tokens"] == 4 for b in stub.bodies[1:])
        for r in records:
            assert r.success and (r.output_tokens, r.cached_tokens, r.run) == (4, 7, 1)

    def test_failures_are_records_not_exceptions(self):
        with StubServer(fail=True) as stub:
            target = Target(url=stub.url, label="target:x", api="completion")
            wl = build_workload(seed_workload(2, prefix_tokens=0, suffix_tokens=3, gen_tokens=4))
            records = run_target(target, wl, run=0)
        assert [r.success for r in records] == [False, False]
        assert all("HTTP 500" in r.error and r.output_tokens == 0 for r in records)
        m = run_metrics(records)
        assert (m.completed, m.failed) == (0, 2) and math.isnan(m.makespan_s)

    def test_nothing_listening(self):
        with pytest.raises(ConnectionError):
            asyncio.run(probe("http://127.0.0.1:9", timeout=2))
        target = Target(url="http://127.0.0.1:9", label="target:gone", api="openai")
        wl = build_workload(seed_workload(2, prefix_tokens=0, suffix_tokens=3, gen_tokens=4))
        records = run_target(target, wl, run=0)
        assert not any(r.success for r in records) and all(r.error for r in records)

    def test_targets_only_run_against_the_stub(self, tmp_path):
        with StubServer() as stub:
            rc = main(["bench", "seed", "--policies", "none", "--target", stub.url, "--requests", "2,3",
                       "--runs", "2", "--prefix-tokens", "6", "--suffix-tokens", "3", "--gen-tokens", "4",
                       "--interval-ms", "5", "--no-plots", "--out", str(tmp_path)])
        assert rc == 0
        summary, rows, decisions = read_outputs(tmp_path)
        assert summary["policies"] == ["target:llama-server"] and decisions == []
        assert [(r["requests"], r["routed"]) for r in summary["results"]] == [
            (2, {"target:llama-server": 2.0}), (3, {"target:llama-server": 3.0})]
        assert len(rows) == 2 * (2 + 3)


def test_side_by_side_with_our_own_server(tmp_path, tiny_path):
    """The engine's policies and a `tandem serve` peer (our aiohttp app) in one invocation."""
    with our_server(tiny_path, "cpu:threads=1,cap=2,ctx=512") as url:
        rc = main(["bench", "seed", "--model", str(tiny_path), *BACKENDS, "--policies", "seed-score",
                   "--target", f"tandem={url}", "--requests", "3", "--runs", "1", *SMALL_SEED,
                   "--no-plots", "--out", str(tmp_path)])
    assert rc == 0
    summary, rows, decisions = read_outputs(tmp_path)
    assert summary["policies"] == ["seed-score", "target:tandem"]
    assert summary["targets"][0]["api"] == "openai"
    # The peer's router said where each request of the run went and why (its /v1/routing).
    peer_said = [d for d in decisions if d["label"] == "target:tandem"]
    assert len(peer_said) == 3 and all(d["target"] and d["backend"] == "cpu" and "finishes first" in d["reason"] for d in peer_said)
    assert all(d["policy"] == "finish-first:pack" and (d["workload"], d["run"]) == ("seed", 0) for d in peer_said)
    # Each says how long the engine took to route it: snapshots and the policy's choice take time.
    assert all(d["took_s"] > 0 and d["wait_s"] >= 0 for d in peer_said)
    # The GPU driver's summary of them: each row's TTFT quantiles, its missed prefixes, the peer's reasons.
    import subprocess
    lines = subprocess.run([sys.executable, "scripts/gpu/ratios.py", "ttft", str(tmp_path)], check=True,
                           capture_output=True, text=True).stdout.splitlines()
    assert [line.split(" | ")[1] for line in lines] == ["seed-score", "target:tandem"]
    assert all("TTFT ms p10 " in line and "0 of 3 missed their prefix" in line for line in lines)
    assert "routing ms p50/p99: waited " in lines[1] and "routing ms" not in lines[0]
    peer_rows = [r for r in rows if r["policy"] == "target:tandem"]
    assert len(peer_rows) == 3 and all(r["success"] == "True" and r["output_tokens"] == "8" for r in peer_rows)
    assert all(int(r["cached_tokens"]) == 48 for r in peer_rows)  # the warmed prefix, reported in usage


def test_tenants_as_text_give_a_text_peer_the_engines_prompts(tmp_path, tiny_path):
    """`bench grid --tenants` with a `tandem serve` peer sent text: the peer tokenizes each
    whole prompt, the engine its tenant's prefix and its suffix apart; the words make both the
    same tokens, so prompt sizes agree request by request, and tenants' prefixes get cache hits."""
    with our_server(tiny_path, "cpu:threads=1,cap=4,ctx=2048") as url:
        rc = main(["bench", "grid", "--model", str(tiny_path), "--backend", "cpu:threads=1,cap=4,ctx=2048",
                   "--backend", "cpu:threads=1,cap=4,ctx=2048", "--policies", "round-robin",
                   "--target", f"tandem={url}", "--target-prompt", "text", "--requests", "10", "--runs", "1",
                   "--tenants", "2", "--tenant-prefix-tokens", "32", "--tenant-suffix-tokens", "6",
                   "--outputs", "fixed", "--gen-tokens", "4", "--arrivals", "poisson", "--rate", "50",
                   "--caps", "none", "--warmup", "0", "--no-plots", "--out", str(tmp_path)])
    assert rc == 0
    summary, rows, _ = read_outputs(tmp_path)
    assert summary["workloads"][0]["tenants"] == 2 and summary["targets"][0]["prompt"] == "text"
    engine = {r["index"]: r for r in rows if r["policy"] == "round-robin"}
    text_peer = {r["index"]: r for r in rows if r["policy"] == "target:tandem"}
    assert len(engine) == len(text_peer) == 10 and all(r["success"] == "True" for r in rows)
    assert all(engine[i]["prompt_tokens"] == text_peer[i]["prompt_tokens"] for i in engine)
    assert int(engine["0"]["prompt_tokens"]) > 38  # synthetic:tiny's 512 pieces split words
    assert max(int(r["cached_tokens"]) for r in text_peer.values()) > 32  # a tenant's prefix reused


def test_peers_alone_get_token_ids_of_the_models_vocabulary(tmp_path, tiny_path):
    """`bench grid --policies none` loads no engine; the prompts' token ids still come from
    `--model`'s vocabulary (read without its weights), which synthetic:tiny's 512 pieces bound:
    ids up to 32,000 were refused by the peer's validation at the prefix warm-up."""
    with our_server(tiny_path, "cpu:threads=1,cap=4,ctx=2048") as url:
        rc = main(["bench", "grid", "--model", str(tiny_path), "--policies", "none", "--caps", "none",
                   "--target", f"tandem={url}", "--requests", "4", "--runs", "1", "--prompt-tokens", "60",
                   "--shared", "50", "--outputs", "fixed", "--gen-tokens", "4", "--arrivals", "interval",
                   "--warmup", "0", "--no-plots", "--out", str(tmp_path)])
    assert rc == 0
    summary, rows, _ = read_outputs(tmp_path)
    assert summary["policies"] == ["target:tandem"]
    assert len(rows) == 4 and all(r["success"] == "True" and r["prompt_tokens"] == "60" for r in rows)
    assert max(int(r["cached_tokens"]) for r in rows) >= 29  # the shared half, warmed


def test_a_peer_refusing_its_warm_up_is_a_clear_error(tmp_path, tiny_path, monkeypatch, capsys):
    """A peer that refuses the prefix warm-up (say, a model with a smaller vocabulary than
    `--model`'s) ends the bench with its answer on one line and exit 2, not a traceback."""
    import bench.target

    def refuse(target, *a, **k):
        raise ConnectionError(f"{target.label}: warming the prefix failed: HTTP 400: token ids out of range")

    monkeypatch.setattr(bench.target, "run_target", refuse)
    with our_server(tiny_path, "cpu:threads=1,cap=4,ctx=2048") as url:
        rc = main(["bench", "grid", "--model", str(tiny_path), "--policies", "none", "--caps", "none",
                   "--target", f"tandem={url}", "--requests", "2", "--runs", "1", "--warmup", "0",
                   "--no-plots", "--out", str(tmp_path)])
    assert rc == 2
    assert "tandem: target:tandem: warming the prefix failed: HTTP 400" in capsys.readouterr().err


def test_bench_overhead_sampled_variants_print_each_part_against_greedy(tiny_path, capsys):
    """`--sampled-variants`: the fused sampler's parts alone (temperature, + top-k, + top-p,
    + min-p), each as a ratio to the greedy decode of the same round, with its graph reuse."""
    rc = main(["bench", "overhead", "--model", str(tiny_path), "--threads", "1", "--batches", "1,2",
               "--repeats", "1", "--no-llama", "--prompt-tokens", "64", "--gen-tokens", "16",
               "--sampled-variants", "temp,topk,topp,full"])
    out = _last_json(capsys)
    assert rc == 0
    for b in (1, 2):
        for name in ("temp", "topk", "topp", "full"):
            assert out[f"ratio_part_{name}_greedy_b{b}"] == round(out[f"part_{name}_b{b}_tok_s"] / out[f"engine_b{b}_tok_s"], 3)
            assert 0.0 <= out["variant_graph_reuse"][f"{name}_b{b}"] <= 1.0
            assert out["variant_decode_ms_per_step"][f"{name}_b{b}"] > 0
            assert f"{name}_b{b}" in out["variant_host_us_per_step"]
    assert out["fused_dist_placement"]["buffer"] and isinstance(out["fused_dist_placement"]["host"], bool)
    assert out["fused_dist_builds"]["shared"] >= 1


def test_bench_overhead_one_stage_variants_run_without_top_k_stages(default_path, capsys):
    """`topk1` / `full1`: where the default model's vocabulary (49,152) would take the top-k in
    stages (here on the CPU backend, asked to), these variants build one `ggml_top_k` per row
    instead, and leave the stages' settings as they were."""
    with fused_dist.top_k_stages(1024, on_cpu=True):
        rc = main(["bench", "overhead", "--model", str(default_path), "--threads", "1", "--batches", "1",
                   "--repeats", "1", "--no-llama", "--prompt-tokens", "32", "--gen-tokens", "8",
                   "--sampled-variants", "topk1"])
        assert (fused_dist.TOP_K_CHUNK, fused_dist.TOP_K_STAGES_ON_CPU) == (1024, True)
    out = _last_json(capsys)
    assert rc == 0
    assert out["fused_dist_builds"]["shared"] >= 1 and out["fused_dist_builds"].get("two-stage", 0) == 0


def test_bench_overhead_compares_the_sort_free_computation_with_the_one_by_sorts(default_path, capsys):
    """`p` (temperature + top-p), `pk` (+ top-k 40) and their `-staged` twins in one run: the
    sort-free builds (proposals for `p`, the top-k by maxima for `pk` where the CPU backend is
    asked to) beside the builds by sorts, each a ratio to greedy; the path is as it was after."""
    with fused_dist.fused_path("sortfree", pooled_on_cpu=True):
        rc = main(["bench", "overhead", "--model", str(default_path), "--threads", "1", "--batches", "2",
                   "--repeats", "1", "--no-llama", "--prompt-tokens", "32", "--gen-tokens", "8",
                   "--sampled-variants", "p,pk,pk-staged"])
        assert (fused_dist.PATH, fused_dist.POOLED_ON_CPU) == ("sortfree", True)
    out = _last_json(capsys)
    assert rc == 0
    for name in ("p", "pk", "pk-staged"):
        assert out[f"ratio_part_{name}_greedy_b2"] > 0
    builds = out["fused_dist_builds"]
    assert builds["proposals"] >= 1 and builds["maxima"] >= 1 and builds["sortfree"] > builds["proposals"]


def test_bench_overhead_rejects_an_unknown_sampled_variant(tiny_path, capsys):
    rc = main(["bench", "overhead", "--model", str(tiny_path), "--threads", "1", "--batches", "1",
               "--repeats", "1", "--no-llama", "--sampled-variants", "temp,nucleus"])
    assert rc == 2
    assert "nucleus" in capsys.readouterr().err



@pytest.mark.parametrize(("spec", "loaded", "expected"), [
    ("gpu", ["gpu-a", "gpu-b", "gpu-c", "gpu-d", "cpu"], "gpu-a"),  # contexts=auto, resolved at load
    ("gpu", ["gpu", "cpu"], "gpu"),
    ("cpu0", ["cpu0", "cpu1"], "cpu0"),
])
def test_a_swept_spec_is_found_among_the_backends_it_loaded_as(spec, loaded, expected):
    assert loaded_name(spec, loaded) == expected


def test_only_swept_in_sweep_policies_names_the_swept_backend():
    from bench.study import swept_policy

    assert swept_policy("only:swept", "gpu-a") == "only:gpu-a"
    assert swept_policy("gpu-only", "gpu-a") == "gpu-only"
