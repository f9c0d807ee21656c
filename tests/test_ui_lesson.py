"""A lesson in the window (ui.lesson_control, ui.lesson_bar, ui.lesson): arrivals that keep coming
until Stop, Pause and Step from the bar and the Run menu, a ceiling lowered in the bar deciding the
next routed request and marked on the plots, a lesson's own routing table, and a lesson load that
warms the prefix before the first arrival.

The lessons run a small mix (a 32-token prefix, short replies) on the shared two-backend engine.
Where a state must hold still, a backend's worker is held inside a step (`StepGate`), or the
lesson is paused and stepped, so what is sent depends on the steps alone."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from ui_fixtures import UI_MODEL, WAIT_MS, StepGate, make_window, qasync_loop, ui_engine  # noqa: F401

from engine.core.request import Request, SamplingParams
from engine.core.snapshot import Rates
from engine.lesson import Kind, LessonMix, warm
from engine.routing import DEFAULT_POLICY
from engine.sim.arrivals import MAX_RATE
from ui.lesson import Progress, lesson_hint
from ui.lesson_bar import next_rate

SMALL = LessonMix(prefix_tokens=32, kinds=(Kind("short", 4, 4, 1.0), Kind("long", 4, 24, 1.0)))
MEASURED = Rates(prefill_tok_s=134.0, decode_tok_s=97.0, step_alpha_s=0.013, step_beta_s=0.0094, source="override")


def lesson_window(make_window, engine, rate: float = MAX_RATE):
    w = make_window()
    w.lessons.mix = replace(SMALL, vocab_size=engine.n_vocab)
    run = w.lessons.start(rate)
    assert run is not None and run.running
    return w, run


def stop_and_drain(qtbot, w, run) -> None:
    w.lessons.stop()
    assert run.state == "stopped"
    qtbot.waitUntil(lambda: all(s.handle is None or s.handle.done for s in run.lesson.sent), timeout=WAIT_MS)


def test_a_lessons_arrivals_keep_coming_until_stop(qtbot, make_window, ui_engine):
    w, run = lesson_window(make_window, ui_engine)
    bar = w.lessons.bar
    assert w.lessons.toolbar.isVisible() or not w.isVisible()  # shown with the window
    assert bar.start_button.text() == "Stop the lesson"
    qtbot.waitUntil(lambda: run.n_submitted >= 12, timeout=WAIT_MS)  # more than a demo's 8, and on
    assert run.running and run.n_requests is None
    qtbot.waitUntil(lambda: run.n_done >= 3, timeout=WAIT_MS)  # they are served, not just sent
    bar.start_button.click()  # Stop
    assert run.state == "stopped"
    n = run.n_submitted
    qtbot.wait(300)  # six arrivals' worth at this rate
    assert run.n_submitted == n
    assert not w.lessons.running and bar.start_button.text() == "Start a lesson"
    stop_and_drain(qtbot, w, run)


def test_a_lesson_paused_from_the_bar_or_the_run_menu_sends_only_stepped_arrivals(qtbot, make_window, ui_engine):
    w, run = lesson_window(make_window, ui_engine)
    controls = w.lessons.bar.run_controls
    assert controls.run is run and run.n_submitted == 1  # the first arrival at once
    controls.pause_button.click()
    assert run.paused
    qtbot.wait(300)  # six arrivals fall due
    assert run.n_submitted == 1
    controls.step_button.click()
    assert run.n_submitted == 2 and run.paused
    w.step_action.trigger()  # F7 reaches the same lesson
    assert run.n_submitted == 3 and run.paused
    assert "Step (F7)" in w.lessons.bar.hint_label.text()  # paused: the hint says how to go on
    w.pause_action.trigger()  # F6: resume
    assert not run.paused
    qtbot.waitUntil(lambda: run.n_submitted >= 6, timeout=WAIT_MS)
    stop_and_drain(qtbot, w, run)


def test_the_rate_buttons_change_when_the_next_arrival_comes(qtbot, make_window, ui_engine):
    w, run = lesson_window(make_window, ui_engine, rate=0.5)
    bar = w.lessons.bar
    assert run.seconds_to_next() == pytest.approx(2.0, abs=0.3)
    bar.faster.click()
    assert run.rate == next_rate(0.5, up=True)
    assert run.seconds_to_next() < 1.5
    assert bar.rate_label.text() == "one every 1.33 s"
    w.lessons.slower_action.trigger()
    w.lessons.slower_action.trigger()
    assert run.rate == next_rate(0.5, up=False)
    stop_and_drain(qtbot, w, run)


@pytest.fixture
def fixed_caps(ui_engine):
    """Both backends at a fixed cap of 4 (an adaptive live cap may move below its ceiling while
    requests run), adaptive again afterwards as they were."""
    was = {name: b.cap_state().adaptive for name, b in ui_engine.backends.items()}
    for b in ui_engine.backends.values():
        b.set_cap(4, adaptive=False)
    yield
    for name, b in ui_engine.backends.items():
        b.set_cap(4, adaptive=was[name])


def test_a_ceiling_lowered_in_the_bar_decides_the_next_routed_request(qtbot, make_window, ui_engine,
                                                                                        fixed_caps):
    for name in ui_engine.backend_names:  # a CPU's step as measured on this machine: batching pays
        ui_engine.set_rates(name, MEASURED)
    w, run = lesson_window(make_window, ui_engine)
    w.lessons.bar.policy_combo.setCurrentText(DEFAULT_POLICY)  # the policy that prices the live cap
    assert ui_engine.router.policy == DEFAULT_POLICY
    run.pause()
    long_reply = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    mix = w.lessons.mix
    qtbot.waitUntil(lambda: not any(s.items for s in ui_engine.snapshot()), timeout=WAIT_MS)
    # One request running on cpu0, three on cpu1, held there so that the state the router sees
    # holds still: each worker waits in a call while its requests queue, so it takes them all at
    # once and its next step admits them together (their prefix is cached); its gate holds it
    # inside that step. At the
    # ceiling loaded (4) the next arrival goes to cpu0, where fewer run.
    warm(ui_engine, mix)
    release = threading.Event()
    inside = {name: threading.Event() for name in ("cpu0", "cpu1")}
    calls = [ui_engine.backend(name).call(lambda _b, e=e: e.set() or release.wait(WAIT_MS / 1000)) for name, e in inside.items()]
    for e in inside.values():  # each worker is in its call: what is submitted now waits for one take
        assert e.wait(WAIT_MS / 1000)
    held = [ui_engine.submit(Request(mix.request(100 + i).prompt, long_reply, backend=name))
            for i, name in enumerate(("cpu0", "cpu1", "cpu1", "cpu1"))]
    gates = [StepGate(ui_engine.bus, name, after=1) for name in ("cpu0", "cpu1")]
    release.set()
    for c in calls:
        c.result(WAIT_MS / 1000)
    try:
        for g in gates:
            assert g.reached.wait(WAIT_MS / 1000)
        assert [(len(s.running), len(s.waiting)) for s in ui_engine.snapshot()] == [(1, 0), (3, 0)]
        assert run.step()
        before = run.lesson.sent[-1].handle.decision
        assert before.backend == "cpu0" and before.score_of("cpu0").cap == 4
        w.lessons.bar.ceilings["cpu0"].setValue(1)  # the teacher lowers cpu0's ceiling
        assert run.step()
        after = run.lesson.sent[-1].handle.decision
        assert after.score_of("cpu0").cap == 1  # the very next request was routed under it
        assert after.backend == "cpu1", after.reason
    finally:
        for g in gates:
            g.release()
    routing = w.panels["routing"]
    qtbot.waitUntil(lambda: any("cpu0 ceiling 4→1" in t for t in routing.change_marks.texts()), timeout=WAIT_MS)
    assert any("cpu0 ceiling 4→1" in t for t in w.panels["latency"].marks.texts())
    for h in held:
        h.cancel()
    stop_and_drain(qtbot, w, run)
    for h in held:
        h.result(WAIT_MS / 1000)


def test_a_lessons_table_holds_its_own_rows_named_as_the_explanation_names_them(qtbot, make_window, ui_engine):
    w = make_window()
    routing = w.panels["routing"]
    before = ui_engine.submit(Request(tuple(range(300, 340)), SamplingParams(max_tokens=2)))  # a chat's, say
    qtbot.waitUntil(lambda: routing.model.rowCount() == 1, timeout=WAIT_MS)
    before.result(WAIT_MS / 1000)
    w.lessons.mix = replace(SMALL, vocab_size=ui_engine.n_vocab)
    run = w.lessons.start(rate=MAX_RATE)
    run.pause()
    run.step()
    qtbot.waitUntil(lambda: routing.model.rowCount() == run.n_submitted == 2, timeout=WAIT_MS)
    ids = [d.request_id for d in routing.model.decisions]
    assert ids == run.result.request_ids and before.id not in ids
    routing.select_row(1)  # the explanation names the request as the table does
    text = routing.explain.toPlainText()
    assert text.startswith("#2 → ") and ids[1] not in text
    stop_and_drain(qtbot, w, run)


def test_the_hint_moves_on_with_what_the_teacher_did():
    names = ["cpu0", "cpu1"]
    p = Progress(sent=10, paused=False, ceiling_lowered=False, rate_changed=False, policy_changed=False,
                 stepped=False)
    assert lesson_hint(replace(p, sent=1), names).startswith("Each row is one request")
    assert lesson_hint(p, names) == "Lower cpu0's ceiling to 1 and watch the next rows"
    p = replace(p, ceiling_lowered=True)
    assert lesson_hint(p, names).startswith("cpu0 now runs one at a time") and "rate up" in lesson_hint(p, names)
    p = replace(p, rate_changed=True)
    assert "policy" in lesson_hint(p, names)
    p = replace(p, policy_changed=True)
    assert "Step (F7)" in lesson_hint(p, names)
    assert "Step (F7)" in lesson_hint(replace(p, paused=True, stepped=True), names)
    assert "Stop" in lesson_hint(replace(p, stepped=True), names)
    assert "Slow the rate" in lesson_hint(replace(p, backlog=True), names)


def test_every_hint_fits_the_bar_at_1280x720(qtbot, make_window, ui_engine):
    from itertools import product

    w = make_window(compact=True)
    w.resize(1280, 720)
    w.show()
    qtbot.waitExposed(w)
    w.lessons.mix = replace(SMALL, vocab_size=ui_engine.n_vocab)
    run = w.lessons.start()
    label = w.lessons.bar.hint_label
    qtbot.waitUntil(lambda: label.isVisible() and label.width() > 1000, timeout=WAIT_MS)
    room = label.contentsRect().width()
    metrics = label.fontMetrics()
    assert metrics.height() >= 20  # the large type, not the app's default
    hints = {lesson_hint(Progress(sent, *flags), ui_engine.backend_names)
             for sent, flags in product((0, 10), product((False, True), repeat=6))}
    too_wide = [h for h in hints if metrics.horizontalAdvance(h) > room]
    assert not too_wide, (room, too_wide)
    stop_and_drain(qtbot, w, run)


def test_the_hint_asks_for_a_slower_rate_when_the_queues_outrun_the_backends(qtbot, make_window, ui_engine):
    w, run = lesson_window(make_window, ui_engine, rate=0.1)  # one arrival, the next in 10 s
    release = threading.Event()
    inside = {name: threading.Event() for name in ui_engine.backend_names}
    calls = [ui_engine.backend(name).call(lambda _b, e=e: e.set() or release.wait(WAIT_MS / 1000))
             for name, e in inside.items()]
    for e in inside.values():  # each worker is held: what is submitted now waits
        assert e.wait(WAIT_MS / 1000)
    try:
        queued = [ui_engine.submit(Request(tuple(range(300, 310 + i)), SamplingParams(max_tokens=2)))
                  for i in range(17)]  # more than twice the ceilings (4 + 4) wait
        seen: list = []
        w.bridge.tick.connect(seen.append)
        qtbot.waitUntil(lambda: len(seen) >= 2, timeout=WAIT_MS)
        assert "Slow the rate (−)" in w.lessons.bar.hint_label.text()
    finally:
        release.set()
    for c in calls:
        c.result(WAIT_MS / 1000)
    for h in queued:
        h.result(WAIT_MS / 1000)
    stop_and_drain(qtbot, w, run)


def test_start_a_lesson_on_one_backend_loads_two_when_the_teacher_agrees(qtbot, make_window):
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication, QMessageBox
    from ui_fixtures import load_and_wait

    from app.gui import load_engine

    w = make_window(engine=None, load_fn=load_engine, gpu_offload=False)
    load_and_wait(qtbot, w)  # one CPU backend: nothing to choose between
    asked: list[str] = []

    def answer_yes() -> None:
        box = QApplication.activeModalWidget()
        assert isinstance(box, QMessageBox)
        asked.append(box.text())
        box.button(QMessageBox.StandardButton.Yes).click()

    QTimer.singleShot(0, answer_yes)
    started: list = []
    w.lessons.started.connect(started.append)
    w.lessons.start_action.trigger()  # Run ▸ Start a lesson
    assert asked and "needs two backends" in asked[0]
    qtbot.waitUntil(lambda: bool(started), timeout=WAIT_MS)
    assert len(w.engine.backend_names) == 2 and w.spec.lesson
    stop_and_drain(qtbot, w, started[0])


def test_a_lesson_load_warms_the_prefix_before_the_first_arrival(qtbot, make_window):
    from app.gui import load_engine
    from ui.loader import ModelSpec

    w = make_window(engine=None, load_fn=load_engine)
    started = []
    w.lessons.started.connect(started.append)
    phases = []
    w.loader.phase.connect(phases.append)
    specs = ("cpu:threads=1,cap=2,ctx=2048", "cpu:threads=1,cap=2,ctx=2048")
    assert w.load_model(ModelSpec(UI_MODEL, specs, lesson=True))
    qtbot.waitUntil(lambda: bool(started), timeout=WAIT_MS)
    run = started[0]
    assert phases[-1] == "warming"
    assert run.n_submitted >= 1
    first = run.lesson.sent[0]
    prefix = len(run.lesson.mix.prefix())
    # Every backend held the whole shared prefix when the first request was routed.
    assert [s.cached_tokens for s in first.handle.decision.scores] == [prefix, prefix]
    assert run.lesson.first_arrival_s is not None
    stop_and_drain(qtbot, w, run)


def test_a_demo_after_a_lesson_load_sends_at_once(qtbot, make_window, ui_engine):
    from engine.lesson import warm
    from ui.live_run import seed_workload

    w = make_window()
    warm(ui_engine)  # as a lesson's load leaves it
    run = w.start_demo(seed_workload(2, gen_tokens=4))  # the study's 496-token prefix, the lesson's too
    assert run.state == "running" and run.n_submitted >= 1  # no flush, no warming: sent at once
    qtbot.waitUntil(lambda: not run.running, timeout=WAIT_MS)


def test_an_experiment_after_a_lesson_load_starts_fresh(qtbot, make_window, ui_engine):
    from engine.lesson import warm
    from ui.live_run import WorkloadRun, seed_workload

    w = make_window()
    warm(ui_engine)
    measured = WorkloadRun(ui_engine, w.bridge, seed_workload(2, gen_tokens=4), label="experiment", parent=w)
    phases: list[str] = []
    measured.phase.connect(phases.append)
    measured.start()
    assert phases == ["flushing"]  # a measurement starts from a fresh state, warm prefix or not
    qtbot.waitUntil(lambda: not measured.running, timeout=WAIT_MS)


def test_a_wait_says_how_long_is_left():
    from ui.model.formatting import warm_eta, warm_left_text

    assert warm_eta(496, [124.0, 248.0]) == pytest.approx(4.0)  # the slowest backend decides
    assert warm_left_text(4.0, 1.2) == "about 3 s left"
    assert warm_left_text(4.0, 9.0) == "9 s so far, 4 s expected: the machine is busy"
    assert warm_left_text(0.0, 2.0) == "2 s so far"


def test_an_experiment_says_how_long_its_warming_has_left(qtbot, make_window, ui_engine):
    from engine.experiment import experiment_runner

    w = make_window(bench_runner_factory=experiment_runner)
    ex = w.panels["experiments"]
    ex.n_requests.setValue(2)
    ex.prefix.setValue(32)
    ex.suffix.setValue(4)
    ex.max_tokens.setValue(4)
    gate = threading.Event()
    held = ui_engine.backend("cpu1").call(lambda _b: gate.wait(60))  # the warming waits behind it
    try:
        assert ex.start(["seed-score"])
        run = ex.run_controls.run
        run.pause()  # once warm, the arrivals wait too
        ex._on_tick(None)
        assert ex.phase_label.text().startswith(f"{run.label}: warming the 32-token prefix, ")
        assert " s left" in ex.phase_label.text() or " s so far" in ex.phase_label.text()
    finally:
        gate.set()
        held.result(60)
    qtbot.waitUntil(lambda: run.clock.started, timeout=WAIT_MS)
    ex._on_tick(None)
    assert ex.phase_label.text() == f"{run.label}: 0/2 sent · paused"
    run.resume()
    qtbot.waitUntil(lambda: not ex.running, timeout=WAIT_MS)


def test_tandem_gui_lesson_screenshot_prints_when_the_first_request_came(tmp_path):
    import os
    import re
    import subprocess
    import sys

    from PySide6.QtGui import QImage

    shot = tmp_path / "lesson.png"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "gui", "--model", UI_MODEL, "--lesson", "--presenter", "--panel",
         "routing", "--screenshot", str(shot), "--delay", "3"],
        capture_output=True, text=True, timeout=WAIT_MS / 1000 * 3, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("lesson:")]
    assert len(lines) == 1 and re.fullmatch(r"lesson: first arrival \d+\.\d\d s after start", lines[0]), done.stdout
    assert not QImage(str(shot)).isNull()


def test_the_explanation_of_a_request_sent_to_the_higher_score_is_whole(qtbot, make_window, ui_engine):
    from PySide6.QtGui import QTextDocument

    from ui.panels.routing import explain_decision

    make_window()  # the app's palette
    handle = ui_engine.submit(Request(tuple(range(300, 340)), SamplingParams(max_tokens=2)))
    handle.result(WAIT_MS / 1000)
    d = handle.decision
    loser = next(s for s in d.scores if s.name != d.backend)
    turned = replace(d, backend=loser.name,  # as round-robin does: its turn, though its score is higher
                     scores=tuple(replace(s, score_s=s.score_s + 1.0) if s.name == loser.name else s for s in d.scores))
    doc = QTextDocument()
    doc.setHtml(explain_decision(turned, number=7))
    text = doc.toPlainText()
    assert text.startswith(f"#7 → {loser.name}")
    assert "against" in text and "the lower score wins" in text and "Router's record" in text
