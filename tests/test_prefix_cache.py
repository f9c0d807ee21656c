"""Tests of engine.sched.prefix_cache: table-driven cases, then a stateful check against a
brute-force model of the seqs llama.cpp would hold. No model needed."""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.sched.prefix_cache import GONE_BLOCK, RECENT_ADMISSIONS, EvictAction, Pin, PrefixCache


def make_cache(*inserts: tuple[list[int], int]) -> PrefixCache:
    cache = PrefixCache()
    for tokens, seq in inserts:
        cache.insert(tokens, seq)
    cache.check_invariants()
    return cache


def assert_totals(cache: PrefixCache, cached: int, pinned: int) -> None:
    cache.check_invariants()
    assert (cache.cached_tokens, cache.pinned_tokens, cache.evictable_tokens) == (
        cached, pinned, cached - pinned)


class TestInsert:
    CASES: ClassVar[dict] = {
        # name: (earlier inserts, new tokens, new seq, already_cached, free_seqs, holders, cached)
        "empty tree": ([], [1, 2, 3], 1, 0, [], {1}, 3),
        "empty tokens": ([([1, 2], 1)], [], 2, 0, [2], {1}, 2),
        "(a) equals a leaf": ([([1, 2, 3], 1)], [1, 2, 3], 2, 3, [2], {1}, 3),
        "(a) ends inside an edge": ([([1, 2, 3], 1)], [1, 2], 2, 2, [2], {1}, 3),
        "(a) ends at an internal node": ([([1, 2, 3], 1), ([1, 2, 4], 2)], [1, 2], 3, 2, [3], {1, 2}, 4),
        "(b) extends a leaf": ([([1, 2], 1)], [1, 2, 3, 4], 2, 2, [1], {2}, 4),
        "(b) extends a split leaf": ([([1, 2, 3], 1), ([1, 4], 2)], [1, 2, 3, 5], 3, 3, [1], {2, 3}, 5),
        "(c) diverges inside an edge": ([([1, 2, 3], 1)], [1, 2, 7], 2, 2, [], {1, 2}, 4),
        "(c) diverges at an internal node": ([([1, 2, 3], 1), ([1, 2, 4], 2)], [1, 2, 5], 3, 2, [],
                                             {1, 2, 3}, 5),
        "(c) diverges at the root": ([([1, 2], 1)], [3], 2, 0, [], {1, 2}, 3),
    }

    @pytest.mark.parametrize("name", CASES)
    def test_cases(self, name):
        earlier, tokens, seq, already, free, holders, cached = self.CASES[name]
        cache = make_cache(*earlier)
        result = cache.insert(tokens, seq)
        assert (result.already_cached, result.free_seqs) == (already, free)
        assert cache.holders() == holders
        assert_totals(cache, cached, 0)
        if tokens:
            assert cache.match_length(tokens) == len(tokens)

    def test_seq_already_holding_is_refused(self):
        cache = make_cache(([1, 2], 1))
        with pytest.raises(ValueError, match="seq 1"):
            cache.insert([3], 1)
        cache.check_invariants()

    def test_extending_a_pinned_leaf_moves_its_holder(self):
        cache = make_cache(([1, 2], 1))
        pin = cache.pin(cache.match([1, 2]))
        assert cache.insert([1, 2, 3], 2).free_seqs == [1]
        assert cache.holder_for(pin.node) == 2
        assert_totals(cache, 3, 2)


class TestMatch:
    def test_a_match_inside_an_edge_does_not_split_it(self):
        cache = make_cache(([1, 2, 3, 4], 7))
        match = cache.match([1, 2, 9])
        assert match.length == 2
        assert match.node.key == (1, 2, 3, 4)
        assert cache.holder_for(match.node) == 7
        cache.check_invariants()

    @pytest.mark.parametrize("query, max_len, expected", [
        ([1, 2, 3, 4], None, 4),
        ([1, 2, 3, 4], 3, 3),
        ([1, 2, 3, 4, 5], 4, 4),
        ([1, 2], 5, 2),
        ([1, 2, 3, 4], 0, 0),
        ([], None, 0),
        ([9, 1], None, 0),
    ])
    def test_lengths(self, query, max_len, expected):
        cache = make_cache(([1, 2, 3, 4], 7))
        assert cache.match(query, max_len).length == expected
        assert cache.match_length(query, max_len) == expected

    def test_empty_match_is_the_root_with_no_holder(self):
        cache = make_cache(([1], 7))
        match = cache.match([2])
        assert cache.holder_for(match.node) is None
        pin = cache.pin(match)
        assert_totals(cache, 1, 0)
        cache.unpin(pin)

    def test_holder_for_prefers_the_most_recent_leaf(self):
        cache = make_cache(([1, 2, 3], 1), ([1, 2, 4], 2))
        cache.match([1, 2, 3])
        assert cache.holder_for(cache.match([1]).node) == 1
        cache.match([1, 2, 4])
        assert cache.holder_for(cache.match([1]).node) == 2

    @pytest.mark.parametrize("lookup, evicted", [("match", 2), ("match_length", 1)])
    def test_only_match_stamps_lru(self, lookup, evicted):
        cache = make_cache(([1], 1), ([2], 2))
        getattr(cache, lookup)([1])
        assert cache.evict(need_seqs=1) == [EvictAction(evicted, 0, 1)]


class TestPin:
    def test_totals_follow_lock_refs(self):
        cache = make_cache(([1, 2, 3, 4], 1), ([1, 2, 5], 2))  # [1,2] -> [3,4], [5]
        deep = cache.pin(cache.match([1, 2, 3]))  # ends inside [3,4]: splits it, locks [1,2,3]
        assert deep.length == 3
        assert_totals(cache, 5, 3)
        shallow = cache.pin(cache.match([1]))  # splits [1,2]
        assert_totals(cache, 5, 3)
        cache.unpin(deep)
        assert_totals(cache, 5, 1)
        cache.unpin(shallow)
        assert_totals(cache, 5, 0)

    def test_a_short_pin_leaves_the_long_tail_evictable(self):
        cache = make_cache((list(range(1, 11)), 1))  # one leaf of 10 tokens
        pin = cache.pin(cache.match([1, 2, 99]))
        assert pin.length == 2
        actions = cache.evict(need_tokens=8)
        assert [(a.seq_id, a.keep, a.tokens) for a in actions] == [(1, 2, 8)]
        assert cache.match_length([1, 2, 3]) == 2
        assert cache.holder_for(pin.node) == 1
        assert_totals(cache, 2, 2)

    def test_unpin_twice_is_a_no_op(self):
        cache = make_cache(([1, 2], 1))
        first = cache.pin(cache.match([1, 2]))
        second = cache.pin(cache.match([1, 2]))
        cache.unpin(first)
        cache.unpin(first)
        assert first.released and not second.released
        assert_totals(cache, 2, 2)
        cache.unpin(second)
        assert_totals(cache, 2, 0)

    def test_pinning_an_evicted_match_raises(self):
        cache = make_cache(([1], 1))
        match = cache.match([1])
        cache.evict(need_seqs=1)
        with pytest.raises(ValueError, match="stale match"):
            cache.pin(match)
        with pytest.raises(ValueError, match="no longer in the tree"):
            cache.holder_for(match.node)

    def test_split_keeps_the_lock_on_the_new_upper_node(self):
        cache = make_cache(([1, 2, 3], 1))
        pin = cache.pin(cache.match([1, 2, 3]))
        cache.insert([1, 9], 2)  # splits the pinned edge after [1]
        assert_totals(cache, 4, 3)
        cache.unpin(pin)
        assert_totals(cache, 4, 0)


class TestEvict:
    def test_lru_order(self):
        cache = make_cache(([1], 1), ([2], 2), ([3], 3))
        cache.match([1])
        assert [cache.evict(need_seqs=1) for _ in range(4)] == [
            [EvictAction(2, 0, 1)], [EvictAction(3, 0, 1)], [EvictAction(1, 0, 1)], []]
        assert_totals(cache, 0, 0)
        assert cache.stats().evictions == 3

    def test_stops_once_enough_tokens_are_freed(self):
        cache = make_cache(([1, 1], 1), ([2, 2, 2], 2), ([3], 3))
        assert cache.evict(need_tokens=3) == [EvictAction(1, 0, 2), EvictAction(2, 0, 3)]
        assert cache.evict() == []
        assert cache.holders() == {3}

    def test_never_touches_pinned(self):
        cache = make_cache(([1, 2], 1), ([3, 4], 2))
        pin = cache.pin(cache.match([1]))  # splits [1,2]; only [1] is locked
        # [2], which the match did not use, keeps its (older) time and goes first
        assert cache.evict(need_tokens=100, need_seqs=5) == [EvictAction(1, 1, 1), EvictAction(2, 0, 2)]
        assert cache.match_length([1, 2]) == 1
        assert_totals(cache, 1, 1)
        cache.unpin(pin)
        assert cache.evict(need_seqs=1) == [EvictAction(1, 0, 1)]

    CASES: ClassVar[dict] = {
        # name: (inserts, evict kwargs, actions, holders after, cached after)
        "sibling left: release": ([([1, 2, 3], 1), ([1, 2, 4], 2)], {"need_tokens": 1},
                                  [EvictAction(1, 0, 1)], {2}, 3),
        "only child: trim to parent": ([([1, 2], 1), ([1, 2, 3, 4], 2)], {"need_tokens": 1},
                                       [EvictAction(2, 2, 2)], {2}, 2),
        "trim does not count as a released seq": (
            [([1, 2], 1), ([1, 2, 3, 4], 2), ([5], 3)], {"need_seqs": 1},
            [EvictAction(2, 2, 2), EvictAction(2, 0, 2)], {3}, 1),
        "child of the root: release": ([([1, 2], 1), ([3], 2)], {"need_tokens": 2},
                                       [EvictAction(1, 0, 2)], {2}, 1),
    }

    @pytest.mark.parametrize("name", CASES)
    def test_actions(self, name):
        inserts, kwargs, actions, holders, cached = self.CASES[name]
        cache = make_cache(*inserts)
        assert cache.evict(**kwargs) == actions
        assert cache.holders() == holders
        assert_totals(cache, cached, 0)

    def test_a_pinned_parent_inherits_its_evicted_childs_holder(self):
        cache = make_cache(([1, 2], 1))
        pin = cache.pin(cache.match([1, 2]))
        cache.insert([1, 2, 3], 2)
        assert cache.evict(need_tokens=10) == [EvictAction(2, 2, 1)]
        assert cache.holder_for(pin.node) == 2
        assert cache.holders() == {2}
        assert_totals(cache, 2, 2)
        cache.unpin(pin)
        assert_totals(cache, 2, 0)


class TestConversations:
    """Eviction is LRU by conversation: what a request used whole, a chain's time, and superseded
    tails first."""

    SYSTEM: ClassVar[list[int]] = list(range(100, 140))  # a shared system prompt of 40 tokens

    def conversation(self, n: int, length: int = 30) -> list[int]:
        return self.SYSTEM + [1000 * n + i for i in range(length)]

    def test_a_newcomer_sharing_only_the_system_prompt_does_not_refresh_another_conversation(self):
        # a's whole path is one edge from the root; b's pin splits it after the system prompt
        cache = make_cache((self.conversation(1), 1), ([7, 7], 2))
        pin = cache.pin(cache.match(self.SYSTEM + [9]))  # b, admitted: its system prompt pinned
        actions = cache.evict(need_tokens=1)
        # a's own tokens are the oldest thing held: before, the match had made all of a look new
        assert actions == [EvictAction(1, len(self.SYSTEM), 30)]
        assert cache.match_length([7, 7]) == 2
        cache.unpin(pin)
        cache.check_invariants()

    def test_a_resumed_conversation_stays_before_idle_ones(self):
        cache = make_cache((self.conversation(1), 1), (self.conversation(2), 2), (self.conversation(3), 3))
        cache.match(self.conversation(1) + [5])  # conversation 1's next turn
        released = [a.seq_id for a in cache.evict(need_seqs=2)]
        assert released == [2, 3]
        assert cache.holders() == {1}

    def test_a_later_turn_keeps_its_conversation_past_one_touched_between_turns(self):
        # conversation 1 has two turns ([turn1] -> [turn2]); conversation 2 was touched in between
        turn1, turn2 = self.conversation(1), self.conversation(1) + [1500 + i for i in range(20)]
        cache = make_cache((turn1, 1), (self.conversation(2), 2))
        cache.match(self.conversation(2))
        cache.insert(turn2, 3)  # turn 2 ends: conversation 1 is now the most recent
        actions = cache.evict(need_tokens=20)
        assert actions == [EvictAction(2, 0, 30)]  # the other conversation, whole; not 1's tail
        assert cache.match_length(turn2) == len(turn2)

    def test_the_tail_a_resume_left_behind_goes_first(self):
        # conversation 1's reply came back in other tokens: its next turn matches into the old
        # edge and goes on differently; what it left is superseded
        old = self.conversation(1, 60)
        cache = make_cache((self.SYSTEM + [5], 9), (old, 1), (self.conversation(2), 2))
        cache.match(self.conversation(2))  # conversation 2 is older than 1's resume below
        resumed = old[:len(self.SYSTEM) + 40] + [77] * 10
        pin = cache.pin(cache.match(resumed))
        assert pin.length == len(self.SYSTEM) + 40
        assert cache.evict(need_tokens=1) == [EvictAction(1, len(self.SYSTEM) + 40, 20)]
        cache.unpin(pin)
        cache.check_invariants()

    def test_a_short_common_start_supersedes_nothing(self):
        # two conversations whose user turns start alike (fewer than SUPERSEDED_MIN_TOKENS)
        a = self.conversation(1, 60)
        cache = make_cache((self.SYSTEM + [5], 9), (a, 1), (self.conversation(2), 2))
        cache.match(a)  # conversation 1 touched last
        pin = cache.pin(cache.match(a[:len(self.SYSTEM) + 3] + [88] * 5))
        assert cache.evict(need_seqs=1)[0].seq_id != 1
        cache.unpin(pin)


class TestFlushAndClear:
    def test_flush_releases_everything_unpinned(self):
        cache = make_cache(([1, 2, 3], 1), ([1, 2, 4], 2), ([5], 3))
        actions = cache.flush()  # [1,2] -> [3], [4]: the second of those trims, then goes
        assert [(a.seq_id, a.keep) for a in actions] == [(1, 0), (2, 2), (2, 0), (3, 0)]
        assert_totals(cache, 0, 0)

    def test_flush_trims_a_seq_for_a_pinned_internal_node(self):
        cache = make_cache(([1, 2, 3], 1), ([1, 2, 4], 2))
        pin = cache.pin(cache.match([1, 2]))
        actions = cache.flush()
        assert [a.keep for a in actions] == [0, 2]
        assert cache.holders() == {actions[1].seq_id}
        assert cache.holder_for(pin.node) == actions[1].seq_id
        assert_totals(cache, 2, 2)

    def test_clear_drops_pins_too(self):
        cache = make_cache(([1, 2], 1), ([3], 2))
        pin = cache.pin(cache.match([1, 2]))
        assert cache.clear() == [1, 2]
        cache.unpin(pin)
        assert_totals(cache, 0, 0)
        assert cache.n_holders == 0 and cache.match_length([1, 2]) == 0


class TestStats:
    def test_stats(self):
        cache = make_cache(([1, 2], 1), ([1, 3], 2))
        cache.match([1, 2])  # lookups do not count as queries
        cache.record_query(10, 4)
        cache.record_query(10, 0)
        cache.evict(need_seqs=1)
        stats = cache.stats()
        assert (stats.query_tokens, stats.hit_tokens, stats.hit_rate) == (20, 4, 0.2)
        assert (stats.cached_tokens, stats.pinned_tokens, stats.evictions, stats.n_holders) == (2, 0, 1, 1)
        assert PrefixCache().stats().hit_rate == 0.0


class TestLost:
    """Tokens a prompt asks again for after this cache evicted them: prefill paid twice."""

    SYSTEM: ClassVar[list[int]] = list(range(1000, 1000 + 2 * GONE_BLOCK))  # two blocks, shared
    HISTORY: ClassVar[list[int]] = list(range(5000, 5000 + 3 * GONE_BLOCK))  # one conversation's own three

    def test_a_prompt_that_asks_again_for_an_evicted_history_counts_it_lost(self):
        cache = make_cache((self.SYSTEM + self.HISTORY, 1), (self.SYSTEM + [7], 2))
        cache.match(self.SYSTEM + [7])  # the newcomer is touched last: the history goes
        assert [a.seq_id for a in cache.evict(need_seqs=1)] == [1]
        prompt = self.SYSTEM + self.HISTORY + [9] * 40  # the next turn
        assert cache.record_query(len(prompt), len(self.SYSTEM), prompt) == len(self.HISTORY)
        assert cache.stats().lost_tokens == len(self.HISTORY)
        assert cache.recent_lost_share == len(self.HISTORY) / len(prompt)

    def test_a_prompt_never_cached_here_loses_nothing(self):
        cache = make_cache((self.SYSTEM + self.HISTORY, 1), (self.SYSTEM + [7], 2))
        cache.match(self.SYSTEM + [7])
        cache.evict(need_seqs=1)
        other = self.SYSTEM + list(range(8000, 8000 + 3 * GONE_BLOCK))
        assert cache.record_query(len(other), len(self.SYSTEM), other) == 0
        assert cache.stats().lost_tokens == 0

    def test_only_whole_blocks_from_the_hit_on_count(self):
        """A tail shorter than a block is not remembered; lost tokens stop where the prompt
        leaves what was evicted."""
        cache = make_cache((self.SYSTEM + self.HISTORY + [3] * (GONE_BLOCK - 1), 1), (self.SYSTEM + [7], 2))
        cache.match(self.SYSTEM + [7])
        cache.evict(need_seqs=1)
        changed = self.SYSTEM + self.HISTORY[:GONE_BLOCK] + [4] * (2 * GONE_BLOCK)  # one block, then new
        assert cache.record_query(len(changed), len(self.SYSTEM), changed) == GONE_BLOCK

    def test_a_next_turn_resumes_its_conversations_own_history(self):
        """Its match covers the last turn's whole prompt; the own part is what follows the
        system prompt that another conversation shares."""
        prompt = self.SYSTEM + self.HISTORY
        cache = make_cache((self.SYSTEM + [7] * 40, 2))
        cache.insert(prompt + [6] * 20, 1, prompt_end=len(prompt))  # the last turn and its reply
        assert cache.match_resumed(prompt + [5] * 30)[1] == len(self.HISTORY)  # the reply re-tokenized
        assert cache.match_resumed(prompt + [6] * 20 + [9])[1] == len(self.HISTORY) + 20
        assert cache.match_resumed(prompt[:-1] + [5] * 30)[1] == 0  # parts before that prompt's end
        assert cache.match_resumed(self.SYSTEM + [7, 5])[1] == 0  # a newcomer
        assert cache.match_resumed(prompt, max_len=len(prompt) - 1)[1] == 0  # sent again: all but its last token

    def test_a_prompt_published_while_it_ran_keeps_its_end(self):
        prompt = self.SYSTEM + self.HISTORY
        cache = make_cache((prompt, 1))  # published while it ran
        cache.insert(prompt + [6] * 20, 2, prompt_end=len(prompt))  # then done
        assert cache.match_resumed(prompt + [5] * 30)[1] == len(prompt)  # nothing shared: all its own

    def test_a_split_keeps_the_prompts_end_on_the_path(self):
        prompt = self.SYSTEM + self.HISTORY
        cache = make_cache()
        cache.insert(prompt + [6] * 20, 1, prompt_end=len(prompt))
        cache.insert(prompt + [6] * 10 + [8] * 5, 2)  # another continuation splits the reply
        cache.check_invariants()
        assert cache.match_resumed(prompt + [5] * 30)[1] == len(prompt)

    def test_a_tenants_second_request_resumes_nothing(self):
        """It shares the first one's prefix and parts before that request's prompt ends."""
        tenant = self.SYSTEM + self.HISTORY
        cache = make_cache()
        cache.insert(tenant + [1] * 50 + [2] * 100, 1, prompt_end=len(tenant) + 50)
        assert cache.match_length(tenant + [3] * 50) == len(tenant)
        assert cache.match_resumed(tenant + [3] * 50)[1] == 0

    def test_a_warmed_prefix_was_never_answered(self):
        cache = make_cache((self.SYSTEM, 1))
        cache.insert(self.SYSTEM, 2, prompt_end=len(self.SYSTEM))
        assert cache.match_resumed(self.SYSTEM + [3] * 50)[1] == 0

    def test_flushed_prefixes_are_not_lost_later(self):
        cache = make_cache((self.SYSTEM + self.HISTORY, 1))
        cache.flush()
        prompt = self.SYSTEM + self.HISTORY + [9]
        assert cache.record_query(len(prompt), 0, prompt) == 0

    def test_the_recent_share_looks_back_over_the_last_admissions(self):
        cache = make_cache((self.SYSTEM + self.HISTORY, 1), (self.SYSTEM + [7], 2))
        cache.match(self.SYSTEM + [7])
        cache.evict(need_seqs=1)
        prompt = self.SYSTEM + self.HISTORY
        lost = cache.record_query(len(prompt), len(self.SYSTEM), prompt)
        assert cache.recent_lost_share == lost / len(prompt) == len(self.HISTORY) / len(prompt)
        for _ in range(RECENT_ADMISSIONS - 1):
            cache.record_query(100, 100)
        assert cache.recent_lost_share == lost / (len(prompt) + 100 * (RECENT_ADMISSIONS - 1))
        cache.record_query(100, 100)  # the loss leaves the window
        assert cache.recent_lost_share == 0.0
        assert cache.stats().lost_tokens == lost
        cache.reset_counters()
        assert cache.stats().lost_tokens == 0


class TestThreads:
    def test_router_lookups_while_the_backend_mutates(self):
        cache = PrefixCache()
        stop = threading.Event()
        errors: list[BaseException] = []

        def router():
            try:
                while not stop.is_set():
                    for first in range(4):
                        assert 0 <= cache.match_length([first, 1, 2, 3]) <= 4
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=router)
        thread.start()
        try:
            for seq in range(2000):
                cache.insert([seq % 4, (seq // 4) % 4, seq % 3, seq % 2], seq)
                pin = cache.pin(cache.match([seq % 4, 1]))
                cache.evict(need_seqs=1 if cache.n_holders > 8 else 0)
                cache.unpin(pin)
        finally:
            stop.set()
            thread.join(timeout=10)
        assert not thread.is_alive() and not errors
        cache.check_invariants()


# ---- stateful check against a brute-force model ----

TOKENS = st.lists(st.integers(0, 3), max_size=7)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class PrefixCacheMachine(RuleBasedStateMachine):
    """`live` maps each seq llama.cpp would still hold to the tokens in its cells."""

    def __init__(self):
        super().__init__()
        self.cache = PrefixCache()
        self.live: dict[int, list[int]] = {}
        self.pins: list[tuple[Pin, list[int]]] = []  # (pin, the query it was matched with)
        self.next_seq = 0

    def expected(self, query: list[int]) -> int:
        return max((common_prefix(query, held) for held in self.live.values()), default=0)

    def apply(self, actions: list[EvictAction]) -> None:
        for action in actions:
            assert len(self.live[action.seq_id]) > action.keep
            if action.released:
                del self.live[action.seq_id]
            else:
                self.live[action.seq_id] = self.live[action.seq_id][:action.keep]

    @rule(tokens=TOKENS)
    def insert(self, tokens):
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        already = self.expected(tokens)
        result = self.cache.insert(tokens, seq)
        assert result.already_cached == already
        self.live[seq] = tokens
        for freed in result.free_seqs:
            assert freed in self.live
            del self.live[freed]

    @rule(query=TOKENS, max_len=st.none() | st.integers(0, 7), keep=st.booleans())
    def match(self, query, max_len, keep):
        match = self.cache.match(query, max_len)
        capped = query if max_len is None else query[:max_len]
        assert match.length == self.expected(capped)
        if keep:
            self.pins.append((self.cache.pin(match), query))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        pin, _ = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.cache.unpin(pin)
        self.cache.unpin(pin)

    @rule(need_tokens=st.integers(0, 10), need_seqs=st.integers(0, 3))
    def evict(self, need_tokens, need_seqs):
        actions = self.cache.evict(need_tokens, need_seqs)
        self.apply(actions)
        enough = (sum(a.tokens for a in actions) >= need_tokens
                  and sum(a.released for a in actions) >= need_seqs)
        assert enough or self.cache.evictable_tokens == 0

    @rule()
    def flush(self):
        self.apply(self.cache.flush())
        assert self.cache.evictable_tokens == 0

    @rule()
    def clear(self):
        assert self.cache.clear() == sorted(self.live)
        self.live.clear()
        for pin, _ in self.pins:
            self.cache.unpin(pin)
        self.pins.clear()

    @invariant()
    def agrees_with_the_model(self):
        cache = self.cache
        cache.check_invariants()
        assert cache.holders() == set(self.live)
        prefixes = {tuple(held[:n]) for held in self.live.values() for n in range(1, len(held) + 1)}
        assert cache.cached_tokens == len(prefixes)
        for held in self.live.values():
            assert cache.match_length(held) == len(held)
        for pin, query in self.pins:
            assert cache.match_length(query) >= pin.length
            holder = cache.holder_for(pin.node)
            if pin.length:
                assert self.live[holder][:pin.length] == query[:pin.length]


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)  # 100 runs of 30 steps
