"""UI logic tested without any widget: live statistics, formatting, plot axes, chat history, what
changed between ticks (the teaching replay's numbers: tests/test_teaching.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

import engine.llama  # noqa: F401  (llama.cpp before numpy)
from engine.core.request import FinishRecord, RequestStatus
from ui.model.changes import ChangeTracker, is_engines_own
from ui.model.formatting import fmt_seconds
from ui.model.history import Chat, ChatStore, Message
from ui.model.live_stats import EDGES, LatencyStore, RingSeries, percentile, step_histogram, summarize


def record(backend="cpu0", ttft=0.1, e2e=1.0, itl=0.01, out=10, error=None, rid="r"):
    status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_LENGTH
    return FinishRecord(rid, backend, status, "x", 20, 0, out, 0.0, ttft, e2e, itl, error)


class TestStepHistogram:
    @pytest.mark.parametrize("values, expect_total", [([], 0), ([0.01, 0.02, 0.5], 3), ([1e-9, 1e9], 2)])
    def test_counts_every_finite_value_once(self, values, expect_total):
        counts = step_histogram(values + [math.nan, math.inf], EDGES["ttft"])
        assert counts.sum() == expect_total
        assert len(counts) == len(EDGES["ttft"]) - 1  # stepMode="center" needs len(x) = len(y) + 1

    def test_out_of_range_values_land_in_the_end_bins(self):
        counts = step_histogram([1e-9, 1e9], EDGES["ttft"])
        assert counts[0] == 1 and counts[-1] == 1

    def test_percentile_matches_numpy(self):
        v = [0.3, 0.1, 0.2, 0.9]
        assert percentile(v, 95) == pytest.approx(np.percentile(v, 95))

    def test_percentile_of_nothing_is_nan(self):
        assert math.isnan(percentile([], 50))


class TestLatencyStore:
    def test_keeps_each_backends_successes_apart_from_its_failures(self):
        s = LatencyStore(["cpu0", "cpu1"])
        v0 = s.version
        s.add(record("cpu0", ttft=0.1))
        s.add(record("cpu0", ttft=0.3))
        s.add(record("cpu1", error="boom", ttft=None))
        assert s.version == v0 + 3
        assert list(s.values("ttft", "cpu0")) == [0.1, 0.3]
        assert s.finished == {"cpu0": 2, "cpu1": 0} and s.failed == {"cpu0": 0, "cpu1": 1}
        assert s.histogram("ttft", "cpu0").sum() == 2
        assert s.percentiles("ttft", "cpu0") == pytest.approx((0.2, 0.29))
        s.clear()
        assert s.histogram("ttft", "cpu0").sum() == 0

    def test_single_token_replies_have_no_itl(self):
        s = LatencyStore(["cpu0"])
        s.add(record(itl=None, out=1))
        assert s.values("itl", "cpu0").size == 0 and s.values("e2e", "cpu0").size == 1


def test_ring_series_shifts_once_full():
    r = RingSeries(3, 2)
    for i in range(5):
        r.append(float(i), (i, 10 * i))
    x, y = r.view(1)
    assert list(x) == [2.0, 3.0, 4.0] and list(y) == [20, 30, 40]


def test_summarize_run():
    recs = [record("cpu0", ttft=0.1, e2e=1.0, out=8, rid="a"), record("cpu1", ttft=0.3, e2e=2.0, out=8, rid="b"),
            record("cpu1", error="x", ttft=None, rid="c")]
    m = summarize("#1", "seed-score", recs, 10.0, 12.0).metrics
    assert (m.requests, m.completed, m.failed, m.makespan_s, m.output_tok_s) == (3, 2, 1, 2.0, 8.0)
    assert m.routed == {"cpu0": 1, "cpu1": 2}
    assert m.ttft_p50_s == pytest.approx(0.2)


def test_a_run_summary_exports_the_benchmarks_metrics_under_its_label():
    s = summarize("#1", "seed-score", [record("cpu0", out=8)], 10.0, 12.0)
    d = s.to_dict()
    assert (d["label"], d["policy"], d["requests"]) == ("#1", "seed-score", 1)
    assert {k: d[k] for k in s.metrics.to_dict()} == s.metrics.to_dict()


@pytest.mark.parametrize("s, text", [(0.0123, "12.3 ms"), (3.2, "3.20 s"), (None, "–"), (math.nan, "–")])
def test_fmt_seconds(s, text):
    assert fmt_seconds(s) == text


class TestChatStore:
    @staticmethod
    def _two_saved(store):
        """Chat `a` (a system prompt, a reply with meta), then chat `b`, saved in that order."""
        a = Chat(system="Be brief.", messages=[Message("user", "hello"), Message("assistant", "hi", {"backend": "cpu0"})])
        b = Chat(messages=[Message("user", "second chat")])
        store.save(a)
        store.save(b)
        return a, b

    def test_saved_chats_list_newest_first(self, tmp_path):
        store = ChatStore(tmp_path / "chats")
        a, b = self._two_saved(store)
        assert [c.id for c in store.list()] == [b.id, a.id]  # most recently updated first

    def test_a_saved_chat_loads_back_whole(self, tmp_path):
        store = ChatStore(tmp_path / "chats")
        a, _ = self._two_saved(store)
        back = store.load(a.id)
        assert back.system == "Be brief." and back.messages[1].meta == {"backend": "cpu0"}
        assert back.prompt_messages()[0] == {"role": "system", "content": "Be brief."}
        assert back.title == "hello"

    def test_a_deleted_chat_leaves_the_list(self, tmp_path):
        store = ChatStore(tmp_path / "chats")
        a, b = self._two_saved(store)
        store.delete(a.id)
        assert [c.id for c in store.list()] == [b.id]

    def test_unreadable_files_are_skipped(self, tmp_path):
        store = ChatStore(tmp_path)
        (tmp_path / "broken.json").write_text("{not json")
        store.save(Chat(messages=[Message("user", "ok")]))
        assert len(store.list()) == 1

    def test_empty_system_prompt_is_left_out(self):
        assert Chat(system="  ", messages=[Message("user", "x")]).prompt_messages() == [{"role": "user", "content": "x"}]


def test_log_axis_ticks_are_few_readable_seconds():
    from ui.model.axes import log_ticks

    assert [t for _, t in log_ticks(-1.7, -0.3)] == ["20 ms", "50 ms", "100 ms", "200 ms", "500 ms"]
    assert [t for _, t in log_ticks(-3, 1)] == ["1 ms", "10 ms", "100 ms", "1 s", "10 s"]  # decades when wide


def test_rates_read_as_tokens_per_second():
    from ui.model.formatting import fmt_rate

    assert (fmt_rate(76.2413), fmt_rate(2551.0), fmt_rate(0.0)) == ("76.2 tok/s", "2,551 tok/s", "–")


def test_a_model_is_titled_by_its_file_name():
    from types import SimpleNamespace

    from ui.model.formatting import model_title

    info = SimpleNamespace(path="/m/SmolLM2-135M-Instruct.Q4_1.gguf", name="Smollm2 135M 8k Lc100K Mix1 Ep2")
    assert model_title(info) == "SmolLM2-135M-Instruct.Q4_1"


@pytest.mark.parametrize("score,text", [(9.80951, "9.810"), (161.2634, "161.263"), (1140.4021, "1140.4"),
                                        (123456.7, "123457"), (math.inf, "∞")])
def test_a_routing_score_cell_stays_seven_characters_at_most(score, text):
    from types import SimpleNamespace

    from ui.panels.routing import score_term

    assert score_term(SimpleNamespace(score_s=score), "score") == text and len(text) <= 7


def _snap(name="cpu0", cap=4, ceiling=8, healthy=True):
    return SimpleNamespace(name=name, cap=cap, cap_ceiling=ceiling, healthy=healthy)


class TestChangeTracker:
    @pytest.mark.parametrize("after, policy, changes", [
        (_snap(), "seed-score", []),
        (_snap(ceiling=6), "seed-score", ["cpu0 ceiling 8→6"]),
        (_snap(cap=2), "seed-score", ["cpu0 live cap 4→2"]),
        (_snap(healthy=False), "seed-score", ["cpu0 down"]),
        (_snap(), "cache-aware", ["policy → cache-aware"]),
        (_snap(name="cpu1", cap=1), "seed-score", []),  # a backend it has not seen before
    ])
    def test_says_what_changed_since_the_last_tick(self, after, policy, changes):
        tracker = ChangeTracker()
        assert tracker.update([_snap()], "seed-score") == []  # the first tick: nothing to compare
        assert tracker.update([after], policy) == changes

    def test_a_backend_back_up_is_said_once(self):
        tracker = ChangeTracker()
        tracker.update([_snap(healthy=False)], "p")
        assert tracker.update([_snap()], "p") == ["cpu0 healthy again"]
        assert tracker.update([_snap()], "p") == []

    @pytest.mark.parametrize("change, own", [("cpu0 live cap 4→2", True), ("cpu0 ceiling 8→6", False),
                                             ("policy → cache-aware", False), ("cpu0 down", False)])
    def test_only_an_adaptive_cap_moving_is_the_engines_own(self, change, own):
        assert is_engines_own(change) is own
