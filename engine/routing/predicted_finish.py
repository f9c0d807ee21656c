"""`predicted-finish`: when the new request would finish on each backend, simulated under the
backend's cap with the batch-aware step time `Rates.step_s(b)`, lowest wins. The simulation
(`_simulate`) also gives the first-token time `cache-aware` prices a backend by.

It reserves each item's whole decode budget in KV, as admission once did; the default policy
(`default.py`) models today's admission instead.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from engine.core.snapshot import BackendSnapshot, WorkItem

from .budget import DecodeBudget
from .policy import Policy, lowest, make_score, seconds_for, step_seconds
from .types import BackendScore, RouteQuery

HELP = "Simulates each backend's queue under its cap and picks the earliest finish of the new request."


def predicted_finish(query: RouteQuery, snap: BackendSnapshot, cached: int | None = None) -> BackendScore:
    """Seconds until the new request's last token if it were sent to `snap`'s backend now.

    Model (event-driven, one event per sequence completion, so O(items x cap) work):

    - Running items are active; any `prefill_left` they still have is paid first.
    - The queue, then the new request last (FCFS), is admitted while fewer than `cap`
      sequences are active and the KV cells they reserve fit: each reserves its uncached
      prompt plus its whole decode budget (the backend's admission rule), out of the context's
      cells minus pinned cached prefixes. So a GPU whose memory, not its cap, bounds
      concurrency is seen to queue. Admitting an item costs `prefill_left / prefill_tok_s` seconds
      during which nothing decodes: llama.cpp puts prompt chunks into the same batch as the
      decode tokens, so a step with a prompt chunk is longer by about the chunk's prefill time.
    - With `b` active sequences, one decode step takes `rates.step_s(b)` (alpha + beta*b when
      calibrated, else b / decode_tok_s) and every active sequence spends one token of its
      `decode_left`. Sequences run their whole remaining budget (the study's budget rule, no
      early stops), so the estimate is pessimistic for chatty workloads.
    - The new request needs its prompt minus the cached prefix, then `max_tokens` steps.

    `prefill_s` is the prefill time paid before the new request finishes, `decode_s` the decode
    time; `decode_tokens` counts tokens decoded by all sequences over that span.
    """
    return _simulate(query, snap, query.cached_on(snap.name) if cached is None else cached)[1]


def predicted_first_token(query: RouteQuery, snap: BackendSnapshot, cached: int | None = None) -> BackendScore:
    """Seconds until the new request's first token if it were sent to `snap`'s backend now.

    The same model as `predicted_finish()`, stopped when the new request is admitted and its
    uncached prompt computed: the wait for a slot (or KV room), the prefill of everything
    admitted before it, and its own prefill. So a cache hit is priced in seconds of prefill
    saved, against the queueing delay of a busier backend. `cached` overrides the query's
    cache estimate for this backend (`cache-aware` adds prefixes still in flight).
    """
    return _simulate(query, snap, query.cached_on(snap.name) if cached is None else cached, first_only=True)[0]


def _simulate(query: RouteQuery, snap: BackendSnapshot, cached: int,
              first_only: bool = False) -> tuple[BackendScore, BackendScore]:
    """(first token, finish) of the new request on `snap`'s backend; see `predicted_finish()`.
    With `first_only` the run stops at the first token and both entries are that."""
    rates = snap.rates
    cap = max(snap.cap, 1)
    cached = min(max(int(cached), 0), query.prompt_tokens)
    prefill_tokens = 0
    decode_tokens = 0
    decode_s = 0.0
    first: tuple[int, int, float] | None = None  # (prefill tokens, decode tokens, decode s) at admission

    room = snap.kv_cells_total - snap.cache.pinned_tokens if snap.kv_cells_total else math.inf
    # Each active entry: [decode_left, is_new, KV cells reserved]
    active: list[list] = []
    for item in snap.running:
        prefill_tokens += item.prefill_left
        if item.decode_left > 0:
            active.append([item.decode_left, False, _cells(item)])
    queue: deque[tuple[int, int, bool, int]] = deque(
        (i.prefill_left, i.decode_left, False, _cells(i)) for i in snap.waiting
    )
    n_new = max(query.max_tokens, 1)
    queue.append((query.prompt_tokens - cached, n_new, True, query.prompt_tokens - cached + n_new))

    used = sum(entry[2] for entry in active)
    while True:
        while queue and len(active) < cap and (not active or used + queue[0][3] <= room):
            p, d, is_new, cells = queue.popleft()
            prefill_tokens += p
            used += cells
            if is_new:
                first = (prefill_tokens, decode_tokens, decode_s)
            if d > 0:
                active.append([d, is_new, cells])
        if not active or (first_only and first is not None):  # (no active: nothing left to decode)
            break
        b = len(active)
        k = min(entry[0] for entry in active)
        decode_s += k * step_seconds(rates, b)
        decode_tokens += k * b
        new_done = False
        remaining = []
        for entry in active:
            entry[0] -= k
            if entry[0] > 0:
                remaining.append(entry)
            else:
                used -= entry[2]
                new_done = new_done or entry[1]
        active = remaining
        if new_done:
            break

    if first is None:  # not admitted (cannot happen: the new request always has a token to decode)
        first = (prefill_tokens, decode_tokens, decode_s)
    f_prefill, f_decode, f_decode_s = first
    first_score = make_score(snap, cached, f_prefill, f_decode, seconds_for(f_prefill, rates.prefill_tok_s), f_decode_s)
    if first_only:
        return first_score, first_score
    finish = make_score(snap, cached, prefill_tokens, decode_tokens, seconds_for(prefill_tokens, rates.prefill_tok_s),
                    decode_s)
    return first_score, finish


def _cells(item: WorkItem) -> int:
    """KV cells the backend reserves for `item`: its uncached prompt and whole decode budget."""
    return item.prompt_tokens - item.cached_tokens + item.generated + item.decode_left


class PredictedFinish(Policy):
    """Lowest `predicted_finish()` wins; ties go to the first backend. Budget mode is ignored."""

    name = "predicted-finish"
    uses_budget = False

    def score(self, query: RouteQuery, snap: BackendSnapshot, budget: DecodeBudget) -> BackendScore:
        return predicted_finish(query, snap)

    def choose(self, query: RouteQuery, scores: Sequence[BackendScore]) -> tuple[str, str]:
        return lowest(scores, lambda s: s.score_s, _explain_finish)


def _explain_finish(best: BackendScore, other: BackendScore | None) -> str:
    if other is None:
        return f"{best.name} would finish in {best.score_s:.3f} s"
    rel = "=" if best.score_s == other.score_s else ">"
    cache = ""
    if best.cached_tokens != other.cached_tokens:
        cache = (f"; {best.cached_tokens:,} prompt tokens cached on {best.name}, "
                 f"{other.cached_tokens:,} on {other.name}")
    return (
        f"{other.name} finish {other.score_s:.3f} s {rel} {best.name} finish {best.score_s:.3f} s: "
        f"{other.n_running} running + {other.n_waiting} queued on {other.name} (cap {other.cap}), "
        f"{best.n_running} + {best.n_waiting} on {best.name} (cap {best.cap}){cache}"
    )
