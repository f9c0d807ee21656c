"""Benchmarks never route on placeholder rates: `bench seed` measures a never-calibrated
backend at load, as `serve` does, and a replay prices a run with the rates it recorded, else
this machine's calibration of that model and config, and says which (the real tiny model,
two 1-thread CPU backends, an empty rate store)."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from bench.simulate import replay_rates

BACKENDS = ["--backend", "cpu:threads=1,cap=2", "--backend", "cpu:threads=1,cap=2"]
SMALL = ["--requests", "3", "--runs", "1", "--warmup", "0", "--prefix-tokens", "32", "--suffix-tokens", "8",
         "--gen-tokens", "4", "--no-plots"]


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory, tiny_path):
    out = tmp_path_factory.mktemp("rates")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", str(out / "empty-cache"))
        rc = main(["bench", "seed", "--model", str(tiny_path), *BACKENDS, "--policies", "default", *SMALL,
                   "--out", str(out / "bench")])
        yield rc, out / "bench", mp


def test_a_never_calibrated_config_is_measured_before_the_bench_routes(seed_run, capfd):
    rc, out, _ = seed_run
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    sources = [b["rates"]["source"] for b in summary["backends"]]
    assert sources == ["measured", "measured"]
    assert all(b["config_key"].startswith("cpu:threads=1,") for b in summary["backends"])
    assert any(n.startswith("rates measured at load") for n in summary["notes"])
    decisions = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    assert decisions and all(c["decode_rate"] != 40 for d in decisions for c in d["candidates"])


def test_a_replay_uses_the_rates_the_run_recorded(seed_run):
    _, out, _ = seed_run
    summary = json.loads((out / "summary.json").read_text())
    used = replay_rates(summary["engines"][0], summary["model"])
    assert set(used) == {"cpu0", "cpu1"}
    for rates, why in used.values():
        assert why.startswith("the rates recorded with the run (measured at load")
        assert not rates.placeholder


def test_a_replay_of_a_run_on_placeholders_takes_this_machines_calibration(seed_run, tmp_path):
    """A run recorded on placeholder rates (before the benches measured at load): the replay
    prices it with the calibration the first run stored for that model and config."""
    _, out, _ = seed_run
    summary = json.loads((out / "summary.json").read_text())
    engine = summary["engines"][0]
    for b in engine["backends"]:
        b["rates"].update(prefill_tok_s=400.0, decode_tok_s=40.0, source="default", step_table=[],
                          step_alpha_s=0.0, step_beta_s=0.0)
        b.pop("config_key")  # older runs recorded none
    used = replay_rates(engine, summary["model"])
    for rates, why in used.values():
        assert why.startswith("this machine's calibration of its model and config")
        assert rates.decode_tok_s != 40.0 and not rates.placeholder
    unknown = replay_rates(engine, {"fingerprint": "not-a-model"})
    assert all(why.startswith("the run's placeholder rates") for _, why in unknown.values())


def test_the_replay_says_which_rates_it_used(seed_run, tmp_path, capsys):
    _, out, _ = seed_run
    rc = main(["simulate", "--replay", str(out), "--runs", "1", "--out", str(tmp_path / "replay")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Rates the router was told: cpu0: the rates recorded with the run (measured at load" in text
    saved = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert set(saved["rates"]) == {"cpu0", "cpu1"}
