"""How a backend's KV memory is laid out, as a strategy the scheduler asks instead of a flag.

`UnifiedKv` (llama.cpp's default): one pool of cells shared by every sequence id, so a cached
prefix is aliased (`seq_cp` adds an id to the same cells), cells are the scarce resource and an
idle cached cell costs every decode step. `SplitKv` (`kv_unified=false`): one stream per
sequence id, sized for one sequence, so only ids bind, a cached prefix is copied stream to
stream, and a step's decode rows must come in rising id order to share one ubatch. SGLang
keeps the same choice behind its memory pools; here each answer the scheduler needs is one
method (engine/sched/scheduler.py)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.core.request import SamplingParams
    from engine.sched.prefix_cache import PrefixCache
    from engine.sched.sequence import SeqState

# Free cells where no cell count binds (split KV: a stream per sequence).
UNBOUNDED = 1 << 30


@dataclass(frozen=True, slots=True)
class KvOp:
    """One change to the llama.cpp memory, applied by the runner in queue order.

    `cp`: `llama_memory_seq_cp(src, dst, p0, p1)`; `rm`: `llama_memory_seq_rm(src, p0, p1)`.
    p0 = p1 = -1 is the whole sequence (in split KV, a copy of a whole stream)."""

    kind: str  # "cp" | "rm"
    src: int
    dst: int = -1
    p0: int = -1
    p1: int = -1


class KvLayout(Protocol):
    """What the scheduler asks of the KV layout."""

    unified: bool

    def cells_used(self, cache: PrefixCache, running: Iterable[SeqState]) -> int:
        """Cells in use by the cache's holders and the running sequences."""
        ...

    def free_cells(self, cache: PrefixCache, own: int) -> int:
        """Cells free when the running sequences own `own` cells beyond their shared prefixes."""
        ...

    def prefill_owed(self, running: Iterable[SeqState]) -> int:
        """Cells running prefills will still take."""
        ...

    def idle_budget(self, idle_cache_cells: int, n_running: int) -> int:
        """Idle cached cells worth keeping beside `n_running` decoding sequences."""
        ...

    def unrelated_budget(self) -> int:
        """Idle cached cells worth keeping when work that uses none of them starts on an idle
        context (the cache then holds another workload's prefixes)."""
        ...

    def cap_room(self, cache: PrefixCache, running: list[SeqState], free_ids: list[int],
                 headroom: int) -> tuple[int, int]:
        """(room, what one more sequence takes of it), for the adaptive cap."""
        ...

    def decode_order(self, rows: list[SeqState]) -> None:
        """Order a step's decode rows in place as the layout needs them."""
        ...

    def take_id(self, free_ids: list[int], seq: SeqState,
                preferred: Callable[[SamplingParams], list[int]]) -> int:
        """Pop the sequence id `seq` runs on from the `free_ids` heap."""
        ...

    def reuse_prefix(self, holder: int, seq_id: int, n: int) -> list[KvOp]:
        """The ops that give `seq_id` the KV of the holder's first `n` tokens."""
        ...

    def share_copy(self, seq_id: int, holder: int, n: int) -> list[KvOp]:
        """The ops that swap `seq_id`'s own copy of its first `n` tokens for the cells of `holder`,
        which holds them cached, so a prefix exists once; none where sequences cannot share cells."""
        ...

    def scanned_cells(self, used: int, rows: list[SeqState], n_new: int) -> int:
        """The cells a step's decode `rows` scan (n_kv), `used` cells in use and `n_new` tokens
        in the step (the simulator's step model, engine/sim/simulate.py)."""
        ...

    def step_growth(self, n_rows: int) -> int:
        """How many more cells the next decode step of `n_rows` rows scans than this one."""
        ...

    def decode_room(self, used: int, n_rows: int) -> int:
        """Decode steps of `n_rows` rows the free cells allow, `used` in use."""
        ...


class UnifiedKv:
    """One pool of `n_ctx` cells shared by every sequence id: prefixes are aliased."""

    unified = True

    def __init__(self, n_ctx: int):
        self.n_ctx = n_ctx

    def cells_used(self, cache: PrefixCache, running: Iterable[SeqState]) -> int:
        # Cached tokens (shared ones once) plus each running sequence's own tail.
        return cache.cached_tokens + sum(s.n_past - s.n_shared for s in running)

    def free_cells(self, cache: PrefixCache, own: int) -> int:
        return self.n_ctx - cache.cached_tokens - own

    def prefill_owed(self, running: Iterable[SeqState]) -> int:
        return sum(len(s.tokens) - s.n_past for s in running if s.prefilling)

    def idle_budget(self, idle_cache_cells: int, n_running: int) -> int:
        # Each decode token attends over every cell in use, so an idle cached cell costs every
        # running sequence at every step: a lone chat keeps its history, a batch of B a B-th.
        return (self.n_ctx if idle_cache_cells < 0 else idle_cache_cells) // n_running

    def unrelated_budget(self) -> int:
        # None: llama.cpp places new cells from its head, after what is kept, and a step scans
        # up to the highest cell in use; what is evicted after the new work was placed below it
        # leaves that scan as long as before.
        return 0

    def cap_room(self, cache: PrefixCache, running: list[SeqState], free_ids: list[int],
                 headroom: int) -> tuple[int, int]:
        own = sum(s.n_past - s.n_shared for s in running)
        room = self.free_cells(cache, own) + cache.evictable_tokens
        return room, own // max(len(running), 1) + headroom

    def decode_order(self, rows: list[SeqState]) -> None:
        return None  # any order shares a ubatch

    def take_id(self, free_ids: list[int], seq: SeqState,
                preferred: Callable[[SamplingParams], list[int]]) -> int:
        # Ids need not be consecutive: take the lowest free one whose idle sampler chain the
        # request can reuse, if any (a warm-up samples nothing).
        if not seq.warm:
            free = set(free_ids)
            ready = [i for i in preferred(seq.sp) if i in free]
            if ready:
                sid = min(ready)
                free_ids.remove(sid)
                heapq.heapify(free_ids)
                return sid
        return heapq.heappop(free_ids)

    def reuse_prefix(self, holder: int, seq_id: int, n: int) -> list[KvOp]:
        return [KvOp("cp", holder, seq_id, 0, n)]  # the same cells, aliased: no copy

    def share_copy(self, seq_id: int, holder: int, n: int) -> list[KvOp]:
        return [KvOp("rm", seq_id, -1, 0, n), KvOp("cp", holder, seq_id, 0, n)]

    def scanned_cells(self, used: int, rows: list[SeqState], n_new: int) -> int:
        # The cells in use with the step's new tokens: a stand-in for the highest used cell + 1
        # (calibration counts the same).
        return used + n_new

    def step_growth(self, n_rows: int) -> int:
        return n_rows  # every row's new cell joins the one pool

    def decode_room(self, used: int, n_rows: int) -> int:
        return (self.n_ctx - used) // max(n_rows, 1)


class SplitKv:
    """A stream per sequence id, each sized for one sequence: only ids bind, prefixes are copied."""

    unified = False

    def cells_used(self, cache: PrefixCache, running: Iterable[SeqState]) -> int:
        # Each holder's whole path plus each running sequence's whole context (its copied prefix too).
        return cache.held_tokens + sum(s.n_past for s in running)

    def free_cells(self, cache: PrefixCache, own: int) -> int:
        return UNBOUNDED

    def prefill_owed(self, running: Iterable[SeqState]) -> int:
        return 0

    def idle_budget(self, idle_cache_cells: int, n_running: int) -> int:
        return UNBOUNDED  # a step attends over its own stream only: idle streams cost nothing

    def unrelated_budget(self) -> int:
        return UNBOUNDED

    def cap_room(self, cache: PrefixCache, running: list[SeqState], free_ids: list[int],
                 headroom: int) -> tuple[int, int]:
        return len(free_ids), 1

    def decode_order(self, rows: list[SeqState]) -> None:
        rows.sort(key=_seq_id)  # llama.cpp's split-KV ubatches take ids in rising order

    def take_id(self, free_ids: list[int], seq: SeqState,
                preferred: Callable[[SamplingParams], list[int]]) -> int:
        return heapq.heappop(free_ids)  # the lowest: running ids stay consecutive

    def reuse_prefix(self, holder: int, seq_id: int, n: int) -> list[KvOp]:
        # Another stream: llama.cpp copies the whole stream, then we drop its tail.
        return [KvOp("cp", holder, seq_id, -1, -1), KvOp("rm", seq_id, -1, n, -1)]

    def share_copy(self, seq_id: int, holder: int, n: int) -> list[KvOp]:
        return []

    def scanned_cells(self, used: int, rows: list[SeqState], n_new: int) -> int:
        return max((s.n_past + 1 for s in rows), default=0)  # the longest row's own stream

    def step_growth(self, n_rows: int) -> int:
        return 1  # each row's stream grows by its own cell

    def decode_room(self, used: int, n_rows: int) -> int:
        return UNBOUNDED


def kv_layout(unified: bool, n_ctx: int) -> KvLayout:
    """The layout of a context of `n_ctx` cells (`kv_unified` in a backend's config)."""
    return UnifiedKv(n_ctx) if unified else SplitKv()


def _seq_id(s: SeqState) -> int:
    return s.seq_id
