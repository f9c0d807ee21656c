"""A radix tree of the token sequences whose KV a llama.cpp context still holds.

The shape follows SGLang's `RadixCache`: token-id edges, children keyed by the first token
of their edge, lock refs walked up to the root, O(1) size totals and an LRU heap over the
unlocked leaves. What differs is a node's "value". llama.cpp keeps KV per sequence id, so
here every LEAF owns one holder sequence id whose cells cover positions [0, leaf.end) of
its root-to-leaf path, and internal nodes own none. Any leaf below a node therefore holds
that node's tokens; `holder_for(node)` names one.

The tree never calls llama.cpp. Its mutating methods return what the backend must do:

- `InsertResult.free_seqs`: call `seq_rm(seq, 0, -1)` on each; those ids are free again.
- `EvictAction(seq_id, keep)`: call `seq_rm(seq_id, keep, -1)`. When `keep == 0` the id is
  free again; otherwise the tree still holds it, trimmed to `keep` cells.

Eviction is least recently used by conversation, not by edge: a node counts as touched when a
request used it whole (a match that ends inside an edge touches the part it covered once a pin
splits it there, never the tail beyond), a leaf's parent left as a leaf keeps the leaf's time
(the chain is one conversation, last touched when any of its turns was), and the tail of a
conversation's edge that a longer resume left (`SUPERSEDED_MIN_TOKENS` matched into it, then
a different continuation: a reply the client re-sent in other tokens) goes first, since nobody
is likely to resume it.

Thread contract: every public method takes one `threading.RLock`, so any thread may call
any of them. The intended split: the router calls `match_length()`, a read-only estimate
that leaves LRU times alone, from its own thread; the backend's worker thread, which owns
the llama.cpp context, calls everything else. Answers are snapshots: pin a `Match` before
the next mutating call (`insert`, `evict`, `flush`, `clear`), and call `holder_for()` right
before using its answer.

What eviction costs is counted too. An evicted leaf's tokens are remembered by hash, per
`GONE_BLOCK` tokens (`_gone`, bounded), and an admitted prompt that asks again for tokens
evicted here counts them as lost (`record_query(..., tokens)`): prefill paid twice because
the context kept too little. `recent_lost_share` is their share of the last
`RECENT_ADMISSIONS` prompts (`/v1/backends`: the pool kept too little for its requests).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# A pin that ends at least this many tokens into a leaf's edge (one not hanging from the root),
# with the rest of that edge left behind, marks the rest as superseded (evicted first): a conversation resumed
# with a different continuation (a client re-sending a reply in other tokens). Fewer tokens
# are taken for two conversations that merely start alike.
SUPERSEDED_MIN_TOKENS = 16
SUPERSEDED = 0  # the access time of a superseded tail: older than any real one
# Evicted tokens are remembered in blocks of GONE_BLOCK (chained hashes: a block's hash covers
# every token before its end), at most GONE_MAX_BLOCKS blocks, the oldest forgotten first
# (64 Ki blocks: two million tokens, ~8 MiB).
GONE_BLOCK = 32
GONE_MAX_BLOCKS = 1 << 16
RECENT_ADMISSIONS = 32  # the admissions `recent_lost_share` looks back over


class TreeNode:
    """One edge of the tree and the node at its end; opaque to callers.

    Compares by last access (ties by creation order), so unlocked leaves go straight into
    a heap. `last_access` is a tick of the cache's logical clock, not wall time.
    """

    __slots__ = ("children", "end", "holder", "id", "key", "last_access", "lock_ref", "parent", "prompt_end")

    def __init__(self, node_id: int, key: tuple[int, ...], parent: TreeNode | None, end: int,
                 last_access: int) -> None:
        self.id = node_id
        self.key = key  # the edge's tokens; empty only at the root
        self.parent = parent  # None at the root and on removed nodes
        self.children: dict[int, TreeNode] = {}  # keyed by the first token of the child's key
        self.end = end  # length of the root-to-node path, i.e. the position after this edge
        self.holder: int | None = None  # llama.cpp seq id; set on leaves only
        self.lock_ref = 0
        self.last_access = last_access
        self.prompt_end = 0  # where a request's prompt ended inside this edge, its reply after it (0: none)

    def up(self) -> TreeNode:
        """The parent of a node in the tree; the root and removed nodes have none."""
        if self.parent is None:
            raise RuntimeError(f"{self!r} is the root or was removed from the tree")
        return self.parent

    def seq(self) -> int:
        """The seq id a leaf holds; internal nodes and the root hold none."""
        if self.holder is None:
            raise RuntimeError(f"{self!r} holds no seq: it is not a leaf")
        return self.holder

    def __lt__(self, other: TreeNode) -> bool:
        return (self.last_access, self.id) < (other.last_access, other.id)

    def __repr__(self) -> str:
        preview = list(self.key[:8]) + (["..."] if len(self.key) > 8 else [])
        return (f"TreeNode(id={self.id}, end={self.end}, key={preview}, holder={self.holder}, "
                f"lock_ref={self.lock_ref})")


@dataclass(frozen=True, slots=True)
class Match:
    """The longest cached prefix of a query.

    `node` is the node whose edge holds the last matched token: the end of the edge the
    match stops in (possibly part-way along it), or the root when `length == 0`.
    """

    length: int
    node: TreeNode


@dataclass(eq=False, slots=True)
class Pin:
    """A lock on the path from `node` up to the root, from `PrefixCache.pin()`.

    While held, no node on that path is evicted, so `holder_for(pin.node)` keeps naming a
    seq that holds the first `length` tokens of the pinned query.
    """

    length: int
    node: TreeNode
    released: bool = False


@dataclass(frozen=True, slots=True)
class InsertResult:
    """`already_cached`: leading tokens that were in the tree before the insert.
    `free_seqs`: seq ids now redundant; the caller does `seq_rm(seq, 0, -1)` on each."""

    already_cached: int
    free_seqs: list[int]


@dataclass(frozen=True, slots=True)
class EvictAction:
    """One evicted leaf. The caller does `seq_rm(seq_id, keep, -1)`.

    `keep == 0`: the seq is released and its id is free again. `keep > 0`: the seq now
    holds the parent, which became a leaf, and stays in the tree. `tokens` is the length of
    the evicted edge, i.e. the KV cells this action frees.
    """

    seq_id: int
    keep: int
    tokens: int

    @property
    def released(self) -> bool:
        return self.keep == 0


@dataclass(frozen=True, slots=True)
class Stats:
    """Counters since construction. Queries and hits count what the backend admitted."""

    query_tokens: int
    hit_tokens: int
    hit_rate: float
    cached_tokens: int
    pinned_tokens: int
    evictable_tokens: int
    n_holders: int
    evictions: int
    lost_tokens: int = 0  # admitted prompt tokens that had been cached here and were evicted
    recent_lost_share: float = 0.0  # lost tokens / prompt tokens, the last RECENT_ADMISSIONS admissions


class PrefixCache:
    """Which token prefixes a llama.cpp context holds, and in which seq. See the module doc.

    All public methods are thread-safe (one re-entrant lock). "Cache off" is not a mode of the
    tree but the scheduler's `NullCache` (engine/sched/reuse.py), which never asks it to match
    or keep anything.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._node_ids = itertools.count()
        self._clock = itertools.count(1)
        self._query_tokens = 0
        self._hit_tokens = 0
        self._evictions = 0
        self._lost_tokens = 0
        self._recent: deque[tuple[int, int]] = deque(maxlen=RECENT_ADMISSIONS)  # (prompt, lost) per admission
        self._reset()

    # ---- lookups ----

    def match(self, tokens: Sequence[int], max_len: int | None = None) -> Match:
        """Longest cached prefix of `tokens`, at most `max_len` long; stamps LRU times.

        Never changes the tree's shape: a match may end inside an edge, and `length` is
        exact. The backend passes `max_len=len(prompt) - 1` (vLLM's habit), because the
        last prompt token must be decoded again to get logits.
        """
        with self._lock:
            length, node, path = self._walk(tokens, max_len)
            now = next(self._clock)
            for entered in path:
                if entered.end <= length:  # used whole; a partly matched edge waits for its pin's split
                    entered.last_access = now
            return Match(length, node)

    def match_length(self, tokens: Sequence[int], max_len: int | None = None) -> int:
        """Length of `match(tokens, max_len)` without stamping LRU times: for the router,
        which asks every backend and must not make a cache look used by asking."""
        with self._lock:
            return self._walk(tokens, max_len)[0]

    def match_resumed(self, tokens: Sequence[int], max_len: int | None = None) -> tuple[int, int]:
        """`match_length(tokens, max_len)` and, in the same walk, how much of an earlier request
        this prompt resumes: when its match covers the whole prompt of a cached request that was
        answered (a conversation's next turn holds the last turn's prompt, then its reply), the
        matched tokens past the deepest node where cached prompts part (two or more children),
        i.e. the conversation's own history below a system prompt that many share; else 0. A
        tenant's request shares only the start of another's prompt, a warmed prefix was never
        answered, and a prompt sent again whole matches all but its last token."""
        with self._lock:
            length, _, path = self._walk(tokens, max_len)
            if not any(0 < n.prompt_end <= length for n in path):
                return length, 0
            parted = max((n.end for n in path if n.end <= length and len(n.children) > 1), default=0)
            return length, length - parted

    def holder_for(self, node: TreeNode) -> int | None:
        """A live seq whose cells hold every token from the root to `node` (the most
        recently used leaf below it), or None for the root, which holds no tokens.

        Valid until the next mutating call; raises ValueError if `node` left the tree.
        """
        with self._lock:
            if node is self._root:
                return None
            if not self._attached(node):
                raise ValueError(f"{node!r} is no longer in the tree; match again")
            while node.children:
                node = max(node.children.values())
            return node.holder

    # ---- locks ----

    def pin(self, match: Match) -> Pin:
        """Lock the matched prefix (and nothing more) so eviction leaves it alone.

        A match that ends inside an edge splits that edge there first (SGLang's habit), so
        the tail past the match stays evictable: a pin on a short shared prefix (a chat
        template, say) must not hold a long cached reply hostage. Raises ValueError if the
        node has been evicted since the match was made.
        """
        with self._lock:
            node = match.node
            if not self._attached(node):
                raise ValueError(f"stale match: {node!r} has been evicted; match again")
            start = node.end - len(node.key)
            if start < match.length < node.end:
                tail = node
                node = self._split(node, match.length - start)
                node.last_access = next(self._clock)
                if (not tail.children and node.parent is not self._root
                        and match.length - start >= SUPERSEDED_MIN_TOKENS):
                    tail.last_access = SUPERSEDED
            self._inc_lock(node)
            return Pin(match.length, node)

    def unpin(self, pin: Pin) -> None:
        """Release `pin`. Idempotent: a second release, or releasing a pin taken before
        `clear()`, does nothing."""
        with self._lock:
            if pin.released:
                return
            pin.released = True
            if self._attached(pin.node):
                self._dec_lock(pin.node)

    # ---- mutation ----

    def insert(self, tokens: Sequence[int], seq_id: int, prompt_end: int = 0) -> InsertResult:
        """Record that llama.cpp seq `seq_id` holds the KV of `tokens` at positions
        [0, len(tokens)): a finished request's prompt and output, as far as it was decoded.
        `prompt_end`, the length of its prompt, is kept where a reply follows it
        (`match_resumed`).

        - All of `tokens` already cached: `seq_id` itself is redundant and returned.
        - `tokens` extend a leaf: the new leaf takes `seq_id`, and the old leaf's holder,
          which the new seq covers, is returned. A pin on the old leaf stays valid, since
          `holder_for` then finds the new leaf.
        - `tokens` leave the tree inside an edge or at an internal node: the edge is split
          as needed and the new leaf takes `seq_id`.

        Raises ValueError if `seq_id` is already a holder.
        """
        with self._lock:
            if seq_id in self._holders:
                raise ValueError(f"seq {seq_id} already holds cached tokens")
            if not tokens:
                return InsertResult(0, [seq_id])
            now = next(self._clock)
            node, pos = self._root, 0
            while pos < len(tokens):
                child = node.children.get(tokens[pos])
                if child is None:
                    break
                k = _common_prefix(child.key, tokens, pos)
                if k < len(child.key):  # the tail past `k` is not this sequence's: its time stays
                    if pos + k == len(tokens):
                        return InsertResult(len(tokens), [seq_id])
                    node = self._split(child, k)
                    node.last_access = now
                    pos += k
                    break
                child.last_access = now
                node, pos = child, pos + k
            if pos == len(tokens):
                return InsertResult(pos, [seq_id])

            if pos == prompt_end < len(tokens) and node is not self._root:
                node.prompt_end = prompt_end  # the prompt was cached already (published while it ran)
            free_seqs: list[int] = []
            if node is not self._root and not node.children:
                free_seqs.append(node.seq())
                self._holders.remove(node.seq())
                node.holder = None
                self._evictable_leaves.discard(node)
            leaf = TreeNode(next(self._node_ids), tuple(tokens[pos:]), node, len(tokens), now)
            leaf.holder = seq_id
            if pos < prompt_end < len(tokens):
                leaf.prompt_end = prompt_end
            node.children[leaf.key[0]] = leaf
            self._holders.add(seq_id)
            self._evictable_leaves.add(leaf)
            self._cached_tokens += len(leaf.key)
            self._evictable_tokens += len(leaf.key)
            return InsertResult(pos, free_seqs)

    def evict(self, need_tokens: int = 0, need_seqs: int = 0) -> list[EvictAction]:
        """Evict least-recently-used unpinned leaves until at least `need_tokens` cells are
        freed and `need_seqs` seq ids are released, or nothing evictable is left.

        A leaf whose parent is the root or still has other children releases its seq
        (`keep=0`). Otherwise the parent becomes a leaf and inherits the seq trimmed to the
        parent's end (`keep=parent.end`, not counted as released), and may be evicted next.
        Returns the actions in the order the caller must apply them.
        """
        with self._lock:
            return self._evict(need_tokens, need_seqs, remember=True)

    def flush(self) -> list[EvictAction]:
        """Evict every unpinned node; pinned paths stay. Nothing flushed counts as lost later
        (a flush starts over: a bench run's reset, a cache switched off).

        Returns actions, not bare seq ids: a pinned node that loses all its children
        inherits a trimmed seq (`keep > 0`), which the caller must apply like any other.
        """
        with self._lock:
            self._gone.clear()
            return self._evict(math.inf, 0, remember=False)

    def clear(self) -> list[int]:
        """Drop everything, pins included (for shutdown). Returns every held seq id; earlier
        pins become inert."""
        with self._lock:
            seqs = sorted(self._holders)
            self._reset()
            return seqs

    def reset_counters(self) -> None:
        """Zero the query, hit, eviction and loss counters (what is cached stays)."""
        with self._lock:
            self._query_tokens = self._hit_tokens = self._evictions = self._lost_tokens = 0
            self._recent.clear()

    def record_query(self, n_query: int, n_hit: int, tokens: Sequence[int] = ()) -> int:
        """Count an admitted request: `n_query` prompt tokens, `n_hit` of them from cache, and
        of the rest those this cache had held and evicted (found by `tokens`, the prompt).
        Returns those lost tokens. Only the backend calls this; router lookups do not count."""
        with self._lock:
            lost = self._lost_beyond(tokens, n_hit) if tokens and self._gone else 0
            self._query_tokens += n_query
            self._hit_tokens += n_hit
            self._lost_tokens += lost
            self._recent.append((n_query, lost))
            return lost

    @property
    def recent_lost_share(self) -> float:
        """Lost tokens over prompt tokens, the last RECENT_ADMISSIONS admissions (0 before any)."""
        with self._lock:
            prompt = sum(n for n, _ in self._recent)
            return sum(lost for _, lost in self._recent) / prompt if prompt else 0.0

    # ---- accounting ----

    @property
    def cached_tokens(self) -> int:
        """KV cells the cache holds: edge lengths summed, shared prefixes counted once."""
        with self._lock:
            return self._cached_tokens

    @property
    def held_tokens(self) -> int:
        """Tokens summed over holders' whole paths: the cells a context needs when every
        holder keeps its own copy of its path (split KV), shared prefixes counted each time."""
        with self._lock:
            return sum(leaf.end for leaf in self._leaves())

    @property
    def pinned_tokens(self) -> int:
        """Cached tokens on pinned nodes (a pin ending inside an edge pins the whole edge)."""
        with self._lock:
            return self._pinned_tokens

    @property
    def evictable_tokens(self) -> int:
        with self._lock:
            return self._evictable_tokens

    @property
    def n_holders(self) -> int:
        with self._lock:
            return len(self._holders)

    def holders(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._holders)

    def stats(self) -> Stats:
        with self._lock:
            return Stats(
                query_tokens=self._query_tokens,
                hit_tokens=self._hit_tokens,
                hit_rate=self._hit_tokens / self._query_tokens if self._query_tokens else 0.0,
                cached_tokens=self._cached_tokens,
                pinned_tokens=self._pinned_tokens,
                evictable_tokens=self._evictable_tokens,
                n_holders=len(self._holders),
                evictions=self._evictions,
                lost_tokens=self._lost_tokens,
                recent_lost_share=self.recent_lost_share,
            )

    def check_invariants(self) -> None:
        """Recompute everything from the tree and raise AssertionError on any mismatch."""
        with self._lock:
            cached = pinned = 0
            holders: list[int] = []
            evictable_leaves = set()
            stack = [self._root]
            while stack:
                node = stack.pop()
                _check(node.lock_ref >= 0, f"negative lock_ref on {node!r}")
                if node is not self._root:
                    _check(len(node.key) > 0, f"empty edge on {node!r}")
                    _check(node.end == node.up().end + len(node.key), f"wrong end on {node!r}")
                    cached += len(node.key)
                    pinned += len(node.key) if node.lock_ref else 0
                    if node.children:
                        _check(node.holder is None, f"internal {node!r} has a holder")
                    else:
                        _check(node.holder is not None, f"leaf {node!r} has no holder")
                        holders.append(node.seq())
                        if not node.lock_ref:
                            evictable_leaves.add(node)
                else:
                    _check(node.holder is None, "the root has a holder")
                child_locks = 0
                for first, child in node.children.items():
                    _check(child.parent is node, f"{child!r} has the wrong parent")
                    _check(child.key[:1] == (first,), f"{child!r} is keyed by {first}")
                    child_locks += child.lock_ref
                    stack.append(child)
                if node is not self._root:
                    _check(node.lock_ref >= child_locks, f"{node!r} locked less than its children")
            _check(len(holders) == len(set(holders)), f"a seq holds two leaves: {sorted(holders)}")
            _check(set(holders) == self._holders, "holder set out of date")
            _check(evictable_leaves == self._evictable_leaves, "evictable-leaf set out of date")
            _check(cached == self._cached_tokens, f"cached_tokens {self._cached_tokens} != {cached}")
            _check(pinned == self._pinned_tokens, f"pinned_tokens {self._pinned_tokens} != {pinned}")
            _check(cached - pinned == self._evictable_tokens,
                   f"evictable_tokens {self._evictable_tokens} != {cached - pinned}")

    # ---- internal helpers ----

    def _leaves(self) -> Iterator[TreeNode]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.holder is not None:
                yield node
            stack.extend(node.children.values())

    def _reset(self) -> None:
        self._root = TreeNode(next(self._node_ids), (), None, 0, 0)
        self._holders: set[int] = set()
        self._evictable_leaves: set[TreeNode] = set()
        self._cached_tokens = 0
        self._pinned_tokens = 0
        self._evictable_tokens = 0
        self._gone: OrderedDict[int, None] = OrderedDict()  # hashes of evicted blocks (`_remember`)

    def _remember(self, leaf: TreeNode) -> None:
        """Note the blocks that end inside `leaf`'s edge, about to be evicted, as gone."""
        start = leaf.end - len(leaf.key)
        if leaf.end // GONE_BLOCK == start // GONE_BLOCK:
            return  # no block ends inside this edge
        keys = []
        node: TreeNode | None = leaf
        while node is not None and node is not self._root:
            keys.append(node.key)
            node = node.parent
        path = [t for key in reversed(keys) for t in key]
        for end, h in _block_hashes(path):
            if end > start:
                self._gone[h] = None
                self._gone.move_to_end(h)
        while len(self._gone) > GONE_MAX_BLOCKS:
            self._gone.popitem(last=False)

    def _lost_beyond(self, tokens: Sequence[int], hit: int) -> int:
        """Tokens of `tokens` past `hit` that were evicted here, in whole blocks from `hit` on."""
        lost_end = hit
        for end, h in _block_hashes(tokens):
            if end <= hit:
                continue
            if h not in self._gone:
                break
            lost_end = end
        return lost_end - hit

    def _walk(self, tokens: Sequence[int], max_len: int | None) -> tuple[int, TreeNode, list[TreeNode]]:
        """(matched length, node holding the last matched token, nodes entered)."""
        limit = len(tokens) if max_len is None else max(0, min(max_len, len(tokens)))
        node, pos = self._root, 0
        path: list[TreeNode] = []
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = _common_prefix(child.key, tokens, pos, limit)
            node, pos = child, pos + k
            path.append(child)
            if k < len(child.key):
                break
        return pos, node, path

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut `child`'s edge after `k` tokens; return the new internal node above it.

        The new node sits on every path `child` did, so it inherits `child`'s lock count
        and access time; the totals do not change.
        """
        parent = child.up()
        upper = TreeNode(next(self._node_ids), child.key[:k], parent, child.end - len(child.key) + k,
                         child.last_access)
        upper.lock_ref = child.lock_ref
        child.key = child.key[k:]
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        if child.prompt_end and child.prompt_end <= upper.end:  # the prompt's end stays on its edge
            upper.prompt_end, child.prompt_end = child.prompt_end, 0
        return upper

    def _inc_lock(self, node: TreeNode) -> None:
        while node is not self._root:
            if node.lock_ref == 0:
                self._evictable_tokens -= len(node.key)
                self._pinned_tokens += len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.up()

    def _dec_lock(self, node: TreeNode) -> None:
        while node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._pinned_tokens -= len(node.key)
                self._evictable_tokens += len(node.key)
                if not node.children:
                    self._evictable_leaves.add(node)
            node = node.up()

    def _attached(self, node: TreeNode) -> bool:
        while node.parent is not None:
            node = node.parent
        return node is self._root

    def _evict(self, need_tokens: float, need_seqs: float, remember: bool) -> list[EvictAction]:
        actions: list[EvictAction] = []
        freed = released = 0
        heap = list(self._evictable_leaves)
        heapq.heapify(heap)
        while heap and (freed < need_tokens or released < need_seqs):
            leaf = heapq.heappop(heap)
            if remember:
                self._remember(leaf)
            parent = leaf.up()
            del parent.children[leaf.key[0]]
            leaf.parent = None
            seq, leaf.holder = leaf.seq(), None
            self._evictable_leaves.remove(leaf)
            self._cached_tokens -= len(leaf.key)
            self._evictable_tokens -= len(leaf.key)
            self._evictions += 1
            freed += len(leaf.key)
            if parent is self._root or parent.children:
                self._holders.remove(seq)
                released += 1
                actions.append(EvictAction(seq, 0, len(leaf.key)))
            else:
                parent.holder = seq
                parent.last_access = max(parent.last_access, leaf.last_access)  # the conversation's time
                actions.append(EvictAction(seq, parent.end, len(leaf.key)))
                if parent.lock_ref == 0:
                    self._evictable_leaves.add(parent)
                    heapq.heappush(heap, parent)
        return actions


def _block_hashes(tokens: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(end, hash) of each whole GONE_BLOCK-token block of `tokens`, each hash chained over
    every token before its end, so equal hashes mean equal prefixes."""
    h = 0
    for start in range(0, len(tokens) - GONE_BLOCK + 1, GONE_BLOCK):
        h = hash((h, tuple(tokens[start:start + GONE_BLOCK])))
        yield start + GONE_BLOCK, h


def _common_prefix(edge: tuple[int, ...], tokens: Sequence[int], start: int,
                   stop: int | None = None) -> int:
    """How many leading tokens of `edge` equal `tokens[start:stop]`.

    Slices compare in C: the whole span first (a shared prefix usually matches whole), then
    64-token blocks, then token by token inside the block that differs."""
    n = min(len(edge), (len(tokens) if stop is None else stop) - start)
    if n <= 0:
        return 0
    seg = tuple(tokens[start:start + n])
    if edge[:n] == seg:
        return n
    i = 0
    while i + 64 <= n and edge[i:i + 64] == seg[i:i + 64]:
        i += 64
    while i < n and edge[i] == seg[i]:
        i += 1
    return i


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
