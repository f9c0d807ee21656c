"""The approximate radix tree that predicts a remote engine's prefix cache (engine/backends/remote/approx_cache.py)."""

from engine.backends.remote.approx_cache import ApproxTree


def test_match_is_the_longest_known_prefix():
    t = ApproxTree()
    t.insert("the cat sat on the mat")
    assert t.match("the cat sat on a hat") == len("the cat sat on ")
    assert t.match("a dog") == 0
    assert t.match("the cat") == len("the cat")


def _forked() -> ApproxTree:
    """(1 2 3 4) then (1 2 9): the second insert forks the first one's edge after two tokens."""
    t = ApproxTree()
    t.insert((1, 2, 3, 4))
    t.insert((1, 2, 9))
    return t


def test_insert_reports_how_much_was_already_there():
    t = ApproxTree()
    assert t.insert((1, 2, 3, 4)) == 0
    assert t.insert((1, 2, 9)) == 2


def test_insert_splits_the_edge_it_forks():
    t = _forked()
    assert t.size == 5  # 1 2 | 3 4 | 9
    assert t.nodes == 3
    assert t.match((1, 2, 3, 4, 5)) == 4
    assert t.match((1, 2, 9)) == 3


def test_token_keys_never_match_text_keys():
    t = ApproxTree()
    t.insert((104, 105))
    assert t.match("hi") == 0
    t.insert("hi")
    assert t.match("hi") == 2
    assert t.match((104, 105)) == 2


def test_capacity_evicts_least_recently_used_first():
    t = ApproxTree(capacity=12)
    t.insert("aaaa")
    t.insert("bbbb")
    t.match("aaaa", touch=True)  # a is now more recent than b
    t.insert("cccc")
    t.insert("dddd")  # 16 > 12: the least recently used (b) goes
    assert t.size <= 12
    assert t.match("bbbb") == 0
    assert t.match("aaaa") == 4
    assert t.match("dddd") == 4
    assert t.evicted == 4


def test_eviction_takes_leaves_before_their_shared_prefix():
    t = ApproxTree(capacity=100)
    t.insert("shared-prefix/one")
    t.insert("shared-prefix/two")
    t.insert("other")
    t.match("other", touch=True)
    gone = t.evict(3)  # the older leaf of the shared prefix goes first, the prefix stays
    assert gone == 3
    assert t.match("shared-prefix/") == len("shared-prefix/")
    assert t.match("other") == 5


def test_clear_empties_the_tree():
    t = ApproxTree()
    t.insert("abc")
    t.clear()
    assert t.size == 0 and t.match("abc") == 0 and t.evicted == 3
