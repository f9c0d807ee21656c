"""`tandem bench constrained` end to end, small: a chat alone, beside a plain request and beside
a constrained one on the tiny model, one JSON summary with a row per hog and mode."""

from __future__ import annotations

import json
import subprocess
import sys

WAIT = 300


def test_bench_constrained_prints_the_chat_beside_each_hog_against_its_control(tmp_path):
    p = subprocess.run([sys.executable, "-m", "app", "bench", "constrained", "--model", "synthetic:tiny",
                        "--backend", "cpu:threads=1,cap=4,ctx=2048", "--hogs", "grammar,json", "--modes", "sampled",
                        "--repeats", "1", "--tokens", "4", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=WAIT)
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert [(r["hog"], r["mode"]) for r in summary["rows"]] == [("grammar", "sampled"), ("json", "sampled")]
    for r in summary["rows"]:
        assert r["tok_s_alone"] > 0 and r["tok_s_plain"] > 0 and r["tok_s_hog"] > 0
        assert r["gap_p50_ms"] is not None and r["grammar_deferrals"] >= 0  # steps the chat and the hog shared
    assert json.loads((tmp_path / "constrained.json").read_text())["rows"] == summary["rows"]
