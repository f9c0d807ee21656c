"""Plain words first, numbers on demand; plot furniture a room can read.

- What-if says "sooner" for a shorter makespan and "later" for a longer one (real simulations).
- Errors read as advice: no network for the Hub, a file that is not a GGUF model, an engine that
  does not answer (each raised for real: a name that cannot resolve, a broken file, a port
  nothing listens on), fast, with the raw error on demand, and the chat keeps working.
- The adaptive cap's reasons and the policy read as plain sentences, the figures on demand.
- Change-mark labels lie inside their plot, on nothing else; legend glyphs are bars and lines;
  two backends' equal histogram bins both show; the "total" line stands out on both themes.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from ui_fixtures import UI_MODEL, WAIT_MS, free_port, make_window, qasync_loop, ui_engine  # noqa: F401

# ---- What-if ----


def test_what_if_words_a_makespan_change_as_sooner_or_later():
    from ui.whatif import compare_text

    assert "2.4 % sooner than the first backend alone (9.760 s against 10.000 s)" in compare_text("p", 9.76, 10.0)
    assert "2.4 % later than the first backend alone (10.240 s against 10.000 s)" in compare_text("p", 10.24, 10.0)
    assert "as soon as" in compare_text("p", 10.0, 10.0)
    assert "+" not in compare_text("p", 9.76, 10.0)


def _whatif(w):
    panel = w.panels["teaching"]
    panel.tabs.setCurrentWidget(panel.whatif)
    return panel.whatif


@pytest.mark.parametrize("cpu_speed,word", [("1", "sooner"), ("0.02", "later")])
def test_what_ifs_note_agrees_with_its_rows(qtbot, make_window, cpu_speed, word):
    """The study on the M2 profile: hybrid routing beats the GPU alone; with the CPU really 50x
    slower than the router is told, it loses."""
    panel = _whatif(make_window())
    panel.profile_box.setCurrentText("study-m2")
    panel.n_box.setValue(48)
    cpu = next(i for i in range(panel.table.rowCount()) if panel.table.item(i, 0).text() == "cpu")
    panel.table.item(cpu, 6).setText(cpu_speed)
    with qtbot.waitSignal(panel.simulated, timeout=WAIT_MS):
        panel.simulate_button.click()
    alone = min(r["makespan"] for r in panel.rows if r["policy"].startswith("only:"))
    best = min((r for r in panel.rows if not r["policy"].startswith("only:")), key=lambda r: r["makespan"])
    assert (best["makespan"] < alone) == (word == "sooner")
    change = abs(best["makespan"] / alone - 1) * 100
    assert f"{change:.1f} % {word} than the first backend alone" in panel.note.text()


# ---- errors as advice ----


def test_the_three_raw_errors_read_as_advice():
    from ui.advice import advise

    offline = advise("searching the Hub failed: [Errno -2] Name or service not known", "hub")
    assert offline.text == "You seem to be offline: load a GGUF from disk with File ▸ Load model."
    assert "Errno -2" in offline.detail
    broken = advise("/tmp/x.gguf is not a GGUF file (it starts with b'52\\xc7G', not b'GGUF')", "load")
    assert broken.text.startswith("This file is not a GGUF model")
    dead = advise("http://127.0.0.1:9 is unreachable: ClientConnectorError: Cannot connect to host "
                  "127.0.0.1:9 ssl:default [Connect call failed ('127.0.0.1', 9)]", "engine")
    assert dead.text.startswith("The engine at 127.0.0.1:9 does not answer")
    assert "ssl:default" not in dead.text and "ClientConnectorError" in dead.detail
    other = advise("prompt too long for the context", "engine")
    assert other.text == other.detail == "prompt too long for the context"


def test_the_hub_unreachable_by_name_reads_you_seem_to_be_offline(qtbot, monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    from ui.get_model import GetModelDialog

    monkeypatch.setattr(constants, "ENDPOINT", "http://hub.invalid")  # RFC 6761: never resolves
    dialog = GetModelDialog(n_ctx=2048, folder=tmp_path / "models")
    qtbot.addWidget(dialog)
    dialog.query.setText("tiny")
    t0 = time.monotonic()
    dialog.search()
    qtbot.waitUntil(lambda: "offline" in dialog.state_label.text(), timeout=WAIT_MS)
    assert time.monotonic() - t0 < 10  # said at once, not after the Hub client's retries
    assert "You seem to be offline: load a GGUF from disk with File ▸ Load model." in dialog.state_label.text()
    assert "Errno" not in dialog.state_label.text() and dialog.state_label.toolTip()  # the raw error on demand


def test_a_broken_file_reads_this_file_is_not_a_gguf_model(qtbot, make_window, ui_engine,
                                                                               tmp_path):
    from app.gui import load_engine
    from ui.loader import ModelSpec

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"52\xc7G" + bytes(4096))
    w = make_window(load_fn=load_engine)
    failed: list = []
    w.load_failed.connect(failed.append)
    assert w.load_model(ModelSpec(str(broken)))
    qtbot.waitUntil(lambda: bool(failed), timeout=WAIT_MS)
    assert w.error_dialog.informativeText().startswith("This file is not a GGUF model")
    assert "b'52" in w.error_dialog.detailedText()  # the raw error, one click away
    assert w.engine is ui_engine  # the engine shown keeps serving: the chat goes on
    chat = w.panels["chat"]
    chat.max_tokens.setValue(4)
    assert chat.send("hello")
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)
    w.error_dialog.close()


@pytest.fixture
def dead_engine():
    """A CPU backend beside a remote one at a port nothing listens on."""
    from engine.backends.config import parse_backend_specs
    from engine.engine import Engine

    port = free_port()
    eng = Engine.load(UI_MODEL, parse_backend_specs(["cpu:threads=1,cap=2,ctx=512",
                                                     f"remote:url=http://127.0.0.1:{port},name=far"]))
    yield eng, port
    eng.close()


def test_a_dead_engine_reads_as_advice_wherever_it_shows(qtbot, dead_engine, make_window):
    eng, port = dead_engine
    w = make_window(engine=eng)
    card = w.panels["backends"].cards["far"]
    qtbot.waitUntil(lambda: card.problem.isVisibleTo(card) and bool(card.error_label.text()), timeout=WAIT_MS)
    assert card.error_label.text().startswith(f"The engine at 127.0.0.1:{port} does not answer")
    assert "ssl:default" not in card.error_label.text() and str(port) in card.error_label.toolTip()
    chat = w.panels["chat"]
    chat.max_tokens.setValue(4)
    chat.backend_combo.setCurrentText("far")  # Send to: the dead engine
    t0 = time.monotonic()
    assert not chat.send("hello")  # refused at once, in plain words
    assert time.monotonic() - t0 < 2
    notice = chat.transcript_text()
    assert "far is down: send to another backend (Send to: auto)" in notice
    chat.backend_combo.setCurrentText("cpu")
    assert chat.send("hello")  # the chat goes on
    qtbot.waitUntil(lambda: not chat.busy, timeout=WAIT_MS)


# ---- plain words, numbers on demand ----


def test_the_caps_reasons_read_as_plain_sentences_with_the_figures_on_demand():
    from test_limiter import feed

    from engine.sched.limiter import ConcurrencyLimiter
    from ui.formatting import cap_reason_detail, cap_reason_text

    lim = ConcurrencyLimiter(64, initial=16, window=8)
    feed(lim, 16, batch=16, step_s=0.004, waiting=0, running=16)
    feed(lim, 2, batch=16, step_s=0.004, waiting=9, running=16)
    assert cap_reason_text(lim.reason) == "requests were waiting, so it tries more at once"
    feed(lim, 16, batch=24, step_s=0.0061, waiting=0, running=24)  # the same tok/s: the step up stays
    assert "up from" in lim.reason and "tok/s" in lim.reason
    assert cap_reason_text(lim.reason) == "the larger batch was faster, so it stays"

    lim = ConcurrencyLimiter(64, initial=16, window=8)
    feed(lim, 16, batch=16, step_s=0.004, waiting=0, running=16)
    feed(lim, 2, batch=16, step_s=0.004, waiting=9, running=16)
    feed(lim, 16, batch=24, step_s=0.012, waiting=9)  # slower: taken back
    assert cap_reason_text(lim.reason) == "the larger batch was slower, so it went back down"
    assert lim.kv_full(running=5) and cap_reason_text(lim.reason) == "the memory was full, so it runs fewer at once"

    class Snap:  # the fields of a BackendSnapshot the tooltip reads
        cap_adaptive = True
        cap_reason = lim.reason

    assert lim.reason in cap_reason_detail(Snap())  # the engine's own words, one hover away


def test_the_policy_reads_as_one_sentence_with_the_details_behind_a_link(qtbot, make_window, ui_engine):
    from engine.routing import HELP

    c = make_window().panels["controls"]
    c.policy_combo.setCurrentText("finish-first:pack")
    assert c.policy_help.text() == "Each request goes to the backend where it will finish first (the default)."
    assert c.details.isHidden() and HELP["finish-first:pack"] in c.details.text()
    c.details_link.linkActivated.emit("#details")
    assert not c.details.isHidden() and "Hide" in c.details_link.text()
    c.policy_combo.setCurrentText("round-robin")
    assert c.policy_help.text() == "The backends take turns: one request each."


def test_one_backend_reads_every_request_goes_to_it(qtbot, make_window):
    from ui_fixtures import ONE_CPU, load_and_wait

    from app.gui import load_engine

    w = make_window(engine=None, load_fn=load_engine)
    load_and_wait(qtbot, w, ONE_CPU)
    assert w.panels["controls"].policy_help.text().startswith("With one backend, every request goes to it")


# ---- plot furniture ----


def test_change_labels_stay_inside_their_plot_off_everything_else(qtbot):
    import pyqtgraph as pg

    from ui.legend import add_legend
    from ui.plot_marks import ChangeMarks

    pw = pg.PlotWidget()
    qtbot.addWidget(pw)
    pw.resize(500, 300)
    pw.show()
    qtbot.waitExposed(pw)
    p = pw.getPlotItem()
    add_legend(p, offset=(8, 8)).addItem(p.plot([0, 100], [0, 1], pen="w"), "a curve")
    p.setXRange(0, 100, padding=0)
    marks = ChangeMarks(p)
    for x in (0.5, 2, 3, 50, 51, 99.5):  # at both edges, and close pairs
        marks.add(x, [f"cpu0 ceiling {int(x)}→{int(x) + 1}", "policy → round-robin"])
    qtbot.wait(50)
    shown = marks.label_items()
    assert shown  # some say what changed; the others in their line's tooltip
    vb = p.vb.sceneBoundingRect().adjusted(-1, -1, 1, 1)
    rects = [lab.sceneBoundingRect() for lab in shown]
    assert all(vb.contains(r) for r in rects)
    assert not any(a.intersects(b) for i, a in enumerate(rects) for b in rects[i + 1:])
    legend = p.legend.sceneBoundingRect()
    assert not any(r.intersects(legend) for r in rects)
    assert len(marks.texts()) == 6 and all("; policy → round-robin" in t for t in marks.texts())


def _sample_image(item):
    from PySide6.QtGui import QImage, QPainter

    from ui.legend import Glyph

    glyph = Glyph(item)
    image = QImage(20, 20, QImage.Format.Format_ARGB32)
    image.fill(0)
    painter = QPainter(image)
    glyph.paint(painter)
    painter.end()
    return image


def test_legend_glyphs_look_like_what_they_stand_for(qapp):
    import pyqtgraph as pg
    from PySide6.QtGui import QColor

    hist = pg.PlotDataItem([1, 2, 3], [1, 2], stepMode="center", fillLevel=0, brush=QColor(255, 0, 0, 255),
                           pen=pg.mkPen("r"))
    image = _sample_image(hist)
    assert image.pixelColor(6, 7).alpha() > 0 and image.pixelColor(14, 14).alpha() > 0  # a bar, not a triangle
    line = pg.PlotDataItem([0, 1], [0, 1], pen=pg.mkPen("b", width=2))
    image = _sample_image(line)
    assert image.pixelColor(10, 10).alpha() > 0  # across the middle
    assert image.pixelColor(10, 3).alpha() == 0 and image.pixelColor(10, 17).alpha() == 0  # nothing else


def test_equal_bins_of_two_backends_stand_side_by_side():
    from ui.axes import dodged_steps
    from ui.live_stats import EDGES

    edges = EDGES["ttft"]
    counts = np.zeros(len(edges) - 1)
    counts[[10, 11, 30]] = (3, 1, 2)
    bars = []
    for k in range(2):
        x, y = dodged_steps(edges, counts, k, 2)
        assert len(x) == len(y) + 1 and y.sum() == counts.sum() and list(y[0::2]) == list(counts)
        bars.append([(x[2 * i], x[2 * i + 1]) for i in np.flatnonzero(counts)])
    for (a0, a1), (b0, b1) in zip(*bars):  # the same bin: next to each other, not on each other
        assert a1 <= b0 and a0 < a1 and b0 < b1


def _contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two colours."""
    from PySide6.QtGui import QColor

    def lum(c: QColor) -> float:
        def ch(v: float) -> float:
            return v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4
        return 0.2126 * ch(c.redF()) + 0.7152 * ch(c.greenF()) + 0.0722 * ch(c.blueF())

    hi, lo = sorted((lum(QColor(a)), lum(QColor(b))), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_the_dashed_lines_stand_out_on_both_themes(make_window):
    from ui.theme import palette

    w = make_window()
    latency = w.panels["latency"]
    card = w.panels["backends"].cards["cpu0"]
    for theme in ("light", "dark"):
        w.set_theme(theme)
        bg = palette().plot_bg
        assert _contrast(latency.tput_curves[-1].opts["pen"].color().name(), bg) >= 4.5, theme
        assert _contrast(card.waiting_curve.opts["pen"].color().name(), bg) >= 3.0, theme


def test_time_ticks_thin_until_their_labels_stand_apart_inside_the_axis():
    from ui.axes import log_ticks, thin_ticks

    def width(label: str) -> float:
        return 8.0 * len(label)  # 8 px a character

    lo, hi = -2.5, 0.8  # 3 ms .. 6.3 s: 1-2-5 ticks would crowd; decades only (log_ticks)
    ticks = log_ticks(lo, hi)
    wide = thin_ticks(ticks, lo, hi, 600, width)
    assert [t for _x, t in wide] == ["10 ms", "100 ms", "1 s"]
    narrow = thin_ticks(ticks, lo, hi, 90, width)
    assert len(narrow) == 1  # no room for two: one, not none
    lo, hi = -3.3, -2.05  # 0.5 ms .. 8.9 ms: 1-2-5 ticks
    ticks = log_ticks(lo, hi)
    for px in (120, 320, 900):
        shown = thin_ticks(ticks, lo, hi, px, width)
        spans = [((x - lo) / (hi - lo) * px - width(t) / 2, (x - lo) / (hi - lo) * px + width(t) / 2) for x, t in shown]
        assert shown and all(a >= 0 and b <= px for a, b in spans)  # inside: pyqtgraph draws them all
        assert all(spans[k + 1][0] - spans[k][1] >= 10 for k in range(len(spans) - 1))
    assert len(thin_ticks(ticks, lo, hi, 900, width)) > len(thin_ticks(ticks, lo, hi, 120, width))


def test_a_narrow_time_range_still_gets_labelled_ticks():
    import math

    from ui.axes import log_ticks

    assert [t for _x, t in log_ticks(math.log10(0.28), math.log10(0.45))] == ["300 ms", "400 ms"]
