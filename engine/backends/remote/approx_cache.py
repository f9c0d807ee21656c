"""A prediction of what a remote engine's prefix cache holds: an approximate radix tree.

We cannot see a remote engine's KV cache, so we remember what we sent it (SGLang's router
does the same in its cache-aware policy, `sgl-router/src/tree.rs`): every prompt sent there is
inserted into a radix tree, each node stamped with the time it was last used; a new prompt's
predicted hit is its longest prefix in the tree. The tree is bounded: past `capacity`
elements, least recently used leaves are evicted (the engine's own cache evicts its least
recently used prefixes too, so the prediction ages the way the real cache does).

Keys are sequences: token ids (a tuple of ints) where a tokenizer is at hand, else text (a
`str`, one element per character). Elements of different kinds never compare equal, so a tree
may hold both; each caller converts the matched length to tokens as it knows how.

Pure: no threads, no I/O. Not thread-safe; the owner locks around it.
"""

from __future__ import annotations

import heapq
import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


class _Node:
    __slots__ = ("children", "edge", "last_used", "parent")

    def __init__(self, edge: Sequence, parent: _Node | None, last_used: int) -> None:
        self.edge = edge  # the key elements on the edge from the parent to this node
        self.children: dict = {}  # first element of a child's edge -> child
        self.parent = parent
        self.last_used = last_used


@dataclass(frozen=True, slots=True)
class TreeStats:
    size: int  # elements held
    nodes: int
    evicted: int  # elements evicted since creation


class ApproxTree:
    """Radix tree of sequences with LRU eviction past `capacity` elements."""

    def __init__(self, capacity: int = 1 << 20) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._root = _Node((), None, 0)
        self._clock = itertools.count(1)
        self.size = 0
        self.nodes = 0
        self.evicted = 0

    def match(self, key: Sequence, touch: bool = False) -> int:
        """Length of the longest prefix of `key` in the tree; `touch` marks it recently used."""
        node, matched = self._root, 0
        now = next(self._clock) if touch else 0
        while matched < len(key):
            child = node.children.get(key[matched])
            if child is None:
                break
            n = _common(child.edge, key, matched)
            matched += n
            if touch:
                child.last_used = now
            if n < len(child.edge):
                break
            node = child
        return matched

    def insert(self, key: Sequence) -> int:
        """Add `key` (its prefixes become known); returns how much of it was already there.
        Evicts least recently used leaves if the tree grows past its capacity."""
        now = next(self._clock)
        node, i = self._root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = _Node(key[i:], node, now)
                node.children[key[i]] = leaf
                self.size += len(key) - i
                self.nodes += 1
                break
            n = _common(child.edge, key, i)
            child.last_used = now
            if n < len(child.edge):  # split the edge at n
                mid = _Node(child.edge[:n], node, now)
                node.children[key[i]] = mid
                child.edge = child.edge[n:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                self.nodes += 1
                child = mid
            i += n
            node = child
        if self.size > self.capacity:
            self.evict(self.size - self.capacity)
        return i

    def evict(self, need: int) -> int:
        """Drop least recently used leaves until `need` elements are gone (or the tree is
        empty); returns how many went. A parent left childless becomes a leaf in turn."""
        heap = [(n.last_used, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        gone = 0
        while heap and gone < need:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None  # a leaf is never the root
            del parent.children[leaf.edge[0]]
            gone += len(leaf.edge)
            self.nodes -= 1
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        self.size -= gone
        self.evicted += gone
        return gone

    def clear(self) -> None:
        self.evicted += self.size
        self._root = _Node((), None, 0)
        self.size = self.nodes = 0

    def stats(self) -> TreeStats:
        return TreeStats(self.size, self.nodes, self.evicted)

    def _leaves(self) -> Iterator[_Node]:
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                yield n


def _common(edge: Sequence, key: Sequence, start: int) -> int:
    """Length of the common prefix of `edge` and `key[start:]`."""
    # commonprefix works on any sequences; typeshed types it for paths and lists only.
    # token ids compared one by one: RUF071's warning is about strings
    return len(os.path.commonprefix([edge, key[start:start + len(edge)]]))  # type: ignore[list-item]  # noqa: RUF071
