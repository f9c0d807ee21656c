"""`PromptSharing`: prompts shared while they run (docs/design/sched.md, "Key decisions, and why").

A running prompt is *published* into the prefix cache under a holder id of its own once computed;
a queued request is *deferred* behind a running prefill of its prefix while that pays (the
donor's remaining prompt no longer than what the request would compute itself). The `n` choices
of one request always share their prompt this way. The scheduler (engine/sched/scheduler.py)
asks; the effects on KV go through its `KvLedger`.

Thread contract: none; the scheduler's owner calls it from one thread."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.sched.kv_ledger import KvLedger
from engine.sched.prefix_cache import PrefixCache
from engine.sched.sequence import SeqState

# A running prompt is published into the prefix cache (and a queued request deferred behind
# it) only for at least this many computed tokens: each publication holds a sequence id.
SHARE_MIN_TOKENS = 64


class PromptSharing:
    """Publication of computed prompts and deferral behind running ones (scheduler's thread)."""

    def __init__(self, ledger: KvLedger, cache: PrefixCache) -> None:
        self.ledger = ledger
        self.cache = cache

    def deferred(self, seq: SeqState, donors: Iterable[SeqState], defer: bool, cached: int) -> bool:
        """`seq` (with `cached` tokens in the cache) waits for a donor's prompt prefill: a choice
        behind a choice holding all its prompt but the last token; with `defer`, when that
        reuses `SHARE_MIN_TOKENS` more of it and the donor has no more prompt left than `seq`
        would compute now."""
        if seq.warm or not (defer or seq.choice):
            return False
        limit = len(seq.tokens) - 1
        own = len(seq.tokens) - cached
        for s in donors:
            shared = common_length(seq.tokens, s.tokens, min(limit, s.n_prompt))
            if seq.choice and s.choice and shared == limit > cached:
                return True
            if defer and shared - cached >= SHARE_MIN_TOKENS and s.n_prompt - s.n_past <= own:
                return True
        return False

    def publish(self, s: SeqState, reserved: int, queued: Iterable[SeqState], blocked: bool) -> bool:
        """`s` has just computed its whole prompt: alias a copy the cache got meanwhile, then
        put the prompt into the cache under a holder id of its own (beyond the `reserved` ids
        the cap may still admit). True when a `blocked` queue head of this prefix (among
        `queued`, the next the cap may admit) now needs fewer cells."""
        ledger, cache = self.ledger, self.cache
        prompt, n = s.tokens[:s.n_prompt], s.n_prompt
        least = 1 if s.choice else SHARE_MIN_TOKENS  # `n` promises one prefill, however short
        if s.choice and not ledger.spare_ids(reserved) and cache.match_length(prompt) < n:
            ledger.evict_one()  # an idle cached prefix makes way
        match = cache.match(prompt)
        shared = s.n_shared
        # Another sequence published (or finished) this prefix while `s` computed its own copy:
        # drop the copy and alias those cells, so the prefix exists once.
        if match.length > shared and ledger.share_copy(s.seq_id, match.node, match.length):
            shared = match.length
        unblock = False
        if n - match.length >= least and ledger.spare_ids(reserved):
            holder = ledger.take_top_id()
            ledger.reuse_prefix(s.seq_id, holder, n)
            ledger.free(cache.insert(prompt, holder).free_seqs)
            match = cache.match(prompt)
            shared = n
            unblock = blocked and any(common_length(q.tokens, prompt, n) >= least for q in queued)
        if shared > s.n_shared:
            lock = cache.pin(match)  # pinned while `s` runs: its shared cells stay counted
            if s.lock is not None:
                cache.unpin(s.lock)
            s.lock = lock
            s.n_shared = shared
        return unblock


def donors_of(running: Iterable[SeqState], defer: bool, spare: bool) -> list[SeqState]:
    """Prompt prefills cached at their end: a choice's; with `defer`, others' with a spare id
    (`spare`), warm ones'."""
    return [s for s in running if s.n_past < s.n_prompt and (s.choice or (defer and (spare or s.warm)))]




def common_length(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit` (slices compare in C)."""
    limit = min(limit, len(a), len(b))
    head = min(SHARE_MIN_TOKENS, limit)
    if a[:head] != b[:head]:  # distinct prompts mostly differ early: no long slices for them
        lo, hi = 0, head
    elif a[:limit] == b[:limit]:
        return limit
    else:
        lo, hi = head, limit
    while lo < hi - 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
