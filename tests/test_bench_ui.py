"""`tandem bench ui`: the real main window, live on the engine, against no UI at all."""

from __future__ import annotations

import json

from app.cli import main


def test_bench_ui_measures_what_the_live_window_costs_decode(qtbot, tiny_path, capsys):
    rc = main(["bench", "ui", "--model", str(tiny_path), "--backend", "cpu:threads=1,cap=2",
               "--batch", "2", "--prompt-tokens", "16", "--gen-tokens", "24", "--repeats", "1"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["no_ui_tok_s"] > 0 and out["ui_tok_s"] > 0
    assert out["ui_ratio"] == round(out["ui_tok_s"] / out["no_ui_tok_s"], 3)
    assert out["batch"] == 2 and out["backends"] == ["cpu"] and out["switch_interval_ms"] == 1.0
