"""`tandem bench laptop`: the ratios from hand-made rows, and the whole command on the tiny model
(fresh `tandem serve` processes on empty rate caches, the study's workload over HTTP)."""

from __future__ import annotations

import json

import pytest

from app.cli import main, parse_args
from bench.laptop import LLAMA_CPP, format_summary, layouts, summarize


def row(layout, makespan, ttft, failed=0, run=0):
    return {"layout": layout, "run": run, "ready_s": 3.0, "makespan_s": makespan, "ttft_p50_s": ttft,
            "output_tok_s": 1024 / makespan, "failed": failed}


def test_ratios_compare_the_default_with_both_references():
    rows = [row("default", 12.0, 0.5), row("one", 11.0, 0.4), row(LLAMA_CPP, 26.0, 9.0)]
    ratios = summarize(rows, ["default", "one", LLAMA_CPP])["ratios"]
    assert ratios == pytest.approx({"makespan default / one": 12 / 11, f"makespan default / {LLAMA_CPP}": 12 / 26,
                                    f"TTFT p50 default / {LLAMA_CPP}": 0.5 / 9})


def test_medians_are_taken_over_runs_without_failures():
    rows = [row("default", 10.0, 0.5), row("default", 14.0, 0.7, run=1), row("default", 11.0, 0.6, run=2),
            row("default", 1.0, 0.1, failed=1, run=3)]
    med = summarize(rows, ["default"])["medians"]["default"]
    assert (med["makespan_s"], med["ttft_p50_s"]) == (11.0, 0.6)


def test_summary_says_which_targets_are_met():
    text = format_summary(summarize([row("default", 12.0, 0.5), row("one", 11.0, 0.4), row(LLAMA_CPP, 20.0, 9.0)],
                                    ["default", "one", LLAMA_CPP]))
    assert "ratio makespan default / one: 1.091  (target <= 1.1: met)" in text
    assert f"ratio makespan default / {LLAMA_CPP}: 0.600  (target <= 0.5: NOT met)" in text
    assert "| one | 3.0 | 11.00 | 0.400 |" in text


def test_bad_layout_is_a_clear_error(tiny_path, capsys):
    rc = main(["bench", "laptop", "--model", str(tiny_path), "--no-llama-cpp", "--layout", "nospec"])
    assert rc == 2
    assert "expected LABEL=SPEC" in capsys.readouterr().err


def test_laptop_bench_serves_each_layout_from_an_empty_rate_cache(tiny_path, capsys):
    rc = main(["bench", "laptop", "--model", str(tiny_path), "--requests", "2", "--no-llama-cpp",
               "--ready-timeout", "120", "--timeout", "120"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    final = json.loads(out[-1])
    assert [r["layout"] for r in final["rows"]] == ["default", "one"]
    for r in final["rows"]:
        assert r["completed"] == 2 and r["failed"] == 0 and r["makespan_s"] > 0 and r["ready_s"] > 0
    assert "makespan default / one" in final["summary"]["ratios"]
    assert any(line.startswith("ratio makespan default / one:") for line in out)


def test_layouts_name_their_servers_backends():
    args = parse_args(["bench", "laptop", "--cores", "4", "--layout", "split=cpu:threads=2,cap=4;cpu:threads=2,cap=4"])
    got = {lay.label: lay for lay in layouts(args, "/m.gguf")}
    assert list(got) == ["default", "one", "split", LLAMA_CPP]
    assert "--backend" not in got["default"].argv
    assert got["one"].argv[-2:] == ("--backend", "cpu:threads=4,cap=8")
    assert got["split"].argv.count("--backend") == 2
    assert got[LLAMA_CPP].argv[-2:] == ("--interrupt_requests", "False")


def test_summary_without_the_default_layout_has_no_ratios():
    assert summarize([row("one", 11.0, 0.4)], ["one"])["ratios"] == {}


def test_zero_requests_is_a_clear_error(capsys):
    assert main(["bench", "laptop", "--requests", "0", "--no-llama-cpp"]) == 2
    assert "--requests and --runs must be >= 1" in capsys.readouterr().err
