"""What a backend reuses of its prefix cache: the cache switch as an object, not a flag.

`RadixReuse` (cache on): requests take their longest cached prefix, finished sequences stay in
the radix tree (engine/sched/prefix_cache.py), running prompts are published there and queued
requests may wait for them. `NullCache` (cache off), after SGLang's `ChunkCache`, the cache it
uses when the radix cache is disabled: nothing matches, a finished sequence's KV is freed,
nothing is shed. The `n` choices of one request share their prompt whatever the switch says
(docs/design/sched.md), so under `NullCache` the tree holds their published prompt
only while a choice pins it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.sched.prefix_cache import EvictAction, Pin, PrefixCache
    from engine.sched.sequence import SeqState


class Reuse(Protocol):
    """What the scheduler asks of the cache switch."""

    enabled: bool
    defers: bool  # a queued request may wait for a running prefill of its prefix

    def usable(self, seq: SeqState) -> int:
        """How many of `seq`'s tokens may come from the cache at admission."""
        ...

    def match_length(self, cache: PrefixCache, tokens: list[int]) -> int:
        """Cached tokens a request of `tokens` would reuse (the router's estimate)."""
        ...

    def match_resumed(self, cache: PrefixCache, tokens: list[int]) -> tuple[int, int]:
        """`match_length`, and of it an earlier request's own part that `tokens` resumes
        (`PrefixCache.match_resumed`)."""
        ...

    def pin(self, cache: PrefixCache, tokens: list[int]) -> tuple[int, Pin | None]:
        """Match and pin that prefix for a request about to be queued: `(length, pin)`, the pin
        keeping it from eviction until admission; (0, None) when nothing matched. Raises
        `ValueError` when the match was evicted before the pin (another thread: match again)."""
        ...

    def publishes(self, seq: SeqState) -> bool:
        """`seq`'s prompt goes into the cache once computed, while it still runs."""
        ...

    def keeps(self, seq: SeqState) -> bool:
        """A sequence that ended well leaves its KV in the cache."""
        ...

    def shed(self, cache: PrefixCache, budget: int) -> list[EvictAction]:
        """Evictions that bring idle cached cells down to `budget`."""
        ...

    def released(self, cache: PrefixCache) -> list[EvictAction]:
        """Evictions due once a running sequence dropped its pin."""
        ...


class RadixReuse:
    """Cache on. `share_prefill`: publish running prompts; `defer_shared`: let a queued
    request wait for a running prefill of its prefix (both: engine/backends/config.py)."""

    enabled = True

    def __init__(self, share_prefill: bool = True, defer_shared: bool = True):
        self.share_prefill = share_prefill
        self.defers = share_prefill and defer_shared

    def usable(self, seq: SeqState) -> int:
        if seq.sp.prompt_logprobs:  # cached tokens have no logits
            return 0
        # The last prompt token is decoded again for its logits (vLLM's habit); a warm-up samples nothing.
        return len(seq.tokens) - (0 if seq.warm else 1)

    def match_length(self, cache: PrefixCache, tokens: list[int]) -> int:
        return cache.match_length(tokens, max_len=len(tokens) - 1)

    def match_resumed(self, cache: PrefixCache, tokens: list[int]) -> tuple[int, int]:
        return cache.match_resumed(tokens, max_len=len(tokens) - 1)

    def pin(self, cache: PrefixCache, tokens: list[int]) -> tuple[int, Pin | None]:
        m = cache.match(tokens, max_len=len(tokens) - 1)
        return (m.length, cache.pin(m)) if m.length else (0, None)

    def publishes(self, seq: SeqState) -> bool:
        return self.share_prefill or seq.choice

    def keeps(self, seq: SeqState) -> bool:
        return True

    def shed(self, cache: PrefixCache, budget: int) -> list[EvictAction]:
        excess = cache.evictable_tokens - budget
        return cache.evict(need_tokens=excess) if excess > 0 else []

    def released(self, cache: PrefixCache) -> list[EvictAction]:
        return []


class NullCache:
    """Cache off: a request's own choices share their prompt, and nothing else is reused."""

    enabled = False
    defers = False

    def usable(self, seq: SeqState) -> int:
        return _CHOICES.usable(seq) if seq.choice else 0

    def match_length(self, cache: PrefixCache, tokens: list[int]) -> int:
        return 0

    def match_resumed(self, cache: PrefixCache, tokens: list[int]) -> tuple[int, int]:
        return 0, 0

    def pin(self, cache: PrefixCache, tokens: list[int]) -> tuple[int, Pin | None]:
        return 0, None

    def publishes(self, seq: SeqState) -> bool:
        return seq.choice

    def keeps(self, seq: SeqState) -> bool:
        return False

    def shed(self, cache: PrefixCache, budget: int) -> list[EvictAction]:
        return []

    def released(self, cache: PrefixCache) -> list[EvictAction]:
        return cache.flush()  # what a choice published, once no choice pins it


_CHOICES = RadixReuse()
NULL_CACHE = NullCache()
