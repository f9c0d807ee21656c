"""The scheduler's rules without a model, in milliseconds (vLLM's tests/v1/core/test_scheduler.py
habit): a simulated runner writes one KV cell per planned token into `Memory`, a model of
llama.cpp's unified KV (cells shared by sequence ids, `seq_cp` aliases, `seq_rm` frees), and
answers each logits row with a scripted token. After every step the invariants are asserted:
the cap, the budget, the scheduler's cell count equals the memory's, each running sequence
holds exactly its first `n_past` positions, and no two owners share a sequence id."""

from __future__ import annotations

import math

import pytest

from engine.core.request import Request, RequestStatus, SamplingParams
from engine.sched.scheduler import ADMIT_HEADROOM, SEARCHING, Scheduler, SeqState

EOG = 2


class Handle:
    """What the scheduler uses of a request handle: text deliveries."""

    def __init__(self):
        self.deltas: list[str] = []

    def _deliver_text(self, delta: str) -> None:
        self.deltas.append(delta)

    @property
    def text(self) -> str:
        return "".join(self.deltas)


class Memory:
    """Unified KV: each sequence id maps positions to cells; a cell lives while any id uses it."""

    def __init__(self):
        self.seqs: dict[int, dict[int, int]] = {}
        self._next = 0

    def apply(self, ops) -> None:
        for op in ops:
            lo = op.p0 if op.p0 >= 0 else 0
            hi = op.p1 if op.p1 >= 0 else math.inf
            if op.kind == "cp":
                dst = self.seqs.setdefault(op.dst, {})
                dst.update({p: c for p, c in self.seqs.get(op.src, {}).items() if lo <= p < hi})
            else:
                seq = self.seqs.get(op.src, {})
                for p in [p for p in seq if lo <= p < hi]:
                    del seq[p]

    def write(self, sid: int, pos: int) -> None:
        seq = self.seqs.setdefault(sid, {})
        assert pos not in seq, f"seq {sid} already has a cell at {pos}"
        seq[pos] = self._next
        self._next += 1

    @property
    def cells(self) -> int:
        return len({c for seq in self.seqs.values() for c in seq.values()})


def counting(s: SeqState) -> int:
    """A deterministic 'model': the next token depends on the sequence's tokens only."""
    return 10 + (sum(s.tokens) * 7 + len(s.tokens)) % 50


class Sim:
    def __init__(self, model=counting, clock=None, **kw):
        kw.setdefault("cap", 4)
        kw.setdefault("n_ctx", 1024)
        kw.setdefault("n_seq_max", 16)
        kw.setdefault("n_batch", 64)
        kw.setdefault("n_ctx_seq", kw["n_ctx"])
        self.now = 0.0
        self.sched = Scheduler(piece=lambda t: bytes([ord("a") + t % 26]), is_eog=lambda t: t == EOG,
                               clock=clock or (lambda: self.now), **kw)
        self.mem = Memory()
        self.model = model
        self.finished: list = []
        self.plans: list = []

    def submit(self, prompt, warm=False, **sp) -> SeqState:
        sp.setdefault("temperature", 0.0)
        seq = SeqState(Request(tuple(prompt), SamplingParams(**sp)), Handle(), None, 0, self.now, warm=warm,
                       n_ctx_seq=self.sched.n_ctx_seq)
        self.sched.add(seq)
        return seq

    def step(self):
        s = self.sched
        plan = s.schedule()
        self.mem.apply(s.take_ops())
        s.take_unplaced()
        self.finished += s.take_finished()
        for q in plan.decode:
            self.mem.write(q.seq_id, q.n_past)
        for q, start, k, _ in plan.chunks:
            for p in range(start, start + k):
                self.mem.write(q.seq_id, p)
        sampled = [self.model(q) for q in plan.decode] + [self.model(q) for q, _, _, lg in plan.chunks if lg]
        sampled += [self.model(q) for q in plan.searching]
        self.now += 0.01
        self.finished += s.update_from_output(plan, sampled)
        self.mem.apply(s.take_ops())
        self.plans.append(plan)
        self.check(plan)
        return plan

    def run(self, steps=10_000):
        for _ in range(steps):
            if not (self.sched.running or self.sched.waiting):
                return
            self.step()
        raise AssertionError("the scheduler did not drain")

    def check(self, plan) -> None:
        s = self.sched
        assert len(s.running) <= s.cap
        assert plan.n_tokens <= s.n_batch
        assert s.kv_cells_used() == self.mem.cells <= s.n_ctx
        ids = [q.seq_id for q in s.running]
        holders = set(s.cache.holders())
        assert len(set(ids)) == len(ids) and not set(ids) & holders
        assert not (set(ids) | holders) & set(s.free_ids)
        for q in s.running:
            assert set(self.mem.seqs.get(q.seq_id, {})) == set(range(q.n_past)), q.req.id
        for q in s.waiting:
            assert q.seq_id == -1 and q.status == RequestStatus.WAITING

    def record(self, seq):
        return next(f for f in self.finished if f.seq is seq)

    def settle(self) -> None:
        """Apply what the scheduler decided between steps (a cancel, a failure)."""
        self.mem.apply(self.sched.take_ops())
        self.finished += self.sched.take_finished()

    def flush(self) -> None:
        """Empty the prefix cache, as the backend's flush does."""
        self.sched.flush_cache()
        self.mem.apply(self.sched.take_ops())


# ---- grammar searches ----


def test_a_searching_sequence_takes_no_row_until_its_token_comes():
    """A constrained sequence whose search ran past its share (`SEARCHING`) keeps the KV of the
    input it decoded and takes no row while the search goes on; its reply is the same."""
    left = {"searches": 3}

    def searching_model(q):
        if q.req.id == slow.req.id and len(q.tokens) == q.n_prompt + 2 and left["searches"]:
            left["searches"] -= 1  # its third token is searched for over three more steps
            return SEARCHING
        return counting(q)

    sim = Sim(model=searching_model)
    slow, other = sim.submit([1, 5, 6], max_tokens=6), sim.submit([1, 7, 8], max_tokens=6)
    rows = 0
    while sim.sched.running or sim.sched.waiting:
        past = slow.n_past
        plan = sim.step()  # `Sim.check`: every running sequence holds exactly its first n_past cells
        rows += slow in plan.decode
        if slow in plan.searching:
            assert slow not in plan.decode and slow.n_past == past, "no row, its KV kept"
    assert left["searches"] == 0
    assert rows == 5  # one decode per token after the prompt's: none again while it searched

    plain = Sim()
    same_slow, same_other = plain.submit([1, 5, 6], max_tokens=6), plain.submit([1, 7, 8], max_tokens=6)
    plain.run()
    assert (slow.tokens, other.tokens) == (same_slow.tokens, same_other.tokens)


# ---- admission ----

@pytest.mark.parametrize("cap, n, running", [(1, 3, 1), (2, 3, 2), (4, 3, 3), (4, 8, 4)])
def test_admission_stops_at_the_cap(cap, n, running):
    sim = Sim(cap=cap)
    for i in range(n):
        sim.submit([1, 5 + i, 6], max_tokens=4)
    sim.step()
    assert len(sim.sched.running) == running and len(sim.sched.waiting) == n - running
    sim.run()
    assert len(sim.finished) == n


@pytest.mark.parametrize("prompt, fits", [(33, True), (34, False)])
def test_admission_reserves_the_prompt_plus_headroom_not_max_tokens(prompt, fits):
    """Beside a running sequence holding 50 of 100 cells, a request is admitted when its
    prompt, the headroom and this step's decode cell fit: 50 + prompt + 16 + 1 <= 100.
    Its million-token `max_tokens` reserves nothing."""
    sim = Sim(n_ctx=100)
    sim.submit(range(3, 53), max_tokens=40, ignore_eos=True)
    sim.step()
    seq = sim.submit(range(3, 3 + prompt), max_tokens=1_000_000, ignore_eos=True)
    sim.step()
    assert ADMIT_HEADROOM == 16
    assert (seq in sim.sched.running) is fits
    assert seq.max_new == 100 - prompt, "max_tokens is clamped to what the context holds"


def test_a_request_waits_for_kv_room_behind_a_running_one():
    sim = Sim(n_ctx=128, cap=4)
    a = sim.submit(range(3, 93), max_tokens=8)
    sim.step()
    b = sim.submit(range(3, 40), max_tokens=8)
    sim.step()
    assert a in sim.sched.running and b in sim.sched.waiting and sim.sched.blocked
    sim.run()
    assert [f.seq for f in sim.finished] == [a, b]


def test_short_requests_start_beside_huge_budgets():
    sim = Sim(n_ctx=4096, cap=4)
    longs = [sim.submit([1, 40 + i], max_tokens=1_000_000, ignore_eos=True) for i in range(2)]
    for _ in range(5):
        sim.step()
    short = sim.submit([1, 70], max_tokens=8, ignore_eos=True)
    for _ in range(12):
        sim.step()
    assert sim.record(short).status == RequestStatus.FINISHED_LENGTH
    assert all(q in sim.sched.running for q in longs)


# ---- the batch plan ----

def test_decode_rows_come_first_then_prefill_up_to_the_budget():
    sim = Sim(n_batch=16, busy_chunk=16)
    a = sim.submit([1, 2 + 1, 4], max_tokens=50, ignore_eos=True)
    sim.step()
    b = sim.submit(range(3, 60), max_tokens=4)
    plan = sim.step()
    assert plan.decode == [a]
    assert [(q, k) for q, _, k, _ in plan.chunks] == [(b, 15)]


@pytest.mark.parametrize("others, busy, chunks", [
    (False, 8, [64, 64, 22]),  # alone: the whole budget
    (True, 8, [8] * 18 + [6]),  # while another decodes: busy chunks
])
def test_chunked_prefill(others, busy, chunks):
    sim = Sim(n_batch=64, busy_chunk=busy)
    if others:
        sim.submit([1, 3], max_tokens=200, ignore_eos=True)
        sim.step()
    seq = sim.submit(range(5, 155), max_tokens=2)
    sizes = []
    while seq.status <= RequestStatus.RUNNING and len(sizes) < 50:
        plan = sim.step()
        sizes += [k for q, _, k, _ in plan.chunks if q is seq]
        if seq.generated:
            break
    assert sizes == chunks and sum(sizes) == 150
    assert [lg for q, _, _, lg in sim.plans[-1].chunks if q is seq] == [True], "only the last chunk asks for logits"


def test_a_no_room_decode_halves_the_prefill_budget():
    sim = Sim(n_batch=64)
    sim.submit(range(5, 105), max_tokens=2)
    plan = sim.sched.schedule()
    sim.sched.decode_failed(plan)
    assert sim.sched.prefill_budget == 32


# ---- finish rules ----

def script(*tokens):
    """A model that says `tokens` in order, then 11s."""
    def model(s):
        i = s.generated
        return tokens[i] if i < len(tokens) else 11
    return model


@pytest.mark.parametrize("sp, tokens, status, n_out", [
    ({"max_tokens": 10}, (12, 13, EOG), RequestStatus.FINISHED_STOPPED, 3),
    ({"max_tokens": 10, "ignore_eos": True}, (12, 13, EOG), RequestStatus.FINISHED_LENGTH, 10),
    ({"max_tokens": 4}, (), RequestStatus.FINISHED_LENGTH, 4),
    ({"max_tokens": 10, "stop": ("no",)}, (13, 14, 15), RequestStatus.FINISHED_STOPPED, 2),  # n, o
    ({"max_tokens": 10_000}, (), RequestStatus.FINISHED_LENGTH, 64 - 3),  # the context's end
])
def test_finish_rules(sp, tokens, status, n_out):
    sim = Sim(model=script(*tokens), n_ctx=64)
    seq = sim.submit([1, 5, 6], **sp)
    sim.run()
    f = sim.record(seq)
    assert (f.status, seq.generated) == (status, n_out)
    if "stop" in sp:
        assert "no" not in seq.handle.text


def test_stop_after_ends_as_if_the_model_stopped():
    sim = Sim()
    seq = SeqState(Request((1, 5), SamplingParams(max_tokens=50, temperature=0.0), stop_after=5), Handle(), None, 0, 0.0)
    sim.sched.add(seq)
    sim.run()
    assert sim.record(seq).status == RequestStatus.FINISHED_STOPPED and seq.generated == 5


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding"])
def test_cancel_frees_what_the_request_held(when):
    sim = Sim(cap=1, n_batch=16, busy_chunk=16)
    blocker = sim.submit([1, 3], max_tokens=3) if when == "waiting" else None
    seq = sim.submit(range(5, 60), max_tokens=100, ignore_eos=True)
    sim.step()
    if when == "decoding":
        while not seq.generated:
            sim.step()
    sim.sched.cancel({seq.req.id})
    sim.settle()
    assert sim.record(seq).status == RequestStatus.FINISHED_CANCELLED
    assert seq not in sim.sched.running and seq not in sim.sched.waiting
    assert sim.sched.kv_cells_used() == sim.mem.cells
    sim.run()
    if blocker is not None:
        assert sim.record(blocker).status == RequestStatus.FINISHED_LENGTH


def test_time_comes_from_the_injected_clock():
    sim = Sim()
    seq = sim.submit([1, 5], max_tokens=3)
    sim.run()
    assert seq.t_first == pytest.approx(0.01) and seq.t_last == pytest.approx(0.03)


# ---- growth and preemption ----

def test_the_youngest_is_preempted_by_recompute_without_changing_its_output():
    alone = Sim(n_ctx=96, cap=1)
    solo = [alone.submit([1, 40 + i], max_tokens=60, ignore_eos=True) for i in range(2)]
    alone.run()
    sim = Sim(n_ctx=96, cap=2)
    old, young = (sim.submit([1, 40 + i], max_tokens=60, ignore_eos=True) for i in range(2))
    while not young.preemptions:
        sim.step()
    assert young in sim.sched.waiting and sim.sched.waiting[0] is young
    assert young.n_past == 0 and young.generated > 0 and len(young.tokens) == 2 + young.generated
    sim.run()
    assert old.preemptions == 0
    assert [q.tokens for q in (old, young)] == [q.tokens for q in solo]
    assert [q.handle.text for q in (old, young)] == [q.handle.text for q in solo], "no text twice"


def test_a_preempted_request_is_readmitted_before_later_arrivals():
    sim = Sim(n_ctx=96, cap=2)
    _, young = (sim.submit([1, 40 + i], max_tokens=60, ignore_eos=True) for i in range(2))
    while not young.preemptions:
        sim.step()
    n = len(sim.plans)
    late = sim.submit([1, 70], max_tokens=4)
    sim.run()
    admitted = [q for plan in sim.plans[n:] for q in plan.admitted]
    assert admitted.index(young) < admitted.index(late)
    assert all(f.status == RequestStatus.FINISHED_LENGTH for f in sim.finished)


def test_fcfs_under_a_cap_of_one():
    sim = Sim(cap=1)
    seqs = [sim.submit([1, 5 + i], max_tokens=3 + i) for i in range(5)]
    sim.run()
    assert [f.seq for f in sim.finished] == seqs


def test_a_sequence_that_cannot_grow_alone_fails_with_a_clear_error():
    sim = Sim(n_ctx=64, cap=1)
    warm = sim.submit(range(100, 140), warm=True)
    sim.run()
    assert sim.record(warm).status == RequestStatus.FINISHED_STOPPED and sim.sched.cache.cached_tokens == 40
    pin = sim.sched.cache.pin(sim.sched.cache.match(list(range(100, 140))))  # a queued request's pin
    grower = sim.submit([1, 5], max_tokens=1000, ignore_eos=True)
    sim.run()
    f = sim.record(grower)
    assert f.status == RequestStatus.FINISHED_ERROR and "ran out of KV cells" in f.error
    assert grower.generated == 64 - 40 - 2 + 1
    sim.sched.cache.unpin(pin)


def _warm(sim, tokens) -> list[int]:
    """Cache `tokens` on `sim`'s context (a warmed prefix) and return them."""
    prefix = list(tokens)
    sim.submit(prefix, warm=True)
    sim.run()
    return prefix


def _queue_pinned(sim, prefix: list[int]) -> SeqState:
    """Queue a request for `prefix` plus one token, its cached prefix pinned as routing pins it."""
    tokens = (*prefix, 7)
    cache = sim.sched.cache
    seq = SeqState(Request(tokens, SamplingParams(temperature=0.0, max_tokens=2)), Handle(),
                   cache.pin(cache.match(tokens, max_len=len(prefix))), len(prefix), sim.now, n_ctx_seq=sim.sched.n_ctx_seq)
    sim.sched.add(seq)
    return seq


def test_queued_requests_pins_give_way_to_the_head_when_nothing_runs():
    # 128 cells: a cached 60-token prefix, pinned at routing for a request queued behind a
    # 100-token head that needs 116 cells. Nothing runs, so only the pin stands in the way.
    sim = Sim(n_ctx=128, cap=2)
    prefix = _warm(sim, range(100, 160))
    cache = sim.sched.cache
    assert cache.cached_tokens == 60
    head = sim.submit(range(200, 300), max_tokens=2)
    behind = _queue_pinned(sim, prefix)
    assert cache.pinned_tokens == 60
    sim.run()
    assert sim.record(head).status == RequestStatus.FINISHED_LENGTH, sim.record(head).error
    assert sim.record(behind).status == RequestStatus.FINISHED_LENGTH, sim.record(behind).error
    assert cache.pinned_tokens == 0


def test_queued_requests_pins_give_way_to_a_running_sequence_that_must_grow():
    # 64 cells: a cached 40-token prefix, pinned at routing for a request queued behind a lone
    # running sequence that grows to 42 cells. Failing it, or preempting it, for a queued
    # request's estimate would lose work; the pin is dropped and the prefix evicted instead.
    sim = Sim(n_ctx=64, cap=1)
    prefix = _warm(sim, range(100, 140))
    cache = sim.sched.cache
    behind = _queue_pinned(sim, prefix)  # routed before the grower came, queued behind it
    grower = sim.submit([1, 5], max_tokens=40, ignore_eos=True)
    sim.sched.waiting.rotate(1)
    sim.step()
    assert grower.status == RequestStatus.RUNNING
    assert cache.pinned_tokens == 40
    sim.run()
    assert sim.record(grower).status == RequestStatus.FINISHED_LENGTH, sim.record(grower).error
    assert grower.preemptions == 0 and grower.generated == 40
    assert sim.record(behind).status == RequestStatus.FINISHED_LENGTH, sim.record(behind).error
    assert cache.pinned_tokens == 0


def test_prefix_reuse_aliases_cached_cells():
    sim = Sim(n_ctx=256)
    prefix = list(range(100, 180))
    a = sim.submit(prefix + [5], max_tokens=4)
    sim.run()
    b = sim.submit(prefix + [6], max_tokens=4)
    sim.step()
    assert b.n_shared == 80, "the cached prefix is aliased, not recomputed"
    sim.run()
    assert sim.sched.kv_cells_used() == sim.mem.cells
    assert a.generated == b.generated == 4


# ---- an idle context's cache and the work that starts on it ----

SYSTEM = list(range(300, 380))  # a system prompt every conversation shares (80 tokens)


def _converse(sim: Sim, n: int) -> list[int]:
    """`n` conversations' first turns, one after another, each leaving its history cached;
    returns the cached tokens they left."""
    for i in range(n):
        sim.submit(SYSTEM + list(range(1000 + 50 * i, 1040 + 50 * i)), max_tokens=8)
        sim.run()
    return sim.sched.cache.cached_tokens


def test_unrelated_work_on_an_idle_context_clears_what_other_work_left_cached():
    sim = Sim(n_ctx=1024)
    assert _converse(sim, 3) == 80 + 3 * (40 + 7)  # each: its own 40 and the 7 tokens it wrote before the last
    study = sim.submit(list(range(2000, 2100)), max_tokens=4)
    sim.step()
    assert sim.sched.unrelated_sheds == 1
    assert sim.sched.cache.cached_tokens == 0, "the conversations' histories went before its cells were placed"
    assert sim.mem.cells == study.n_past  # the pool holds its cells alone
    sim.run()
    assert sim.sched.kv_cells_used() == sim.mem.cells


def test_a_new_conversation_sharing_the_system_prompt_keeps_the_others_histories():
    sim = Sim(n_ctx=1024)
    cached = _converse(sim, 3)
    sim.submit(SYSTEM + list(range(5000, 5030)), max_tokens=4)
    sim.step()
    assert sim.sched.unrelated_sheds == 0
    assert sim.sched.cache.cached_tokens >= cached


def test_unrelated_work_beside_running_work_leaves_the_cache_to_the_idle_budget():
    sim = Sim(n_ctx=1024)
    cached = _converse(sim, 2)
    sim.submit(SYSTEM + list(range(5000, 5030)), max_tokens=40)  # a returning user's turn, running
    sim.step()
    sim.submit(list(range(2000, 2100)), max_tokens=4)
    sim.step()
    assert sim.sched.unrelated_sheds == 0 and sim.sched.cache.cached_tokens >= cached
    sim.run()


def test_a_prefix_pinned_for_a_queued_request_survives_unrelated_work():
    sim = Sim(n_ctx=1024, cap=1)
    _converse(sim, 1)
    _queue_pinned(sim, SYSTEM)  # routed here for the cached system prompt, queued
    head = sim.submit(list(range(2000, 2100)), max_tokens=4)
    sim.sched.waiting.remove(head)
    sim.sched.waiting.appendleft(head)  # the unrelated request comes first
    sim.step()
    assert sim.sched.unrelated_sheds == 1
    assert sim.sched.cache.match_length((*SYSTEM, 7)) == 80, "the queued request's prefix stayed"
    assert sim.sched.cache.cached_tokens == 80, "the conversation's own turn went"
    sim.run()


# ---- the choices of one request (n > 1) ----


def submit_choices(sim: Sim, prompt, n: int, **sp) -> list[SeqState]:
    """What `Backend.enqueue_group` queues: the choices, next to each other."""
    sp.setdefault("temperature", 0.0)
    sp.setdefault("max_tokens", 4)
    choices = [SeqState(Request(tuple(prompt), SamplingParams(**sp)), Handle(), None, 0, sim.now,
                        n_ctx_seq=sim.sched.n_ctx_seq, choice=True) for _ in range(n)]
    for c in choices:
        sim.sched.add(c)
    return choices


def _prefilled(sim: Sim) -> int:
    return sum(k for p in sim.plans for _, _, k, _ in p.chunks)


def test_choices_wait_for_the_first_choice_prefill():
    sim = Sim(n_batch=16)
    choices = submit_choices(sim, range(20, 60), 3)
    sim.step()
    assert [c.status for c in choices] == [RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.WAITING]


# A short prompt (below SHARE_MIN_TOKENS) and every sharing setting: `n` shares the prompt anyway.
@pytest.mark.parametrize("settings", [{}, {"share_prefill": False}, {"defer_shared": False}, {"cache_enabled": False}])
def test_choices_compute_their_shared_prompt_once(settings):
    sim = Sim(n_batch=16, **settings)
    prompt = list(range(20, 60))
    choices = submit_choices(sim, prompt, 3)
    sim.run()
    assert _prefilled(sim) == len(prompt) + 2  # the prompt once, then each other choice's last prompt token
    assert [c.n_hit for c in choices] == [0, len(prompt) - 1, len(prompt) - 1]


def test_choices_leave_nothing_cached_with_the_cache_off():
    sim = Sim(cache_enabled=False)
    submit_choices(sim, range(20, 60), 3)
    sim.run()
    assert sim.sched.kv_cells_used() == sim.mem.cells == 0


def test_choices_share_their_prompt_when_cached_prefixes_hold_the_spare_ids():
    sim = Sim(cap=2, n_seq_max=4)
    for i in range(2):  # two cached prefixes, on the two ids beyond the cap
        sim.submit(range(100 * i + 100, 100 * i + 140), max_tokens=2)
    sim.run()
    assert sim.sched.cache.n_holders == 2
    before = _prefilled(sim)
    prompt = list(range(20, 60))
    submit_choices(sim, prompt, 2)
    sim.run()
    assert _prefilled(sim) - before == len(prompt) + 1


@pytest.mark.parametrize("cache_enabled", [True, False])
def test_cancelling_every_choice_frees_what_they_held(cache_enabled):
    sim = Sim(cache_enabled=cache_enabled)
    choices = submit_choices(sim, range(20, 60), 3, max_tokens=50, ignore_eos=True)
    while not all(c.generated for c in choices):
        sim.step()
    sim.sched.cancel({c.req.id for c in choices})
    sim.settle()
    assert [sim.record(c).status for c in choices] == [RequestStatus.FINISHED_CANCELLED] * 3
    assert not sim.sched.running and sim.sched.cache.pinned_tokens == 0
    sim.flush()
    assert sim.sched.kv_cells_used() == sim.mem.cells == 0


# ---- sharing a running prompt ----

TENANT = list(range(100, 300))  # a 200-token prefix, above SHARE_MIN_TOKENS


def _computed(seqs) -> int:
    """Prompt tokens the backend computed (not reused) for `seqs`, by their records."""
    return sum(q.n_prompt - q.n_hit for q in seqs)


def test_a_request_admitted_while_the_first_decodes_reuses_its_prompt():
    sim = Sim(n_ctx=1024)
    a = sim.submit(TENANT + [5], max_tokens=40, ignore_eos=True)
    while not a.generated:
        sim.step()
    b = sim.submit(TENANT + [6], max_tokens=4)
    sim.step()
    assert a.status == RequestStatus.RUNNING
    assert b.n_hit == len(TENANT), "the running prompt's prefix is aliased, not recomputed"


def test_a_running_prompt_is_held_once_in_the_kv():
    sim = Sim(n_ctx=1024)
    a = sim.submit(TENANT + [5], max_tokens=40, ignore_eos=True)
    while not a.generated:
        sim.step()
    b = sim.submit(TENANT + [6], max_tokens=30, ignore_eos=True)
    while not b.generated:
        sim.step()
    own = (a.n_past - len(TENANT)) + (b.n_past - len(TENANT))
    assert sim.mem.cells == len(TENANT) + own


def test_the_generated_tail_of_a_running_request_is_never_matched():
    sim = Sim(n_ctx=1024)
    a = sim.submit(TENANT + [5], max_tokens=40, ignore_eos=True)
    while a.generated < 5:
        sim.step()
    assert sim.sched.match_tokens(a.tokens + [9]) == len(TENANT) + 1


def test_outputs_match_the_run_without_sharing():
    runs = []
    for share in (False, True):
        sim = Sim(n_ctx=2048, share_prefill=share)
        seqs = []
        for i in range(4):
            seqs.append(sim.submit(TENANT + [5 + i], max_tokens=12, ignore_eos=True))
            sim.step()
            sim.step()
        sim.run()
        runs.append([q.tokens for q in seqs])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("share, computed", [(False, 4 * 201), (True, 200 + 4)])
def test_a_burst_of_one_tenant_computes_its_prefix_once(share, computed):
    sim = Sim(n_ctx=2048, share_prefill=share, defer_shared=share)
    seqs = [sim.submit(TENANT + [5 + i], max_tokens=8, ignore_eos=True) for i in range(4)]
    sim.run()
    assert _computed(seqs) == computed


def test_without_deferral_a_burst_keeps_one_copy_once_prefills_end():
    sim = Sim(n_ctx=2048, defer_shared=False)
    seqs = [sim.submit(TENANT + [5 + i], max_tokens=30, ignore_eos=True) for i in range(4)]
    while not all(q.generated for q in seqs):
        sim.step()
    assert sim.mem.cells == len(TENANT) + sum(q.n_past - len(TENANT) for q in seqs)


@pytest.mark.parametrize("end", ["cancel", "fail"])
def test_the_publisher_ending_early_leaves_the_sharer_correct(end):
    alone = Sim(n_ctx=1024)
    ref = alone.submit(TENANT + [6], max_tokens=20, ignore_eos=True)
    alone.run()
    sim = Sim(n_ctx=1024)
    a = sim.submit(TENANT + [5], max_tokens=200, ignore_eos=True)
    while not a.generated:
        sim.step()
    b = sim.submit(TENANT + [6], max_tokens=20, ignore_eos=True)
    sim.step()
    assert b.n_hit == len(TENANT)
    if end == "cancel":
        sim.sched.cancel({a.req.id})
    else:
        sim.sched.fail(a, "the device failed")
    sim.settle()
    assert sim.sched.kv_cells_used() == sim.mem.cells
    sim.run()
    assert b.tokens == ref.tokens
    sim.flush()
    assert sim.sched.kv_cells_used() == sim.mem.cells == 0


def test_publication_leaves_ids_for_the_cap():
    sim = Sim(n_ctx=4096, cap=4, n_seq_max=5)
    seqs = [sim.submit([i] + TENANT + [5], max_tokens=30, ignore_eos=True) for i in range(4)]
    sim.run()
    assert all(sim.record(q).status == RequestStatus.FINISHED_LENGTH for q in seqs)
    assert max(len(p.decode) for p in sim.plans) == 4, "every request ran at once"


def test_a_preempted_sharer_resumes_the_same():
    alone = Sim(n_ctx=1024)
    ref = alone.submit(TENANT + [6], max_tokens=60, ignore_eos=True)
    alone.run()
    sim = Sim(n_ctx=TENANT.__len__() + 100, cap=2)
    a = sim.submit(TENANT + [5], max_tokens=60, ignore_eos=True)
    while not a.generated:
        sim.step()
    b = sim.submit(TENANT + [6], max_tokens=60, ignore_eos=True)
    sim.run()
    assert b.preemptions and b.n_hit == len(TENANT)
    assert b.tokens == ref.tokens
    sim.flush()
    assert sim.sched.kv_cells_used() == sim.mem.cells == 0


def test_requests_behind_one_deferred_for_its_prefix_are_admitted():
    sim = Sim(n_ctx=2048, n_batch=32, busy_chunk=32)
    a = sim.submit(TENANT + [5], max_tokens=8, ignore_eos=True)
    b = sim.submit(TENANT + [6], max_tokens=8, ignore_eos=True)
    c = sim.submit(range(400, 420), max_tokens=8, ignore_eos=True)
    sim.step()
    assert a.status == c.status == RequestStatus.RUNNING and b in sim.sched.waiting
    while not a.generated:
        sim.step()
    sim.step()
    assert b.status == RequestStatus.RUNNING and b.n_hit == len(TENANT)


def test_a_deferral_ends_when_the_running_prefill_is_cancelled():
    sim = Sim(n_ctx=2048, n_batch=32, busy_chunk=32)
    a = sim.submit(TENANT + [5], max_tokens=8, ignore_eos=True)
    b = sim.submit(TENANT + [6], max_tokens=8, ignore_eos=True)
    sim.step()
    assert b in sim.sched.waiting
    sim.sched.cancel({a.req.id})
    sim.step()
    assert b.status == RequestStatus.RUNNING and b.n_hit == 0
    sim.run()
    assert sim.record(b).status == RequestStatus.FINISHED_LENGTH


LONG_TAIL = list(range(1000, 1600))  # a donor's own 600 tokens after the shared TENANT


def test_a_request_is_deferred_behind_a_donor_with_little_prompt_left():
    sim = Sim(n_ctx=4096, n_batch=32, busy_chunk=32)
    donor = sim.submit(TENANT + LONG_TAIL, max_tokens=8, ignore_eos=True)
    while donor.n_prompt - donor.n_past > len(TENANT):  # less left than the next request's prompt
        sim.step()
    b = sim.submit(TENANT + [6], max_tokens=8, ignore_eos=True)
    sim.step()
    assert b in sim.sched.waiting and donor.status == RequestStatus.RUNNING
    sim.run()
    assert b.n_hit == len(TENANT)


def test_a_request_is_admitted_at_once_when_the_donors_prompt_left_is_long():
    sim = Sim(n_ctx=4096, n_batch=32, busy_chunk=32)
    donor = sim.submit(TENANT + LONG_TAIL, max_tokens=8, ignore_eos=True)
    sim.step()
    assert donor.n_prompt - donor.n_past > 2 * len(TENANT)
    b = sim.submit(TENANT + [6], max_tokens=8, ignore_eos=True)
    sim.step()
    assert b.status == RequestStatus.RUNNING and b.n_hit == 0
