"""`KvLedger`: the sequence ids and KV cells of one backend's context, as the scheduler books them.

It owns the free ids, the queue of `KvOp`s the runner applies (engine/llama/runner.py), and every
eviction from the prefix cache; the scheduler (engine/sched/scheduler.py) decides *when* cells are
needed or released, the ledger *how* (which id, which op, which cached sequence goes). Like
SGLang's cache mutators it never calls llama.cpp: each effect is an op queued for the runner.

Thread contract: none; the scheduler's owner calls it from one thread (docs/design/sched.md)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence

from engine.core.request import SamplingParams
from engine.sched.kv_layout import KvLayout, KvOp
from engine.sched.prefix_cache import EvictAction, PrefixCache, TreeNode
from engine.sched.reuse import Reuse
from engine.sched.sequence import SeqState


class KvLedger:
    """Free sequence ids, pending `KvOp`s and evictions of one context (scheduler's thread)."""

    def __init__(self, kv: KvLayout, cache: PrefixCache, n_seq_max: int, name: str,
                 preferred_ids: Callable[[SamplingParams], list[int]]) -> None:
        self.kv = kv
        self.cache = cache
        self.name = name
        self.preferred_ids = preferred_ids
        # A min-heap: the lowest free id first, so running sequences stay on few, low ids
        # (split KV decodes consecutive ids in one ubatch; a gap starts another). Mutated in
        # place only: the scheduler shows the same list as `Scheduler.free_ids`.
        self.free_ids = list(range(n_seq_max))
        self.ops: list[KvOp] = []

    def take_ops(self) -> list[KvOp]:
        """The ops queued since the last call, in the order the runner must apply them."""
        ops = self.ops[:]
        self.ops.clear()
        return ops

    # ---- ids ----

    def take_id(self, seq: SeqState) -> int:
        """A free seq id for `seq`, as the KV layout prefers it."""
        return self.kv.take_id(self.free_ids, seq, self.preferred_ids)

    def take_top_id(self) -> int:
        """The highest free id (a published prompt's holder: running sequences keep the low ones)."""
        top = max(self.free_ids)
        self.free_ids.remove(top)
        heapq.heapify(self.free_ids)
        return top

    def spare_ids(self, reserved: int) -> bool:
        """More ids are free than the `reserved` ones the cap may still admit."""
        return len(self.free_ids) > reserved

    def lowest_free_ids(self, n: int) -> list[int]:
        """The `n` lowest free ids (where the next admissions land)."""
        return heapq.nsmallest(max(n, 0), self.free_ids)

    def holder(self, node: TreeNode) -> int:
        """The seq whose cells hold a matched prefix of at least one token."""
        holder = self.cache.holder_for(node)
        if holder is None:
            raise RuntimeError(f"backend {self.name}: an empty match has no cells to share")
        return holder

    # ---- cells ----

    def free_cells(self, running: Iterable[SeqState]) -> int:
        """Cells free beside the cache and what the `running` sequences own."""
        return self.kv.free_cells(self.cache, sum(s.n_past - s.n_shared for s in running))

    def cells_used(self, running: Sequence[SeqState]) -> int:
        """Cells in use by the cache and the `running` sequences (engine/sched/kv_layout.py)."""
        return self.kv.cells_used(self.cache, running)

    def reuse_prefix(self, holder: int, seq_id: int, n: int) -> None:
        """Give `seq_id` the KV of the holder's first `n` tokens."""
        self.ops += self.kv.reuse_prefix(holder, seq_id, n)

    def share_copy(self, seq_id: int, node: TreeNode, length: int) -> bool:
        """`seq_id` computed its own copy of a cached prefix: drop the copy and alias the
        cached cells, so shared cells exist once. True when the layout did so."""
        ops = self.kv.share_copy(seq_id, self.holder(node), length)
        self.ops += ops
        return bool(ops)

    def make_room(self, need_cells: int, running: Sequence[SeqState]) -> bool:
        """Evict unpinned cached prefixes until `need_cells` cells and one seq id are free
        (split KV: only the id, its free cells being unbounded)."""
        deficit = need_cells - self.free_cells(running)
        if deficit > 0:
            self.evict(self.cache.evict(need_tokens=deficit))
            if need_cells > self.free_cells(running):
                return False
        if not self.free_ids:
            self.evict(self.cache.evict(need_seqs=1))
        return bool(self.free_ids)

    def evict_cells(self, deficit: int) -> None:
        """Evict least recently used cached prefixes worth `deficit` cells."""
        if deficit > 0:
            self.evict(self.cache.evict(need_tokens=deficit))

    def evict_one(self) -> None:
        """The least recently used cached sequence makes way (frees its id)."""
        self.evict(self.cache.evict(need_seqs=1))

    def free(self, seq_ids: Iterable[int]) -> None:
        """Free these ids' cells and give the ids back."""
        for sid in seq_ids:
            self.ops.append(KvOp("rm", sid, -1, -1, -1))
            heapq.heappush(self.free_ids, sid)

    def evict(self, actions: Iterable[EvictAction]) -> bool:
        """Apply the cache's eviction actions; True if there were any."""
        any_ = False
        for a in actions:
            any_ = True
            if a.keep == 0:
                self.free([a.seq_id])
            else:
                self.ops.append(KvOp("rm", a.seq_id, -1, a.keep, -1))
        return any_

    def take_back(self, s: SeqState) -> None:
        """The runner took `s`'s last token back: drop its cell, the same input decodes again."""
        s.n_past -= 1
        self.ops.append(KvOp("rm", s.seq_id, -1, s.n_past, -1))

    # ---- sequences leaving ----

    def release_pin(self, s: SeqState) -> None:
        """Drop `s`'s routing-time pin, if it holds one."""
        if s.pin is not None:
            self.cache.unpin(s.pin)
            s.pin = None

    def unpin_queued(self, waiting: Iterable[SeqState], head: SeqState | None) -> bool:
        """Drop the routing-time pins of the `waiting` requests (but `head`); True if any was
        held. Those pins are estimates made when each request was routed, not promises: with
        nothing running, nothing else frees cells, and a head that fits once their prefixes may
        be evicted must not fail for them; nor may a running sequence that needs a cell to grow
        be preempted or failed for them. They find what is still cached when their turn comes."""
        held = False
        for s in waiting:
            if s is not head and s.pin is not None:
                self.release_pin(s)
                held = True
        return held

    def retire(self, s: SeqState, keep: bool, reuse: Reuse) -> None:
        """Hand a sequence's KV to the prefix cache (`keep`), or free it; drop its running pin."""
        sid, s.seq_id = s.seq_id, -1
        if not keep:
            self.free([sid])
        else:
            in_kv = s.tokens[:s.n_past]
            match = self.cache.match(in_kv)
            if match.length < len(in_kv) and not any(i > sid for i in self.free_ids):
                # It will be kept, and `park` needs a free id above: the least recently used
                # cached sequence makes way (else this one would stay on a chained id).
                self.evict_one()
                match = self.cache.match(in_kv)
            if match.length > s.n_shared:
                self.share_copy(sid, match.node, match.length)
            if match.length < len(in_kv):  # it will be kept, on an id of its own
                sid = self.park(sid)
            self.free(self.cache.insert(in_kv, sid, prompt_end=s.n_prompt).free_seqs)
        if s.lock is not None:
            self.cache.unpin(s.lock)
            s.lock = None
            self.evict(reuse.released(self.cache))  # cache off: what it held goes
        s.n_shared = s.n_past = 0

    def park(self, sid: int) -> int:
        """Move a finished sequence's KV to the highest free id, which the cache then holds;
        returns that id. Running sequences keep the low ids, and with them the sampler chains
        attached there (SamplerSlots): a cache holder left on a chained id would send the next
        request to an id without one, and each attach costs a graph reserve. In split KV it
        also keeps the running ids consecutive (one ubatch per decode step). Unified KV: the
        cells gain and lose a sequence id, nothing moves; split KV: one stream is copied on
        the device."""
        top = max(self.free_ids, default=-1)
        if top < sid:
            return sid
        self.free_ids.remove(top)
        heapq.heapify(self.free_ids)
        self.ops.append(KvOp("cp", sid, top, -1, -1))
        self.ops.append(KvOp("rm", sid, -1, -1, -1))
        heapq.heappush(self.free_ids, sid)
        return top
