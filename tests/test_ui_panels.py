"""Live panels on a real engine: backend cards, controls, the routing table, latency histograms."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace

import pytest
from PySide6.QtCore import Qt
from ui_fixtures import WAIT_MS, make_window, qasync_loop, spare_engine, ui_engine  # noqa: F401

from engine.core.request import Request, RequestStatus, SamplingParams
from engine.core.snapshot import Rates
from ui.live_run import WorkloadRun, seed_workload
from ui.model.axes import occupied_log_range
from ui.model.live_stats import EDGES
from ui.panels.routing import BACKEND_COLUMN, TERMS, score_term
from ui.theme import WORKING

SMALL = seed_workload(6, prefix_tokens=64, suffix_tokens=8, gen_tokens=8, interval_s=0.02)


def run_workload(qtbot, w, spec=SMALL):
    run = WorkloadRun(w.engine, w.bridge, spec, label="test", parent=w)
    phases = []
    run.phase.connect(phases.append)
    run.start()
    qtbot.waitUntil(lambda: not run.running, timeout=WAIT_MS)
    assert run.state == "done", (phases, run.result.error)
    assert phases[:3] == ["flushing", "warming", "running"]
    return run.result


def tick(qtbot, w):
    """Let the bridge's timer fire at least once more."""
    seen = []
    w.bridge.tick.connect(seen.append)
    qtbot.waitUntil(lambda: bool(seen), timeout=WAIT_MS)
    w.bridge.tick.disconnect(seen.append)


def test_bridge_delivers_engine_events_on_the_gui_thread(qtbot, make_window):
    w = make_window()
    threads = []
    w.bridge.finished.connect(lambda _r: threads.append(threading.current_thread()))
    run_workload(qtbot, w, seed_workload(2, prefix_tokens=16, suffix_tokens=4, gen_tokens=4))
    assert threads and all(t is threading.main_thread() for t in threads)


def test_cap_spin_box_sets_the_backend_cap_at_once(qtbot, make_window, ui_engine):
    w = make_window()
    card = w.panels["backends"].cards["cpu0"]
    card.cap_spin.setValue(2)
    assert ui_engine.backend("cpu0").cap == 2
    tick(qtbot, w)
    assert card.running_bar.format() == "0 / live cap 2"
    controls = w.panels["controls"]
    assert controls.cap_spins["cpu0"].value() == 2  # the other view of the same cap follows
    controls.cap_spins["cpu1"].setValue(3)
    assert ui_engine.backend("cpu1").cap == 3


def test_a_backend_card_shows_the_live_cap_with_its_reason(qtbot, make_window, ui_engine):
    w = make_window()
    card = w.panels["backends"].cards["cpu0"]
    card.cap_spin.setValue(3)
    tick(qtbot, w)
    assert card.limit_label.text() == "live cap 3 of ceiling 3: set by the user"


def test_the_policy_list_offers_no_gpu_policy_without_a_gpu(make_window):
    c = make_window().panels["controls"]
    assert "gpu-only" not in [c.policy_combo.itemText(i) for i in range(c.policy_combo.count())]  # no GPU here


def test_the_policy_control_sets_the_routers_policy(make_window, ui_engine):
    c = make_window().panels["controls"]
    c.policy_combo.setCurrentText("least-work")
    assert ui_engine.router.policy == "least-work"


def test_the_policy_help_says_which_policy_is_the_default(make_window, ui_engine):
    c = make_window().panels["controls"]
    c.policy_combo.setCurrentText("finish-first:pack")
    assert ui_engine.router.policy == "finish-first:pack"
    assert c.policy_help.text().endswith("(the default).")
    c.policy_combo.setCurrentText("finish-first")
    assert "(the default)" not in c.policy_help.text()


def test_the_budget_control_sets_the_routers_budget(make_window, ui_engine):
    c = make_window().panels["controls"]
    c.budget_combo.setCurrentText("ratio")
    assert ui_engine.router.budget == "ratio"


def _override_cpu1_rates(c) -> None:
    c.prefill_spins["cpu1"].setValue(73.0)
    c.decode_spins["cpu1"].setValue(45.0)


def test_rates_typed_in_override_the_backends(qtbot, make_window, ui_engine):
    w = make_window()
    c = w.panels["controls"]
    _override_cpu1_rates(c)
    assert ui_engine.backend("cpu1").rates == Rates(73.0, 45.0, source="override")
    tick(qtbot, w)
    assert c.source_labels["cpu1"].text() == "override"


def test_reset_rates_drops_an_override(make_window, ui_engine):
    c = make_window().panels["controls"]
    _override_cpu1_rates(c)
    c.reset_rates()
    assert ui_engine.backend("cpu1").rates.source != "override"


def test_routing_table_gains_a_row_per_request_equal_to_the_engines_record(qtbot, make_window, ui_engine):
    w = make_window()
    view = w.panels["routing"]
    result = run_workload(qtbot, w)
    model = view.model
    assert model.rowCount() == SMALL.n_requests
    recorded = {d.request_id: d for d in ui_engine.router.recent()}
    for row, d in enumerate(model.decisions):
        assert d.request_id in result.decisions
        assert recorded[d.request_id] == d
        assert model.index(row, BACKEND_COLUMN).data() == d.backend
        for b in model.backends:
            s = d.score_of(b)
            for term in TERMS:
                assert model.index(row, model.column_of(b, term)).data() == score_term(s, term)
            bg = model.index(row, model.column_of(b, "score")).data(Qt.BackgroundRole)
            assert (bg is not None) == (b == d.backend)  # only the chosen backend is highlighted
    # Cached tokens are the warmed prefix the router saw.
    assert all(d.chosen.cached_tokens == 64 for d in model.decisions)

    view.select_row(3)
    d = model.decisions[3]
    text = view.explain.toPlainText()
    assert text.startswith("#4 → ") and d.request_id not in text  # named as the table names it
    assert d.reason in text
    assert f"{d.chosen.score_s:.3f} s" in text
    tick(qtbot, w)
    x, _y = view.curves["cpu0"].getData()
    assert list(x) == list(range(1, SMALL.n_requests + 1))  # one point per row, by row number
    assert len(view.marks.data) == SMALL.n_requests


def test_the_live_panels_update_during_a_run(qtbot, make_window, ui_engine):
    w = make_window()
    latency = w.panels["latency"]
    cards = w.panels["backends"].cards
    tick(qtbot, w)
    before = {n: c.hit_label.text() for n, c in cards.items()}
    hits_before = {s.name: s.cache.hit_tokens for s in ui_engine.snapshot()}
    result = run_workload(qtbot, w)
    tick(qtbot, w)
    done = {b: 0 for b in ui_engine.backends}
    for r in result.records.values():
        done[r.backend] += 1
    for b, n in done.items():
        for metric in ("ttft", "e2e", "itl"):
            x, y = latency.hist_curves[metric][b].getData()
            assert y.sum() == n  # every finished request is in exactly one bin
        if n:
            p50_line, p95_line = latency.p_lines["ttft"][b]
            p50, p95 = latency.store.percentiles("ttft", b)
            assert p50_line.isVisible() and math.isclose(p50_line.value(), math.log10(p50))
            assert math.isclose(p95_line.value(), math.log10(p95))
        assert f"{b}</b> {n} done" in latency.summary.text()
    for snap in ui_engine.snapshot():
        card = cards[snap.name]
        assert card.hit_label.text() != before[snap.name]  # warm-ups and requests were counted
        assert f"{snap.cache.hit_rate * 100:.1f} %" in card.hit_label.text()
        if done[snap.name]:  # each request it served hit the warmed prefix
            assert snap.cache.hit_tokens - hits_before[snap.name] == 64 * done[snap.name]
    x, y = latency.tput_curves[-1].getData()
    assert len(x) > 0 and max(y) > 0  # throughput over time saw the decoded tokens
    for b in latency.backends:  # each backend's bars: its slice of every bin, the bin's count
        x, y = latency.hist_curves["ttft"][b].getData()
        assert len(x) == 2 * (len(EDGES["ttft"]) - 1)
        assert list(y[0::2]) == list(latency.store.histogram("ttft", b)) and not y[1::2].any()


def _warmed_card(qtbot, w, ui_engine):
    """cpu1's card after its Warm button cached the chat's system prompt."""
    card = w.panels["backends"].cards["cpu1"]
    card.warm()  # the chat's system prompt
    qtbot.waitUntil(lambda: ui_engine.backend("cpu1").snapshot().cache.cached_tokens > 0, timeout=WAIT_MS)
    return card


def test_a_cards_warm_button_fills_its_cache(qtbot, make_window, ui_engine):
    w = make_window()
    card = _warmed_card(qtbot, w, ui_engine)
    tick(qtbot, w)
    assert not card.cache_label.text().startswith("0 cached")


def test_a_card_shows_the_prompt_tokens_asked_for_again_after_their_eviction(make_window, ui_engine):
    card = make_window().panels["backends"].cards["cpu1"]
    snap = ui_engine.backend("cpu1").snapshot()
    card.update_snapshot(replace(snap, cache=replace(snap.cache, evictions=3, lost_tokens=1234)), time.monotonic())
    assert "3 evicted, 1,234 tok asked for again" in card.cache_label.text()


def test_a_cards_flush_button_empties_its_cache(qtbot, make_window, ui_engine):
    card = _warmed_card(qtbot, make_window(), ui_engine)
    card.flush()
    qtbot.waitUntil(lambda: ui_engine.backend("cpu1").snapshot().cache.cached_tokens == 0, timeout=WAIT_MS)


def test_a_failed_backend_card_restarts_it(qtbot, spare_engine, make_window):
    eng = spare_engine  # its own engine: the shared one is never broken (see ui_fixtures)
    w = make_window(engine=eng)
    card = w.panels["backends"].cards["cpu0"]
    tick(qtbot, w)
    assert card.health.text() == "● healthy" and card.problem.isHidden()
    tokens = tuple(eng.model.tokenize("a request that meets a crash"))
    sampling = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    eng.backends["cpu0"].inject_fault("crash")  # fires at the next step: this request's
    record = eng.submit(Request(tokens, sampling, backend="cpu0")).result(WAIT_MS / 1000)
    assert record.error and "injected" in record.error
    qtbot.waitUntil(lambda: card.health.text() == "● failed" and not card.problem.isHidden(), timeout=WAIT_MS)
    assert card.error_label.text() == eng.backends["cpu0"].error and "injected" in card.error_label.text()
    assert "#ff6b6b" in card.error_label.styleSheet()
    assert card.restart_button.isEnabled() and not card.restart_button.isHidden()
    assert w.panels["backends"].cards["cpu1"].problem.isHidden()  # the other backend is fine

    messages = []
    card.status_message.connect(messages.append)
    qtbot.mouseClick(card.restart_button, Qt.LeftButton)
    assert card.restarting or messages[-1].endswith("restarted with a fresh context")
    qtbot.waitUntil(lambda: card.health.text() == "● healthy" and card.problem.isHidden(), timeout=WAIT_MS)
    assert messages[0] == "cpu0: restarting" and messages[-1] == "cpu0: restarted with a fresh context"
    assert card.restart_button.text() == "Restart"

    record = eng.submit(Request(tokens, sampling, backend="cpu0")).result(WAIT_MS / 1000)
    assert record.error is None and record.backend == "cpu0" and record.status == RequestStatus.FINISHED_LENGTH


def test_cache_checkbox_switches_the_prefix_cache_live(qtbot, make_window, ui_engine):
    w = make_window()
    check = w.panels["controls"].cache_checks["cpu1"]
    b = ui_engine.backend("cpu1")
    assert check.isEnabled() and check.isChecked()
    try:
        check.setChecked(False)
        qtbot.waitUntil(lambda: not b.snapshot().cache.enabled, timeout=10_000)
        assert b.match(Request(tuple(list(range(10, 40))))) == 0
        tick(qtbot, w)
        assert not check.isChecked()
    finally:
        check.setChecked(True)
        qtbot.waitUntil(lambda: b.snapshot().cache.enabled, timeout=10_000)


def test_cards_flag_placeholder_rates(qtbot, make_window, ui_engine):
    w = make_window()
    card = w.panels["backends"].cards["cpu0"]
    ui_engine.backend("cpu0").set_rates(Rates(400.0, 40.0, source="default"))
    tick(qtbot, w)
    assert card.rates_source_label.text() == "⚠ placeholder rates, not measured"
    assert WORKING in card.rates_source_label.styleSheet()
    assert "not measured" in card.rates_source_label.toolTip()
    assert card.rates_label.text() == "prefill 400 tok/s · decode 40.0 tok/s"


def test_cards_say_rates_were_measured_at_load(qtbot, make_window, ui_engine):
    w = make_window()
    card = w.panels["backends"].cards["cpu0"]
    ui_engine.backend("cpu0").set_rates(Rates(1234.5678, 76.2413, source="measured",
                                              measured_at="2026-12-01T03:27:53+00:00"))
    tick(qtbot, w)
    assert card.rates_source_label.text() == "rates: measured at load"
    assert WORKING not in card.rates_source_label.styleSheet()
    assert card.rates_label.text() == "prefill 1,235 tok/s · decode 76.2 tok/s"


def test_cards_say_when_cached_rates_were_measured(qtbot, make_window, ui_engine):
    w = make_window()
    card = w.panels["backends"].cards["cpu0"]
    ui_engine.backend("cpu0").set_rates(Rates(120.0, 50.0, source="cached", measured_at="2026-11-30T21:04:00+00:00"))
    tick(qtbot, w)
    assert card.rates_source_label.text() == "rates: cached 2026-11-30"
    assert "earlier start" in card.rates_source_label.toolTip()


def test_routing_rows_export_as_csv(qtbot, make_window, tmp_path):
    import csv

    w = make_window()
    view = w.panels["routing"]
    run_workload(qtbot, w)
    model = view.model
    assert model.index(0, 0).data() == "1" and model.index(0, 1).data() == "0.00 s"
    assert model.index(model.rowCount() - 1, 0).data() == str(model.rowCount())
    assert model.headerData(1, Qt.Horizontal) == "t"
    score = model.index(0, model.column_of("cpu0", "score"))
    float(score.data())  # a bare number: the unit is in the heading
    assert model.headerData(score.column(), Qt.Horizontal).split("\n") == ["cpu0", "score", "s"]
    assert model.headerData(model.column_of("cpu0", "prefill"), Qt.Horizontal).endswith("\ntok")
    assert "tok/s" in score.data(Qt.ToolTipRole)  # the rates it was priced at
    assert model.decisions[0].request_id in model.index(0, 0).data(Qt.ToolTipRole)
    rows = list(csv.DictReader(view.export_csv(tmp_path / "routing.csv").open()))
    assert len(rows) == model.rowCount()
    d = model.decisions[2]
    assert rows[2]["request"] == d.request_id and rows[2]["backend"] == d.backend
    assert float(rows[2]["cpu0_score_s"]) == d.score_of("cpu0").score_s
    view.clear()
    run_workload(qtbot, w)
    assert model.index(0, 0).data() == "1"  # numbering restarts after Clear


def test_every_plot_offers_pyqtgraphs_export_on_right_click(qtbot, make_window):
    import pyqtgraph as pg

    w = make_window()
    plots = [p for panel in w.panels.values() for p in panel.findChildren(pg.PlotWidget)]
    assert len(plots) >= 4
    for pw in plots:
        assert pw.getPlotItem().getViewBox().menuEnabled()
        assert "Export..." in [a.text() for a in pw.scene().contextMenu]


def test_latency_axes_fit_their_data_with_whole_request_counts(qtbot, make_window):
    w = make_window()
    latency = w.panels["latency"]
    p = latency.plots["ttft"]
    (x0, x1), (y0, y1) = p.viewRange()
    assert (x0, x1) == (-3.0, 1.0) and (y0, y1) == (0.0, 2.0)  # idle: 1 ms .. 10 s, not -400..400
    run_workload(qtbot, w)
    tick(qtbot, w)
    ttfts = [v for b in latency.backends for v in latency.store.values("ttft", b)]
    (x0, x1), (y0, y1) = p.viewRange()
    edges = EDGES["ttft"]  # values outside the edges are counted in the first/last bin
    lo, hi = max(min(ttfts), edges[0]), min(max(ttfts), edges[-1])
    assert x0 <= math.log10(lo) and math.log10(hi) <= x1
    hists = [latency.store.histogram("ttft", b) for b in latency.backends]
    assert (x0, x1) == pytest.approx(occupied_log_range(hists, EDGES["ttft"]))  # the bins in use ± 1
    assert x1 - x0 < 4.0  # not the whole 1 ms .. 100 s
    most = max(max(latency.store.histogram("ttft", b)) for b in latency.backends)
    assert most <= y1 <= most * 1.1 + 5 and float(y1).is_integer()
    major = p.getAxis("left")._tickSpacing
    assert major is not None and all(float(s).is_integer() for s, _ in major)


def test_a_backend_sparkline_has_a_legend(make_window):
    card = make_window().panels["backends"].cards["cpu0"]
    assert [label.text for _, label in card.history.legend.items] == ["running", "waiting"]


def test_the_teaching_bars_have_a_legend(make_window):
    teaching = make_window().panels["teaching"].chart.getPlotItem().legend
    assert [label.text for _, label in teaching.items] == ["prefill", "decode"]
