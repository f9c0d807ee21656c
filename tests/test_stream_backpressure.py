"""A sequence whose reader does not read: it pauses (no batch row, its KV kept), gives its
place and its KV to a queued request after `PAUSE_YIELD_S`, and queues again once its reader
catches up; cancelled while set aside, it ends like any other. The scheduler's own harness
(tests/test_scheduler.py's `Sim`: no model, a simulated KV)."""

from __future__ import annotations

from test_scheduler import Sim

from engine.core.request import RequestStatus
from engine.sched.scheduler import PAUSE_YIELD_S


def test_a_paused_sequence_takes_no_row_then_yields_its_place_until_its_reader_reads():
    behind: set[str] = set()
    sim = Sim(cap=1, paused=lambda s: s.req.id in behind)
    slow = sim.submit([1, 2, 3], max_tokens=50, ignore_eos=True)
    for _ in range(3):
        sim.step()
    made = slow.generated
    behind.add(slow.req.id)
    plan = sim.step()  # paused: no row, its KV kept
    assert slow not in plan.decode and slow.generated == made and slow.seq_id >= 0
    assert sim.sched.n_paused == 1 and not sim.sched.has_work()
    other = sim.submit([4, 5, 6], max_tokens=3, ignore_eos=True)
    sim.now += PAUSE_YIELD_S + 0.1  # paused this long with someone waiting: it yields
    sim.step()
    assert slow in sim.sched.parked and slow.seq_id == -1 and slow not in sim.sched.running
    for _ in range(10):
        sim.step()
    assert sim.record(other).status == RequestStatus.FINISHED_LENGTH  # served in the freed place
    behind.discard(slow.req.id)  # the reader caught up: it queues again at the next step
    sim.step()
    assert not sim.sched.parked and slow in sim.sched.running
    sim.run()
    assert sim.record(slow).status == RequestStatus.FINISHED_LENGTH and slow.generated == 50


def test_a_paused_sequence_keeps_its_place_while_nobody_waits():
    behind: set[str] = set()
    sim = Sim(cap=2, paused=lambda s: s.req.id in behind)
    slow = sim.submit([1, 2, 3], max_tokens=20, ignore_eos=True)
    sim.step()
    sim.step()
    behind.add(slow.req.id)
    sim.step()
    sim.now += 10 * PAUSE_YIELD_S
    sim.step()
    assert slow in sim.sched.running and not sim.sched.parked and slow.seq_id >= 0


def test_a_set_aside_sequence_can_be_cancelled():
    behind: set[str] = set()
    sim = Sim(cap=1, paused=lambda s: s.req.id in behind)
    slow = sim.submit([1, 2, 3], max_tokens=50, ignore_eos=True)
    sim.step()
    sim.step()
    behind.add(slow.req.id)
    sim.step()
    sim.submit([4, 5], max_tokens=2, ignore_eos=True)
    sim.now += PAUSE_YIELD_S + 0.1
    sim.step()
    assert slow in sim.sched.parked
    sim.sched.cancel({slow.req.id})
    sim.settle()
    assert not sim.sched.parked and sim.record(slow).status == RequestStatus.FINISHED_CANCELLED


def test_a_client_with_sequences_running_does_not_queue_another_client_behind_its_own():
    """40 streams of n=16 from one address queued everyone's chats behind 640 sequences: a
    queued request of a client that runs fewer sequences goes before the head's client's."""
    from engine.core.handle import RequestHandle
    from engine.core.request import Request, SamplingParams
    from engine.sched.scheduler import SeqState

    sim = Sim(cap=2)

    def submit(client: str, prompt: list[int]) -> SeqState:
        req = Request(tuple(prompt), SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0), client=client)
        seq = SeqState(req, RequestHandle(req), None, 0, sim.now, n_ctx_seq=sim.sched.n_ctx_seq)
        sim.sched.add(seq)
        return seq

    flood = [submit("10.0.0.1", [1, 2, k]) for k in range(6)]
    sim.step()
    assert {s.req.id for s in sim.sched.running} == {flood[0].req.id, flood[1].req.id}
    other = submit("10.0.0.2", [7, 8, 9])
    while flood[0].status == RequestStatus.RUNNING and flood[1].status == RequestStatus.RUNNING:
        sim.step()
    sim.step()
    # two places freed at once: the other client's request takes one, the flood the other
    assert other in sim.sched.running and sum(s in sim.sched.running for s in flood[2:]) == 1
