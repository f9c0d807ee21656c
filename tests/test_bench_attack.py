"""`tandem bench attack` end to end, small: a real `tandem serve` on the tiny model, two short
attacks beside normal traffic, one JSON summary with a row per phase."""

from __future__ import annotations

import json
import subprocess
import sys

WAIT = 300


def test_bench_attack_prints_each_phase_against_the_quiet_baseline(tmp_path):
    p = subprocess.run([sys.executable, "-m", "app", "bench", "attack", "--model", "synthetic:tiny",
                        "--backend", "cpu:threads=1,cap=4,ctx=1024", "--phase-s", "3", "--connections", "30",
                        "--attacks", "keepalive,grammar,users,schema-max,pattern", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=WAIT)
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert [r["phase"] for r in summary["phases"]] == ["quiet", "keepalive", "grammar", "users", "schema-max",
                                                       "pattern"]
    assert all(r["normal_requests"] > 0 for r in summary["phases"])
    grammar = summary["phases"][2]
    assert grammar["attack"].get("400", 0) > 0 and "200" not in grammar["attack"]  # every bomb refused
    assert all(r["server_cores"] > 0 and r["load_average"] >= 0 for r in summary["phases"])  # CPU per phase
    assert json.loads((tmp_path / "attack.json").read_text())["phases"] == summary["phases"]
    assert "p95/quiet" in p.stdout
    # two more users are the control of the accepted schema, not an attack with a bar
    users, schema_max, pattern = summary["phases"][3:]
    assert pattern["attack"].get("400", 0) > 0 and "200" not in pattern["attack"]  # the wedge refused
    # the attacker's own address: a client there too, with its replies and longest wait
    assert all(r["own"].get("200", 0) + r["own"].get("429", 0) > 0 and r["own_max_s"] > 0 for r in summary["phases"])
    assert all(r["rss_peak_mb"] > 0 and "rss_growth_mb" in r for r in summary["phases"])
    assert users["pass"] is None and users["attack"].get("200", 0) > 0
    assert schema_max["p95_vs_users"] == round(schema_max["p95_ms"] / users["p95_ms"], 2)
    assert summary["pass"] == all(r["pass"] for r in summary["phases"] if r["pass"] is not None)
    assert all(len(r["p95_ms_by_quarter"]) == 4 for r in summary["phases"])
