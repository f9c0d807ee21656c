"""`tandem bench chat`: the workload is deterministic, the metrics are right on hand-made records,
and real runs (the engine in-process over HTTP, a `tandem serve` as a --target) carry each
conversation forward so later turns hit the prefix cache."""

from __future__ import annotations

import json

import pytest
from servers import Server

from app.cli import main
from bench import report as bench_report
from bench.chat import WORDS, ChatSpec, build_chat, parse_range, summarize, ttft_split, turn_table
from bench.simulate import replay
from engine.core.errors import InvalidRequest
from engine.sim.benchmark import RequestRecord
from engine.sim.workload import RecordedTurn, conversation_workload

# ---- the workload ----


def test_a_seed_with_a_run_gives_the_same_conversations_every_time():
    spec = ChatSpec(conversations=5, turns=3, seed=7)
    assert build_chat(spec, 0) == build_chat(spec, 0)


def test_each_run_gets_text_of_its_own():
    spec = ChatSpec(conversations=2, turns=2)
    a, b = build_chat(spec, 0), build_chat(spec, 1)
    assert a.system != b.system
    assert a.conversations[0].turns[0].user != b.conversations[0].turns[0].user


def test_turns_have_the_asked_shape():
    spec = ChatSpec(conversations=20, turns=4, system_words=600, user_words=(40, 120), reply_tokens=(32, 192),
                    think_s=1.0)
    wl = build_chat(spec, 0)
    assert len(wl.system.split()) == 600
    assert set(w.strip(".").lower() for w in wl.system.split()) <= set(WORDS)
    for c in wl.conversations:
        assert len(c.turns) == 4
        assert c.turns[0].think_s == 0
        for t in c.turns:
            assert 40 <= len(t.user.split()) <= 120
            assert 32 <= t.reply_tokens <= 192
        assert all(t.think_s > 0 for t in c.turns[1:])


def test_conversations_start_as_a_poisson_stream_at_the_rate():
    wl = build_chat(ChatSpec(conversations=2000, turns=1, rate=6.0, system_words=0, user_words=(1, 1)), 0)
    starts = [c.start_s for c in wl.conversations]
    assert starts[0] == 0 and starts == sorted(starts)
    assert (len(starts) - 1) / starts[-1] == pytest.approx(6.0, rel=0.1)


@pytest.mark.parametrize("text,expected", [("40-120", (40, 120)), ("64", (64, 64))])
def test_a_range_is_n_or_low_high(text, expected):
    assert parse_range(text, "--user-words") == expected


@pytest.mark.parametrize("text", ["0-4", "9-3", "a-b", ""])
def test_a_bad_range_is_refused_with_its_flag(text):
    with pytest.raises(InvalidRequest, match="--reply-tokens"):
        parse_range(text, "--reply-tokens")


# ---- metrics on hand-made records ----


def _rec(conv, turn, *, prompt=100, cached=0, ttft=0.1, ok=True, run=0, policy="p", turns=3):
    return RequestRecord(workload="w", policy=policy, run=run, requests=3 * turns, index=conv * turns + turn - 1,
                         request_id=f"{conv}-{turn}", backend="b", success=ok, finish_reason="length" if ok else "error",
                         prompt_tokens=prompt, cached_tokens=cached, output_tokens=10 if ok else 0,
                         t_submit_s=float(conv + turn), queue_s=None, ttft_s=ttft if ok else None,
                         e2e_s=0.5 if ok else None, itl_s=None, error=None if ok else "boom")


def test_turn_table_gives_each_turns_cached_share():
    recs = [_rec(0, 1, prompt=100, cached=0), _rec(1, 1, prompt=100, cached=60),
            _rec(0, 2, prompt=200, cached=180), _rec(1, 2, prompt=300, cached=270),
            _rec(0, 3, ok=False)]
    table = turn_table(recs, 3)
    assert [t["turn"] for t in table] == [1, 2, 3]
    assert table[0]["cached_share"] == pytest.approx(60 / 200)
    assert table[1]["cached_share"] == pytest.approx(450 / 500)
    assert (table[2]["completed"], table[2]["failed"], table[2]["cached_share"]) == (0, 1, None)


def test_a_server_that_reports_no_cached_tokens_has_no_cached_share():
    table = turn_table([_rec(0, 1, cached=-1), _rec(0, 2, cached=-1)], 3)
    assert table[1]["cached_share"] is None and table[1]["cached_tokens"] is None


def test_ttft_splits_first_turns_from_later_ones():
    recs = [_rec(0, 1, ttft=1.0), _rec(1, 1, ttft=3.0), _rec(0, 2, ttft=0.1), _rec(0, 3, ttft=0.3)]
    split = ttft_split(recs, 3)
    assert split["first_ttft_p50_s"] == pytest.approx(2.0)
    assert split["later_ttft_p50_s"] == pytest.approx(0.2)


def test_summary_rows_are_per_label_with_errors_counted():
    spec = ChatSpec(conversations=2, turns=3)
    recs = [_rec(c, t, policy=p, turns=3) for p in ("x", "y") for c in range(2) for t in (1, 2, 3)]
    recs[-1] = _rec(1, 3, policy="y", ok=False)
    rows = summarize(recs, spec)
    assert [r["policy"] for r in rows] == ["x", "y"]
    assert (rows[0]["failed"], rows[1]["failed"]) == (0, 1)
    assert rows[1]["errors"] == {"boom": 1}
    assert rows[0]["later_ttft_p50_s"]["mean"] == pytest.approx(0.1)


# ---- real runs ----

SMALL = ["--rate", "20", "--think", "0.05", "--system-words", "300", "--user-words", "8-16",
         "--reply-tokens", "8-16", "--no-plots"]


def _summary(path):
    return json.loads((path / "summary.json").read_text())


def test_later_turns_find_their_conversation_in_the_cache_in_process(tmp_path):
    # SmolLM2 behind the real HTTP server in this process; each turn re-sends the replies as written
    rc = main(["bench", "chat", "--model", "default", "--backend", "cpu:threads=2,cap=4", "--no-calibrate",
               "--conversations", "3", "--turns", "3", *SMALL, "--out", str(tmp_path)])
    assert rc == 0
    summary = _summary(tmp_path)
    (row,) = summary["results"]
    assert row["policy"] == "in-process" and row["failed"] == 0 and row["completed"] == 9
    for t in row["turns"][1:]:
        assert t["cached_share"] >= 0.8, row["turns"]
    records = bench_report.read_records(tmp_path / "requests.csv")
    assert len(records) == 9 and all(r.cached_tokens >= 0 for r in records)


@pytest.fixture(scope="module")
def tiny_server(tiny_path):
    server = Server("--model", "synthetic:tiny", "--backend", "cpu:threads=1,cap=8", "--no-calibrate")
    try:
        yield server.wait_healthy()
    finally:
        server.close()


def test_a_target_runs_the_workload_with_replies_of_the_asked_length(tiny_server, tmp_path):
    rc = main(["bench", "chat", "--target", f"tiny={tiny_server.url}", "--conversations", "3", "--turns", "2",
               *SMALL, "--out", str(tmp_path)])
    assert rc == 0
    records = bench_report.read_records(tmp_path / "requests.csv")
    wl = build_chat(ChatSpec(conversations=3, turns=2, rate=20, think_s=0.05, system_words=300,
                             user_words=(8, 16), reply_tokens=(8, 16)), 0)
    asked = {c.index * 2 + k: t.reply_tokens for c in wl.conversations for k, t in enumerate(c.turns)}
    assert {r.index: r.output_tokens for r in records} == asked  # ignore_eos: noise text, exact lengths
    assert {r.policy for r in records} == {"tiny"}
    assert (tmp_path / "results.md").read_text().count("| tiny |") == 1
    # a Tandem target says where each turn went and why (its /v1/routing)
    decisions = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert len(decisions) == 6 and {(d["target"], d["policy"]) for d in decisions} == {("tiny", "finish-first:pack")}
    assert all(d["backend"] == "cpu" and d["reason"] for d in decisions), decisions[0]


def test_a_refused_turn_ends_its_conversation_leaving_failed_records(tiny_server, tmp_path):
    rc = main(["bench", "chat", "--target", tiny_server.url, "--target-model", "no-such-model",
               "--conversations", "2", "--turns", "3", *SMALL, "--out", str(tmp_path)])
    assert rc == 1
    records = sorted(bench_report.read_records(tmp_path / "requests.csv"), key=lambda r: r.index)
    assert len(records) == 6 and not any(r.success for r in records)
    assert records[0].error.startswith("HTTP 4")
    assert records[1].error == "not sent: turn 1 of this conversation failed"


def test_turns_past_the_time_limit_are_recorded_as_failures(tiny_server, tmp_path):
    limit = 1.0
    args = ["--conversations", "6", "--turns", "2", "--rate", "0.5", "--think", "0.05", "--system-words", "20",
            "--user-words", "4", "--reply-tokens", "4", "--no-plots"]
    rc = main(["bench", "chat", "--target", tiny_server.url, *args, "--time-limit", str(limit),
               "--out", str(tmp_path)])
    assert rc == 1
    wl = build_chat(ChatSpec(conversations=6, turns=2, rate=0.5, think_s=0.05, system_words=20, user_words=(4, 4),
                             reply_tokens=(4, 4)), 0)
    late = [c.index for c in wl.conversations if c.start_s > limit + 0.5]
    assert late  # the seed gives conversations that start after the limit
    records = {r.index: r for r in bench_report.read_records(tmp_path / "requests.csv")}
    assert len(records) == 12
    for c in late:
        for k in range(2):
            assert records[c * 2 + k].error == f"not sent within the time limit of {limit:g} s"
            assert records[c * 2 + k].t_submit_s == limit


def test_a_chat_run_against_a_target_only_has_nothing_to_replay(tiny_server, tmp_path, capsys):
    rc = main(["bench", "chat", "--target", tiny_server.url, "--conversations", "1", "--turns", "2", *SMALL,
               "--out", str(tmp_path)])
    assert rc == 0
    assert replay(tmp_path) == []
    assert main(["simulate", "--replay", str(tmp_path)]) == 2
    assert "no engine rows to predict" in capsys.readouterr().err


def test_an_in_process_chat_run_is_replayed_turn_by_turn(tmp_path):
    rc = main(["bench", "chat", "--model", "synthetic:tiny", "--backend", "cpu:threads=1,cap=4,contexts=2",
               "--conversations", "4", "--turns", "3", *SMALL, "--out", str(tmp_path)])
    assert rc == 0
    assert _summary(tmp_path)["engine_policy"] == "default"
    (row,) = replay(tmp_path)
    assert row["policy"] == "in-process" and row["requests"] == 12
    assert sum(row["routed_predicted"].values()) == 12  # every turn simulated, on the run's two contexts
    assert set(row["routed_predicted"]) <= {"cpu-a", "cpu-b"}
    # the simulator's caches keep conversations as the engine's did: later turns mostly cached
    assert row["cached_share"]["predicted"] > 0.6, row["cached_share"]
    assert row["cached_share"]["measured"] > 0.6, row["cached_share"]


def test_a_recorded_conversation_becomes_prompts_that_extend_each_other():
    turns = [RecordedTurn(c, k, c * 3 + k, 0.1 * (c * 3 + k), 200 + 150 * k, 20, 20) for c in range(2) for k in range(3)]
    wl = conversation_workload("chat", 0, 120, turns, reply_token=300)
    prompt = {r.index: r.prompt for r in wl.requests}
    assert [len(prompt[i]) for i in range(3)] == [200, 350, 500]
    for c in range(2):
        for k in (1, 2):
            earlier, now = prompt[c * 3 + k - 1], prompt[c * 3 + k]
            assert now[:len(earlier) + 20] == earlier + (300,) * 20  # the previous turn and its reply
    assert prompt[0][:120] == prompt[3][:120] and prompt[0][120] != prompt[3][120]  # only the system prompt shared
    assert [r.arrival_s for r in wl.requests] == sorted(r.arrival_s for r in wl.requests)


def test_cached_tokens_come_from_llama_servers_timings_where_usage_has_none():
    # the final chunk's shape of llama-server's streamed chat (timings, usage without details)
    import asyncio

    import aiohttp
    from aiohttp import web

    from bench.chat import ChatTarget, send_turn

    async def chat(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in ({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                       "usage": {"completion_tokens": 1, "prompt_tokens": 40, "total_tokens": 41},
                       "timings": {"cache_n": 30, "prompt_n": 10}}):
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def run():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                return await send_turn(session, ChatTarget(f"http://127.0.0.1:{port}", "t"),
                                       [{"role": "user", "content": "x"}], 4)
        finally:
            await runner.cleanup()

    out = asyncio.run(run())
    assert (out["text"], out["prompt_tokens"], out["cached"], out["error"]) == ("hi", 40, 30, None)
