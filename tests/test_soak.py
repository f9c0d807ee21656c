"""`tandem bench soak`, short: mixed chat/API traffic with cancellations on the tiny model leaves
no KV cells, threads, fds or unfinished requests behind, and no request fails unexpectedly.

RSS growth is reported but not asserted here: 15 s is all warm-up (allocator arenas, first
use of every code path); the 30-minute figure is in docs/reliability.md.
"""

from __future__ import annotations

import csv
import json
import threading
import time

from app import cli
from bench.soak import KINDS, Traffic, py_blocks, system_prompts, warmup_seconds


def test_a_short_soak_leaves_nothing_behind(capsys, tmp_path):
    rc = cli.main(["bench", "soak", "--minutes", "0.25", "--interval", "5", "--out", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    summary = json.loads(out[-1])
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["requests"] > 20 and summary["cancelled"] > 0
    assert all(k["requests"] > 0 for k in summary["by_kind"].values()), "every client kind ran"
    assert summary["idle_reached"] and summary["engine_unfinished"] == 0
    assert summary["kv_cells_idle"] == 0
    assert summary["kv_state_bytes_growth"] == 0, "llama.cpp still holds cells after the flush"
    assert summary["threads_end"] == 0, summary["threads_left"]  # every thread the soak started is gone
    assert summary["fds_growth"] <= 0  # fewer at the end: an earlier test's files closed meanwhile
    assert summary["engine_finished"].get("finished_error", 0) == 0
    assert summary["engine_finished"]["finished_stopped"] > 0, "stop strings end some requests"
    # Time series: a line per interval plus the warm-up and idle lines; the files agree with stdout.
    assert sum(line.startswith(" ") and " s  requests " in line for line in out) >= 3
    rows = list(csv.DictReader((tmp_path / "soak.csv").read_text().splitlines()))
    assert len(rows) >= 3 and rows[-1]["kv_cpu0"] == rows[-1]["kv_cpu1"] == "0"
    assert json.loads((tmp_path / "soak.json").read_text()) == summary


def _draw(seed: int) -> list:
    traffic = Traffic(seed, 3, 0.2, system_prompts(0))
    return [traffic.next() for _ in range(200)]


def test_traffic_is_a_function_of_its_seed():
    first, again, other = _draw(0), _draw(0), _draw(1)
    assert first == again and first != other


def test_traffic_mixes_every_kind():
    first = _draw(0)
    assert {s.kind for s in first} == set(KINDS)
    assert any(s.cancel_after for s in first) and any(s.abort_after_s for s in first)
    assert all(1 <= s.max_tokens <= 256 for s in first)


def test_warmup_is_a_tenth_clamped_to_20_s_or_half():
    assert warmup_seconds(1800) == 180
    assert warmup_seconds(180) == 20
    assert warmup_seconds(15) == 7.5


def test_sampling_the_heap_leaves_other_threads_tuples_alone():
    # The soak samples its heap while client threads build tuples from generators. A sampler
    # that listed the objects (gc.get_objects) broke one in ~40 ms: SystemError in the client.
    broken: list[BaseException] = []
    stop = threading.Event()

    def build():
        while not stop.is_set():
            try:
                tuple(x for x in range(50))
            except SystemError as e:
                broken.append(e)
                return

    builder = threading.Thread(target=build)
    builder.start()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and not broken:
        assert py_blocks() > 0
    stop.set()
    builder.join()
    assert broken == []
