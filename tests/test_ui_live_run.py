"""Pause and step for live runs: a demo from the Run menu, driven from the Experiments panel's
Pause/Step row and the Run menu's F6/F7."""

from __future__ import annotations

from ui_fixtures import WAIT_MS, make_window, qasync_loop, ui_engine  # noqa: F401

from ui.live_run import seed_workload

# Arrivals 0.3 s apart: a pause after the first lands well before the second is due.
SPACED = seed_workload(5, prefix_tokens=32, suffix_tokens=4, gen_tokens=6, interval_s=0.3)


def started_demo(qtbot, w):
    run = w.start_demo(SPACED)
    assert run is not None
    qtbot.waitUntil(lambda: run.n_submitted >= 1, timeout=WAIT_MS)
    return run


def test_pause_holds_back_arrivals_while_the_engine_serves_what_it_holds(qtbot, make_window):
    w = make_window()
    run = started_demo(qtbot, w)
    controls = w.panels["experiments"].run_controls
    assert controls.run is run
    controls.pause_button.click()
    assert run.paused
    held = run.n_submitted
    assert held < SPACED.n_requests
    # What was sent finishes; nothing new is sent, though later arrivals fall due meanwhile.
    qtbot.waitUntil(lambda: len(run.result.records) == held, timeout=WAIT_MS)
    qtbot.wait(round(SPACED.interval_s * 2 * 1000))
    assert run.n_submitted == held
    assert run.running
    assert "paused" in controls.state_label.text()
    controls.pause_button.click()  # Resume: the rest arrive and the run completes
    qtbot.waitUntil(lambda: not run.running, timeout=WAIT_MS)
    assert run.state == "done"
    assert len(run.result.records) == SPACED.n_requests


def test_step_sends_exactly_the_next_arrival(qtbot, make_window):
    w = make_window()
    run = started_demo(qtbot, w)
    assert w.toggle_pause()
    before = run.n_submitted
    w.step_action.trigger()  # F7
    assert run.n_submitted == before + 1
    assert run.paused  # stepping leaves the run paused
    qtbot.waitUntil(lambda: len(run.result.records) == before + 1, timeout=WAIT_MS)
    qtbot.wait(round(SPACED.interval_s * 2 * 1000))
    assert run.n_submitted == before + 1
    w.pause_action.trigger()  # F6: resume
    qtbot.waitUntil(lambda: not run.running, timeout=WAIT_MS)
    assert len(run.result.records) == SPACED.n_requests


def test_resumed_arrivals_keep_their_spacing(qtbot, make_window):
    w = make_window()
    run = started_demo(qtbot, w)
    run.pause()
    qtbot.wait(round(SPACED.interval_s * 3 * 1000))  # longer than the rest of the schedule
    resumed_at = run.n_submitted
    run.resume()
    # Not a burst: right after resuming at most the arrival that was due at the pause goes out.
    assert run.n_submitted <= resumed_at + 1
    qtbot.waitUntil(lambda: not run.running, timeout=WAIT_MS)
    assert run.state == "done"


def test_step_needs_a_live_run(qtbot, make_window):
    w = make_window()
    assert not w.step_run()
    assert not w.panels["experiments"].run_controls.step_button.isEnabled()
