"""The prediction of a remote engine's prefix cache, from what was sent there (SGLang router's way).

What was sent is kept in an approximate radix tree (approx_cache.py); `match` is the longest
prefix of a new prompt in it. Keys are token ids when the request carries them or a tokenizer
makes them (keys.py), else text counted as `CHARS_PER_TOKEN` characters per token (`units`
says which; the stats are in tokens either way). A request's key is made once and remembered
(the router matches every backend). `queries`/`hits` count the prediction at routing time.

Thread contract: any thread; one lock guards the tree, the remembered keys and the counts.
"""

from __future__ import annotations

import collections
import threading

from engine.core.request import CHARS_PER_TOKEN, Request
from engine.core.snapshot import CacheStats

from .approx_cache import ApproxTree
from .job import Job
from .keys import Key, VocabOnly, key_of, render_message

KEYS_KEPT = 256


class CachePrediction:
    """What the engine's cache holds, predicted; `enabled` False predicts nothing."""

    def __init__(self, capacity: int, tokenizer: VocabOnly | None) -> None:
        self.tokenizer = tokenizer
        self.enabled = True
        self.units = "tokens"  # "tokens" or "chars/4": what the last key counted
        self._tree = ApproxTree(capacity)
        self._lock = threading.Lock()
        self._keys: collections.OrderedDict[str, tuple[Key, int]] = collections.OrderedDict()
        self._queries = self._hits = 0

    def key(self, request: Request) -> tuple[Key, int]:
        """(key, key elements per token) of `request`'s prompt, made once."""
        with self._lock:
            hit = self._keys.get(request.id)
        if hit is not None:
            return hit
        made = key_of(request, self.tokenizer)
        with self._lock:
            self._keys[request.id] = made
            while len(self._keys) > KEYS_KEPT:
                self._keys.popitem(last=False)
        return made

    def prompt_estimate(self, request: Request) -> int:
        key, per = self.key(request)
        return max(len(key) // per, 1)

    def match(self, request: Request) -> int:
        """Predicted cached prompt tokens, below the prompt's length (its last token is computed)."""
        if not self.enabled:
            return 0
        key, per = self.key(request)
        with self._lock:
            n = self._tree.match(key)
        return max(min(n // per, self.prompt_estimate(request) - 1), 0)

    def counted(self, request: Request) -> int:
        """`match`, counted in the stats as a query at routing time (and its hit)."""
        n = self.match(request)
        prompt = self.prompt_estimate(request)
        with self._lock:
            self._queries += prompt
            self._hits += n
        return n

    def sent(self, key: Key, per_token: int) -> None:
        """A prompt went to the engine: what its cache will hold."""
        if not self.enabled:
            return
        with self._lock:
            self._tree.insert(key)
        self.units = "tokens" if per_token == 1 else f"chars/{per_token}"

    def finished(self, job: Job, text: str) -> None:
        """The engine caches prompt + output: so does the prediction (text keys, and token keys
        where a tokenizer turns the output into tokens; a token prompt's output is not known)."""
        if not self.enabled:
            return
        key: Key = job.key
        if isinstance(key, str):
            key = key + (render_message({"role": "assistant", "content": text}) if job.chat else text)
        elif self.tokenizer is not None and job.req.text is not None:
            key = key + tuple(self.tokenizer.tokenize(text, add_special=False))
        with self._lock:
            self._tree.insert(key)

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            self.clear()

    def clear(self) -> None:
        with self._lock:
            self._tree.clear()

    def reset_counters(self) -> None:
        with self._lock:
            self._queries = self._hits = 0

    def stats(self) -> CacheStats:
        with self._lock:
            size, evicted, queries, hits = self._tree.size, self._tree.evicted, self._queries, self._hits
        per = 1 if self.units == "tokens" else CHARS_PER_TOKEN
        return CacheStats(enabled=self.enabled, query_tokens=queries, hit_tokens=hits, cached_tokens=size // per,
                          evictions=evicted // per, units=self.units)
