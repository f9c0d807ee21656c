"""The Teaching panel's "What if" tab: a profile picked and edited, simulated off the GUI
thread, and a live run on this machine beside its simulation."""

from __future__ import annotations

import pytest
from ui_fixtures import WAIT_MS, make_window, qasync_loop, ui_engine  # noqa: F401

from ui.panels.whatif import THIS_MACHINE, WORKLOADS


def _whatif(w):
    panel = w.panels["teaching"]
    panel.tabs.setCurrentWidget(panel.whatif)
    return panel.whatif


def _cell(table, row, col):
    return table.item(row, col).text()


def _simulate(qtbot, panel):
    with qtbot.waitSignal(panel.simulated, timeout=WAIT_MS):
        panel.simulate_button.click()


def test_the_study_on_the_m2_profile_sends_request_8_to_the_cpu(qtbot, make_window):
    panel = _whatif(make_window())
    panel.profile_box.setCurrentText("study-m2")
    panel.n_box.setValue(8)
    _simulate(qtbot, panel)
    seed = next(r for r in panel.rows if r["policy"] == "seed-score")
    assert seed["routed"] == {"gpu": 7, "cpu": 1}
    assert panel.results.rowCount() == len(panel.rows) == 4


def test_an_edited_cpu_speed_moves_more_work_to_it(qtbot, make_window):
    panel = _whatif(make_window())
    panel.profile_box.setCurrentText("study-m2")
    panel.n_box.setValue(48)
    _simulate(qtbot, panel)
    before = next(r for r in panel.rows if r["policy"] == "seed-score")["routed"]["cpu"]
    cpu_row = next(i for i in range(panel.table.rowCount()) if _cell(panel.table, i, 0) == "cpu")
    panel.table.item(cpu_row, 4).setText("730")  # prefill 10x
    panel.table.item(cpu_row, 5).setText("450")  # decode 10x
    _simulate(qtbot, panel)
    after = next(r for r in panel.rows if r["policy"] == "seed-score")["routed"]["cpu"]
    assert after > before


def test_a_bad_cell_is_refused_with_its_reason(qtbot, make_window):
    panel = _whatif(make_window())
    panel.table.item(0, 2).setText("many")
    panel.simulate_button.click()
    assert "must be a number" in panel.note.text()
    assert panel.results.rowCount() == 0


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_workload_simulates_on_this_machine(qtbot, make_window, name):
    panel = _whatif(make_window())
    panel.profile_box.setCurrentText(THIS_MACHINE)
    panel.workload_box.setCurrentText(name)
    panel.n_box.setValue(4)
    _simulate(qtbot, panel)
    assert all(sum(r["routed"].values()) == 4 for r in panel.rows)


def test_live_run_sits_beside_its_simulation(qtbot, make_window):
    panel = _whatif(make_window())
    panel.workload_box.setCurrentText("grid: shared 0 %, out 128, every 50 ms")
    panel.n_box.setValue(2)
    with qtbot.waitSignal(panel.simulated, timeout=WAIT_MS):
        panel.live_button.click()
    runs = [r["run"] for r in panel.rows]
    assert runs == ["live: this machine", "sim: this machine"]
    live, sim = panel.rows
    assert sum(live["routed"].values()) == sum(sim["routed"].values()) == 2
