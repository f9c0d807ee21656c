"""The scheduler's strategies, without a model: the KV layout (engine/sched/kv_layout.py) and
the cache switch (engine/sched/reuse.py), each answer checked on its own, then the scheduler
driven through split KV (whose streams tests/test_scheduler.py's unified `Memory` cannot model)
and through the null cache."""

from __future__ import annotations

import math

import pytest

from engine.core.request import Request, RequestStatus, SamplingParams
from engine.sched.kv_layout import UNBOUNDED, KvOp, SplitKv, UnifiedKv, kv_layout
from engine.sched.prefix_cache import PrefixCache
from engine.sched.reuse import NULL_CACHE, NullCache, RadixReuse
from engine.sched.scheduler import Scheduler, SchedulerConfig, SeqState


def seq(prompt, *, warm=False, choice=False, seq_id=-1, n_past=0, n_shared=0, **sp) -> SeqState:
    s = SeqState(Request(tuple(prompt), SamplingParams(**sp)), None, None, 0, 0.0, warm=warm, choice=choice)
    s.seq_id, s.n_past, s.n_shared = seq_id, n_past, n_shared
    return s


# ---- the layouts' answers ----

def test_kv_layout_picks_the_strategy():
    assert isinstance(kv_layout(True, 64), UnifiedKv) and kv_layout(True, 64).unified
    assert isinstance(kv_layout(False, 64), SplitKv) and not kv_layout(False, 64).unified


@pytest.mark.parametrize("layout, ops", [
    (UnifiedKv(100), [KvOp("cp", 7, 2, 0, 30)]),  # the same cells, aliased
    (SplitKv(), [KvOp("cp", 7, 2, -1, -1), KvOp("rm", 2, -1, 30, -1)]),  # the stream copied, its tail dropped
])
def test_a_cached_prefix_is_aliased_or_copied(layout, ops):
    assert layout.reuse_prefix(7, 2, 30) == ops


def test_cells_bind_only_in_unified_kv():
    cache = PrefixCache()
    cache.insert(list(range(40)), 9)
    running = [seq(range(60), seq_id=0, n_past=50, n_shared=40), seq(range(10), seq_id=1, n_past=10)]
    unified, split = UnifiedKv(100), SplitKv()
    assert unified.cells_used(cache, running) == 40 + 10 + 10  # the shared 40 once
    assert split.cells_used(cache, running) == 40 + 50 + 10  # every stream holds its whole context
    assert unified.free_cells(cache, 20) == 100 - 40 - 20
    assert split.free_cells(cache, 20) == UNBOUNDED
    assert unified.prefill_owed(running) == 10 and split.prefill_owed(running) == 0
    assert unified.idle_budget(-1, 4) == 25 and unified.idle_budget(8, 4) == 2
    assert split.idle_budget(-1, 4) == UNBOUNDED
    assert unified.cap_room(cache, running, [2, 3], 16) == (100 - 40 - 20 + 40, 10 + 16)
    assert split.cap_room(cache, running, [2, 3], 16) == (2, 1)


def test_split_kv_decodes_rows_in_rising_id_order():
    rows = [seq([1], seq_id=i) for i in (5, 1, 3)]
    UnifiedKv(100).decode_order(rows)
    assert [r.seq_id for r in rows] == [5, 1, 3]
    SplitKv().decode_order(rows)
    assert [r.seq_id for r in rows] == [1, 3, 5]


@pytest.mark.parametrize("warm, expect", [(False, 4), (True, 1)])
def test_unified_kv_prefers_an_id_with_an_idle_sampler_chain(warm, expect):
    free = [1, 4, 6]
    sid = UnifiedKv(100).take_id(free, seq([1], warm=warm), lambda sp: [4, 9])
    assert sid == expect and expect not in free
    assert SplitKv().take_id([1, 4, 6], seq([1]), lambda sp: [4]) == 1  # split: the lowest, always


def test_only_unified_kv_swaps_a_private_copy_for_the_cached_cells():
    assert UnifiedKv(100).share_copy(3, 9, 40) == [KvOp("rm", 3, -1, 0, 40), KvOp("cp", 9, 3, 0, 40)]
    assert SplitKv().share_copy(3, 9, 40) == []


# ---- the cache switch's answers ----

@pytest.mark.parametrize("kind, usable", [
    ({}, 9), ({"warm": True}, 10), ({"prompt_logprobs": True, "logprobs": 0}, 0),
])
def test_the_cache_on_lends_all_but_the_last_prompt_token(kind, usable):
    assert RadixReuse().usable(seq(range(10), **kind)) == usable


@pytest.mark.parametrize("kind, usable", [({}, 0), ({"choice": True}, 9), ({"choice": True, "prompt_logprobs": True, "logprobs": 0}, 0)])
def test_the_null_cache_lends_only_to_a_requests_own_choices(kind, usable):
    assert NullCache().usable(seq(range(10), **kind)) == usable


SWITCHES = [RadixReuse(), RadixReuse(share_prefill=False), RadixReuse(defer_shared=False), NULL_CACHE]


@pytest.mark.parametrize("switch, plain, choice", list(zip(SWITCHES, [True, False, True, False], [True] * 4)))
def test_what_each_switch_publishes(switch, plain, choice):
    """A running prompt is published with the cache on (unless `share_prefill=0`); `n` choices always."""
    assert switch.publishes(seq(range(10))) is plain
    assert switch.publishes(seq(range(10), choice=True)) is choice


@pytest.mark.parametrize("switch, keeps", list(zip(SWITCHES, [True, True, True, False])))
def test_what_each_switch_keeps_of_a_finished_request(switch, keeps):
    assert switch.keeps(seq(range(10))) is keeps


@pytest.mark.parametrize("switch, defers", list(zip(SWITCHES, [True, False, False, False])))
def test_which_switch_defers_a_request_behind_a_running_prefill(switch, defers):
    assert switch.defers is defers


def cached(tokens=40, holder=9) -> PrefixCache:
    cache = PrefixCache()
    cache.insert(list(range(tokens)), holder)
    return cache


def test_the_null_cache_matches_nothing():
    cache = cached()
    assert RadixReuse().match_length(cache, list(range(41))) == 40
    assert NULL_CACHE.match_length(cache, list(range(41))) == 0


def test_a_pinned_prefix_survives_eviction_until_unpinned():
    cache = cached()
    length, pin = RadixReuse().pin(cache, list(range(41)))
    assert length == 40 and pin is not None
    assert cache.evict(need_tokens=40) == []  # pinned: nothing can go
    cache.unpin(pin)
    assert [a.seq_id for a in cache.evict(need_tokens=40)] == [9]
    assert RadixReuse().pin(cached(), [99, 1]) == (0, None)  # nothing matched: nothing pinned


def test_the_null_cache_pins_nothing():
    assert NULL_CACHE.pin(cached(), list(range(41))) == (0, None)


def test_the_null_cache_sheds_nothing():
    cache = cached()
    assert [a.seq_id for a in RadixReuse().shed(cache, 0)] == [9]
    assert NULL_CACHE.shed(cached(), 0) == []


def test_the_null_cache_drops_what_choices_left_once_released():
    cache = cached()
    assert RadixReuse().released(cache) == [] and cache.n_holders == 1
    assert [a.seq_id for a in NULL_CACHE.released(cache)] == [9] and cache.n_holders == 0


# ---- the scheduler through them ----

class Streams:
    """Split KV: one stream per sequence id, a copy of a whole stream on `cp` -1/-1."""

    def __init__(self):
        self.seqs: dict[int, set[int]] = {}

    def apply(self, ops) -> None:
        for op in ops:
            lo = op.p0 if op.p0 >= 0 else 0
            hi = op.p1 if op.p1 >= 0 else math.inf
            if op.kind == "cp":
                assert op.p0 == op.p1 == -1, "split KV copies whole streams"
                self.seqs[op.dst] = set(self.seqs.get(op.src, ()))
            else:
                self.seqs[op.src] = {p for p in self.seqs.get(op.src, ()) if not lo <= p < hi}


def drive(sched: Scheduler, mem: Streams, steps=10_000) -> list:
    finished = []
    for _ in range(steps):
        if not (sched.running or sched.waiting):
            return finished
        plan = sched.schedule()
        mem.apply(sched.take_ops())
        sched.take_unplaced()
        finished += sched.take_finished()
        if not sched.kv.unified:
            assert [q.seq_id for q in plan.decode] == sorted(q.seq_id for q in plan.decode)
        for q in plan.decode:
            mem.seqs.setdefault(q.seq_id, set()).add(q.n_past)
        for q, start, k, _ in plan.chunks:
            mem.seqs.setdefault(q.seq_id, set()).update(range(start, start + k))
        sampled = [10 + len(q.tokens) % 7 for q in plan.decode] + [10 for _, _, _, lg in plan.chunks if lg]
        finished += sched.update_from_output(plan, sampled)
        mem.apply(sched.take_ops())
        for q in sched.running:  # every running stream holds exactly its first n_past positions
            assert mem.seqs.get(q.seq_id, set()) == set(range(q.n_past)), q.req.id
    raise AssertionError("the scheduler did not drain")


def split_scheduler(**kw) -> Scheduler:
    return Scheduler(SchedulerConfig(cap=4, n_ctx=64, n_ctx_seq=64, n_seq_max=16, n_batch=64, kv_unified=False, **kw),
                     piece=_piece)


def submit(sched: Scheduler, prompt, **sp) -> SeqState:
    s = SeqState(Request(tuple(prompt), SamplingParams(temperature=0.0, ignore_eos=True, **sp)), _Handle(),
                 None, 0, 0.0, n_ctx_seq=sched.n_ctx_seq)
    sched.add(s)
    return s


def _piece(token: int) -> bytes:
    return b"x"


class _Handle:
    def _deliver_text(self, delta: str) -> None:
        pass


def test_split_kv_runs_requests_larger_together_than_one_stream():
    """Four 50-token requests on 64-cell streams: 200 cells in all, which split KV never counts."""
    sched, mem = split_scheduler(), Streams()
    reqs = [submit(sched, [1, 2 + i, *range(100, 148)], max_tokens=8) for i in range(4)]
    sched.schedule()  # all four admitted at once
    assert len(sched.running) == 4
    mem.apply(sched.take_ops())
    sched.cancel({r.req.id for r in reqs})
    mem.apply(sched.take_ops())
    assert all(f.status == RequestStatus.FINISHED_CANCELLED for f in sched.take_finished())


def test_split_kv_resumes_a_cached_prefix_from_a_copied_stream():
    sched, mem = split_scheduler(), Streams()
    first = submit(sched, range(100, 130), max_tokens=4)
    drive(sched, mem)
    holder = next(iter(sched.cache.holders()))
    kept = len(first.tokens) - 1  # the prompt and every generated token but the last, never decoded
    assert mem.seqs[holder] == set(range(kept)) and sched.cache.held_tokens == kept, "parked on its holder"
    second = submit(sched, [*range(100, 130), 7, 8], max_tokens=4)
    sched.schedule()
    ops = sched.take_ops()
    assert ops[:2] == [KvOp("cp", holder, second.seq_id, -1, -1), KvOp("rm", second.seq_id, -1, 30, -1)]
    assert second.n_hit == 30
    mem.apply(ops)
    drive(sched, mem)
    assert second.generated == 4


@pytest.mark.parametrize("unified", [True, False])
def test_with_the_null_cache_a_finished_request_leaves_no_kv(unified):
    sched = Scheduler(SchedulerConfig(cap=4, n_ctx=256, n_ctx_seq=256, n_seq_max=16, n_batch=64, kv_unified=unified,
                                      cache_enabled=False), piece=_piece)
    mem = Streams() if not unified else None
    a = submit(sched, range(100, 130), max_tokens=4)
    if mem is not None:
        drive(sched, mem)
    else:
        _drive_unified(sched)
    assert sched.reuse is NULL_CACHE and not sched.cache_enabled
    assert a.status == RequestStatus.FINISHED_LENGTH and sched.cache.n_holders == 0
    assert sched.kv_cells_used() == 0 and sched.match_tokens([*range(100, 130), 1]) == 0


def test_switching_the_cache_swaps_the_strategy():
    sched = Scheduler(SchedulerConfig(cap=4, n_ctx=256, n_ctx_seq=256, n_seq_max=16, n_batch=64), piece=_piece)
    on = sched.reuse
    assert isinstance(on, RadixReuse) and sched.cache_enabled
    sched.set_cache_enabled(False)
    assert sched.reuse is NULL_CACHE and not sched.cache_enabled
    sched.set_cache_enabled(True)
    assert sched.reuse is on and sched.cache_enabled


def test_switching_the_cache_off_flushes_it():
    sched = Scheduler(SchedulerConfig(cap=4, n_ctx=256, n_ctx_seq=256, n_seq_max=16, n_batch=64), piece=_piece)
    submit(sched, range(100, 130), max_tokens=4)
    _drive_unified(sched)
    assert sched.cache.n_holders == 1 and sched.match_tokens([*range(100, 130), 1]) == 30
    sched.set_cache_enabled(False)
    assert sched.cache.n_holders == 0
    assert [op.kind for op in sched.take_ops()] == ["rm"]


def _drive_unified(sched: Scheduler) -> None:
    for _ in range(1000):
        if not (sched.running or sched.waiting):
            return
        plan = sched.schedule()
        sched.take_ops()
        sampled = [10 for _ in plan.decode] + [10 for _, _, _, lg in plan.chunks if lg]
        sched.update_from_output(plan, sampled)
        sched.take_ops()
    raise AssertionError("the scheduler did not drain")
