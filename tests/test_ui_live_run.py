"""Pause and step for live runs: a demo from the Run menu, driven from the Experiments panel's
Pause/Step row and the Run menu's F6/F7, the Teaching panel's live run from its own row, and an
experiment through the benchmark runner.

Each run is paused before its arrivals start (while it flushes and warms), so what is sent
depends on the steps alone, never on how fast this machine reaches the next line."""

from __future__ import annotations

import csv

import pytest
from ui_fixtures import WAIT_MS, make_window, qasync_loop, ui_engine  # noqa: F401

from ui.live_run import STUDY, seed_workload
from ui.panels.experiments import COLUMNS

SPACED = seed_workload(4, prefix_tokens=32, suffix_tokens=4, gen_tokens=6, interval_s=0.3)


def engine_idle(w) -> bool:
    return all(not s.items for s in w.engine.snapshot())


def paused_demo(qtbot, w):
    run = w.start_demo(SPACED)
    assert run is not None
    controls = w.panels["experiments"].run_controls
    assert controls.run is run
    controls.pause_button.click()  # still flushing: nothing has been sent
    assert run.paused
    qtbot.waitUntil(lambda: run.state == "running", timeout=WAIT_MS)
    return run, controls


def test_pause_holds_back_arrivals_while_the_engine_serves_what_it_holds(qtbot, make_window):
    w = make_window()
    run, controls = paused_demo(qtbot, w)
    assert run.step() and run.step()
    assert run.n_submitted == 2
    # What was sent finishes; nothing new is sent, though every arrival falls due meanwhile.
    qtbot.waitUntil(lambda: len(run.result.records) == 2, timeout=WAIT_MS)
    qtbot.wait(round(SPACED.interval_s * SPACED.n_requests * 1000))
    assert run.n_submitted == 2
    assert run.running
    assert "paused" in controls.state_label.text()
    controls.pause_button.click()  # Resume: the rest arrive and the run completes
    qtbot.waitUntil(lambda: not run.running, timeout=WAIT_MS)
    assert run.state == "done"
    assert len(run.result.records) == SPACED.n_requests


def test_step_sends_exactly_the_next_arrival(qtbot, make_window):
    w = make_window()
    run, _controls = paused_demo(qtbot, w)
    w.step_action.trigger()  # F7
    assert run.n_submitted == 1
    assert run.paused  # stepping leaves the run paused
    qtbot.waitUntil(lambda: len(run.result.records) == 1, timeout=WAIT_MS)
    qtbot.wait(round(SPACED.interval_s * 2 * 1000))
    assert run.n_submitted == 1
    w.pause_action.trigger()  # F6: resume
    qtbot.waitUntil(lambda: not run.running, timeout=WAIT_MS)
    assert len(run.result.records) == SPACED.n_requests


def test_resumed_arrivals_keep_their_spacing(qtbot, make_window):
    w = make_window()
    run, _controls = paused_demo(qtbot, w)
    assert run.step()  # the clock stands at the first arrival
    qtbot.wait(round(SPACED.interval_s * SPACED.n_requests * 1000))  # longer than the whole schedule
    run.resume()
    # Not a burst: the next arrival is still an interval away on the run's clock.
    assert run.n_submitted == 1
    assert run.clock.now() < SPACED.interval_s
    qtbot.waitUntil(lambda: not run.running, timeout=WAIT_MS)
    assert run.state == "done"


def test_a_demo_rows_makespan_leaves_out_the_idle_pause(qtbot, make_window):
    w = make_window()
    run, controls = paused_demo(qtbot, w)
    assert run.step()
    qtbot.waitUntil(lambda: len(run.result.records) == 1, timeout=WAIT_MS)
    qtbot.wait(1000)  # paused, nothing in flight
    controls.pause_button.click()  # resume
    qtbot.waitUntil(lambda: not run.running, timeout=WAIT_MS)
    ex = w.panels["experiments"]
    m = ex.summaries[-1].metrics
    r = run.result
    first = r.records[r.request_ids[0]]
    ((_, resumed),) = r.pauses  # paused while flushing, so from the start of the arrivals
    idle = (resumed - r.t_start) - first.e2e_s  # the paused time the stepped request was not in flight
    assert m.paused_s == pytest.approx(idle)
    assert m.paused_s > 0.9  # qtbot.wait(1000) came back after 0.96 s once, under a full suite
    assert m.makespan_s == pytest.approx(r.t_end - r.t_start - idle)
    makespan_cell = ex.table.item(ex.table.rowCount() - 1, COLUMNS.index("makespan"))
    assert makespan_cell.toolTip() == f"paused {m.paused_s:.1f} s, not counted"


def test_the_csv_export_says_how_much_paused_time_was_left_out(qtbot, make_window, tmp_path):
    from engine.sim.benchmark import RunMetrics, RunSummary

    ex = make_window().panels["experiments"]
    ex.add_summary(RunSummary("#1", "seed-score", RunMetrics(3.0, 10.0, 0.1, 0.2, 1.0, 2.0, 3, 0, 30, paused_s=42.0)))
    (row,) = csv.DictReader(ex.export_csv(tmp_path / "r.csv").open())
    assert float(row["paused_s"]) == 42.0


def test_step_needs_a_live_run(qtbot, make_window):
    w = make_window()
    assert not w.step_run()
    assert not w.panels["experiments"].run_controls.step_button.isEnabled()


def test_a_benchmark_runner_experiment_pauses_between_arrivals(qtbot, make_window):
    from engine.experiment import experiment_runner
    from ui.panels.experiments import BenchRun

    w = make_window(bench_runner_factory=experiment_runner)
    ex = w.panels["experiments"]
    ex.n_requests.setValue(3)
    ex.interval.setValue(300)
    ex.prefix.setValue(32)
    ex.suffix.setValue(4)
    ex.max_tokens.setValue(6)
    assert ex.start(["seed-score"])
    controls = ex.run_controls
    assert isinstance(controls.run, BenchRun)
    run = controls.run
    controls.pause_button.click()  # before the runner has flushed and warmed
    controls.step_button.click()
    qtbot.waitUntil(lambda: run.n_submitted == 1, timeout=WAIT_MS)
    qtbot.waitUntil(lambda: engine_idle(w), timeout=WAIT_MS)
    qtbot.wait(900)  # every arrival falls due
    assert run.n_submitted == 1  # the runner's thread waits on the paused clock
    controls.pause_button.click()  # resume
    qtbot.waitUntil(lambda: not ex.running, timeout=WAIT_MS)
    assert [s.metrics.completed for s in ex.summaries] == [3]


def paused_teaching_run(qtbot, w):
    t = w.panels["teaching"]
    t.live_button.click()
    run = t.run
    assert t.run_controls.run is run
    t.run_controls.pause_button.click()  # still flushing: nothing has been sent
    return t, run


def test_teaching_pause_button_is_off_without_a_live_run(qtbot, make_window):
    t = make_window().panels["teaching"]
    assert not t.run_controls.pause_button.isEnabled()
    assert not t.run_controls.step_button.isEnabled()


def test_teaching_pause_button_pauses_its_live_run(qtbot, make_window):
    w = make_window()
    t, run = paused_teaching_run(qtbot, w)
    assert run.paused
    qtbot.waitUntil(lambda: run.state == "running", timeout=WAIT_MS)
    qtbot.wait(round(STUDY.interval_s * STUDY.n_requests * 1000) + 200)  # every arrival falls due
    assert run.n_submitted == 0
    assert t.run_controls.pause_button.text() == "Resume"
    t.run_controls.step_button.click()  # Step: one arrival, still paused
    assert run.n_submitted == 1
    assert run.paused
    t.run_controls.pause_button.click()  # Resume
    qtbot.waitUntil(lambda: not run.running, timeout=WAIT_MS)


def test_teaching_resume_button_resumes_its_live_run(qtbot, make_window):
    w = make_window()
    t, run = paused_teaching_run(qtbot, w)
    qtbot.waitUntil(lambda: run.state == "running", timeout=WAIT_MS)
    t.run_controls.pause_button.click()  # Resume
    assert not run.paused
    qtbot.waitUntil(lambda: not run.running, timeout=WAIT_MS)
    assert run.state == "done"
    assert len(run.result.records) == STUDY.n_requests
    assert not t.run_controls.pause_button.isEnabled()  # the run is over: the buttons are off


def test_f6_pauses_the_teaching_live_run(qtbot, make_window):
    w = make_window()
    t = w.panels["teaching"]
    t.live_button.click()
    w.pause_action.trigger()  # F6 reaches the same run the panel's button drives
    assert t.run.paused
    assert t.run_controls.pause_button.isChecked()
    w.pause_action.trigger()
    assert not t.run.paused
    qtbot.waitUntil(lambda: not t.run.running, timeout=WAIT_MS)
