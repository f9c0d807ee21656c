"""llama.cpp sampler chains built from `SamplingParams`, one per sequence.

Greedy (temperature 0) is the `greedy` sampler after optional bias and penalties; otherwise
bias → penalties → top-k → top-p → min-p → temperature → seeded distribution. The request's
`logit_bias` is llama.cpp's logit-bias sampler (a bias of -100 or less is -inf: banned), which
llama.cpp runs on the device; `ignore_eos` adds a bias of -inf on every end-of-generation token.
On the device, a temperature chain that is otherwise plain is one `fused_dist` sampler
instead (the same steps for all sequences of a step at once, `engine/llama/fused_dist.py`).
`repeat_penalty` and OpenAI's `presence_penalty` / `frequency_penalty` are one llama.cpp
penalties sampler over the generated tokens; it has no device version, so a chain that holds
it runs on the host (llama.cpp keeps the device part of a chain only up to its first
host-only sampler). A request that asked for `logprobs` gets a chain that is never attached
(`Sampler.host`): the runner needs that sequence's raw logits on the host, which llama.cpp
only returns for sequences without a device sampler. Each such request falls back alone;
plain greedy requests beside it keep `fused_greedy`. On the device, greedy chains use
`fused_greedy` (one argmax for the whole step, `engine/llama/greedy.py`) and `ignore_eos` is
enforced differently: llama.cpp's logit bias costs every sequence three kernels and two
blocking uploads per step, so the chain runs unbiased and *guards* end tokens instead — when
one comes up, the backend rewinds that token and the sequence takes the biased chain
(`SamplerSlots.ban_eog`), which picks from the same logits with the end tokens banned. The
tokens are the same either way. `SamplerSlots` keeps each sequence id's chain attached
between requests. All calls happen on the backend's thread.

A request with a `grammar` gets llama.cpp's grammar sampler at the head of its chain (every
token outside the grammar is masked before anything else looks at the logits; once the grammar
is complete only end tokens are left, so the sequence ends there). The grammar sampler has no
device implementation, so such a chain is never attached: that sequence samples on the host
from its logits row (per-sequence fallback), and every other sequence keeps its device chain
and `fused_greedy`. Checking the whole vocabulary against a grammar costs 8–80 ms a token on
SmolLM2's 49k tokens (a loaded two-core machine), and up to a second for a grammar with a few
hundred live alternatives: that work sits between two steps of every sequence of the backend.
So a grammar chain's token is searched for (`_Search`), not found by one full pass:

- a greedy chain first checks only the row's argmax (llama.cpp's common sampler does the same);
- then candidates go to the grammar by logit rank, in stages (`STAGES`: the 64 likeliest, the
  next ones up to 1,024, the rest); when a stage ends with as many allowed tokens as the chain
  can keep (1 for greedy, `top_k` for a temperature chain with nothing between the grammar and
  its top-k), later stages cannot change the choice and are skipped. The rest of the chain then
  runs over the allowed tokens: the same token the grammar-first chain takes over the whole
  vocabulary, but inside a JSON string (every token allowed) 64 checks instead of 49k;
- the search stops at the step's `deadline` (a share of the step, set by the runner) and
  returns `PENDING`; it goes on in later steps over the logits it copied (`go_on`), its sequence
  taking no batch row meanwhile (the scheduler's `SEARCHING`), so the others' steps go on and
  the cost stays with the grammar.

The search is made here, not by `llama_sampler_sample`, so that a grammar that allows no token at all
(one asking for a character no token of the vocabulary spells, e.g. NUL) is seen: llama.cpp
would accept the token anyway and abort the process. Such a row samples `DEAD_END`, and the
backend fails that request alone.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from engine.core.request import SamplingParams

from .. import llama
from . import fused_dist, lc
from .greedy import fused_greedy

DEAD_END = -1  # `Sampler.sample` of a grammar chain whose grammar allows no token
PENDING = -2  # `Sampler.sample` of a grammar chain whose search ran past its deadline: ask again next step
# Candidates a grammar search checks first, by logit rank: the 64 likeliest, then up to the
# 1,024 likeliest, then all.
STAGES = (64, 1024)
_MIN_CHUNK = 32  # candidates checked between two looks at the deadline, at least
_MAX_CHUNK = 512  # and at most
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Sampler:
    """A sampler chain for one sequence; on the device when llama.cpp can take it there.

    `attach()` hands the chain to the context for `seq_id` (backend sampling: the token is
    chosen inside the decode graph, so the logits never leave the device); `sample()` then
    reads that token and falls back to host sampling when the backend chose none.
    """

    __slots__ = (
        "_bias",
        "_ctx",
        "_cur",
        "_grammar",
        "_n_vocab",
        "_need",
        "_one",
        "_per_candidate",
        "_search",
        "_seq",
        "_stateless",
        "_user_bias",
        "checked",
        "deferred",
        "direct",
        "dist",
        "guards_eog",
        "host",
        "key",
        "ptr",
    )

    @staticmethod
    def key_of(params: SamplingParams) -> tuple:
        """What makes two chains the same once reset (an unset seed draws anew at each reset)."""
        penalty = _penalty(params)
        extra = (params.logit_bias, params.logprobs is not None, params.grammar) if not params.plain else ()
        if params.greedy:
            return ("greedy", params.ignore_eos, penalty, *extra)
        return ("dist", params.ignore_eos, penalty, params.top_k, params.top_p, params.min_p,
                params.temperature, params.seed, *extra)

    def __init__(self, params: SamplingParams, n_vocab: int, eog_tokens: list[int], fused: bool = False,
                 dist: bool = True, vocab=None):
        """`fused`: a chain for the device: greedy takes `fused_greedy` and, for `ignore_eos`,
        no bias but `guards_eog` (the caller must not keep an end token it samples); a
        temperature chain without penalties is one `fused_dist` sampler (`dist`, whose
        uniform the runner draws before each step: `fused_dist.draw`) unless `dist` is False
        (then llama.cpp's own samplers, per sequence). `vocab` (the model's `llama_vocab`) is
        needed for a grammar."""
        grammar = None
        if params.grammar is not None:  # checked when the request came in (`Model.check_grammar`)
            grammar = lc.llama_sampler_init_grammar(vocab, params.grammar.encode("utf-8"), b"root")
            if not grammar:
                raise ValueError("llama.cpp cannot parse the request's grammar")
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        add = lambda s: lc.llama_sampler_chain_add(chain, s)  # noqa: E731
        if grammar is not None:
            add(grammar)
        penalty = _penalty(params)
        self._grammar = grammar
        self._n_vocab = n_vocab
        # Allowed tokens a search needs before later stages cannot change the choice: with
        # nothing between the grammar and the argmax (greedy) or the top-k, those keep only the
        # likeliest; a bias or a penalty reorders the candidates, so then all of them.
        untouched = penalty is None and not params.logit_bias and not params.ignore_eos
        if untouched and params.greedy:
            self._need = 1
        elif untouched and 0 < params.top_k < n_vocab:
            self._need = params.top_k
        else:
            self._need = n_vocab
        self._one = (lc.llama_token_data * 1)() if grammar is not None else None
        self._cur = np.zeros(n_vocab, _TOKEN_DATA) if grammar is not None else None  # a search's candidates
        self._search: _Search | None = None
        self._per_candidate = 0.0  # seconds one candidate's grammar check took, recently
        self.checked = 0  # candidates checked against the grammar (all tokens)
        self.deferred = 0  # searches that ran past their step's deadline
        self.dist = (fused_dist.fused_dist(params, n_vocab, eog_tokens)
                     if fused and dist and fused_dist.supports(params) else None)
        # fused_greedy takes its argmax over the step's raw logits: a bias, a penalty or a
        # grammar would not be seen, so only plain greedy chains take it (fused_dist.supports
        # says the same of temperature chains).
        fused = fused and ((params.greedy and params.plain) or self.dist is not None)
        self.key = self.key_of(params)
        self.guards_eog = fused and params.greedy and params.ignore_eos
        self._stateless = fused and penalty is None  # nothing in it keeps history
        # never attached: the runner reads its logits (logprobs), or the grammar has no device form
        self.host = params.logprobs is not None or grammar is not None
        self._bias = self._user_bias = None
        self._ctx = None
        self._seq = -1
        # Attached and stateless: its token is read straight from the context, and nothing
        # is accepted (the runner's per-row fast path; `sample` does the same, one call deeper).
        self.direct = False
        if params.logit_bias:
            self._user_bias = (lc.llama_logit_bias * len(params.logit_bias))(
                *[lc.llama_logit_bias(t, float("-inf") if b <= -100 else b) for t, b in params.logit_bias]
            )
            add(lc.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), self._user_bias))
        if params.ignore_eos and eog_tokens and not fused:  # (`dist` bans end tokens itself)
            self._bias = (lc.llama_logit_bias * len(eog_tokens))(
                *[lc.llama_logit_bias(t, float("-inf")) for t in eog_tokens]
            )
            add(lc.llama_sampler_init_logit_bias(n_vocab, len(eog_tokens), self._bias))
        if penalty is not None:
            add(lc.llama_sampler_init_penalties(n_vocab, *penalty))
        if params.greedy:
            add(fused_greedy() if fused else lc.llama_sampler_init_greedy())
        elif self.dist is not None:
            add(self.dist.ptr)
        else:
            fused_dist.add_temperature_chain(add, params, n_vocab)
        self.ptr = chain

    def attach(self, ctx, seq_id: int) -> bool:
        """Sample `seq_id` on the device from now on; False if llama.cpp keeps it on the host
        (or the chain is a `host` one — logprobs or a grammar — which is never attached)."""
        if not self.host and lc.llama_set_sampler(ctx, seq_id, self.ptr):
            self._ctx, self._seq = ctx, seq_id
            self.direct = self._stateless
            return True
        return False

    def on_device(self) -> bool:
        return self._ctx is not None

    def sample(self, ctx, row: int, deadline: float | None = None) -> int:
        """The token chosen for output row `row` of the last decode (the caller synchronised
        the context after it); the chain accepts it. A grammar chain may instead return
        `DEAD_END`, or `PENDING` once `perf_counter()` passes `deadline` (the caller decodes
        the same input again and asks again: the search goes on over the first logits)."""
        if self._ctx is not None:
            tok = llama.sampled_token_after_sync(ctx, row)  # both keep the GIL (engine/llama/__init__.py, holding_gil)
            if tok != lc.LLAMA_TOKEN_NULL:
                if not self._stateless:
                    llama.sampler_accept(self.ptr, tok)
                return tok
        if self._grammar is not None:
            return self._constrained(ctx, row, deadline)
        return lc.llama_sampler_sample(self.ptr, ctx, row)

    def go_on(self, deadline: float | None) -> int:
        """Go on with the search under way (over the logits it copied; no decode since): the
        token, accepted, `DEAD_END` or `PENDING` again."""
        if self._search is None:
            raise RuntimeError("no grammar search is under way on this chain")
        return self._constrained(None, -1, deadline)

    def _constrained(self, ctx, row: int, deadline: float | None) -> int:
        """A grammar chain's token (accepted), `DEAD_END` or `PENDING`: what
        `llama_sampler_sample` does (candidates from the row's logits, the chain, accept), but
        searched for by stages (module doc), never accepting a token the grammar refused."""
        search = self._search
        if search is None:
            ptr = lc.llama_get_logits_ith(ctx, row)
            if not ptr:
                raise RuntimeError(f"llama.cpp has no logits for output row {row}")
            logits = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
            if self._need == 1:
                tok = self._allowed_argmax(logits)
                if tok is not None:
                    llama.sampler_accept(self.ptr, tok)
                    return tok
            search = self._search = _Search(logits.copy(), self._need)
        first = True  # each call checks one chunk at least, whatever the deadline
        last = STAGES[0] // 2  # the last chunk's size
        while not search.done:
            todo = search.todo()
            if deadline is None:
                k = len(todo)
            else:
                left = deadline - time.perf_counter()
                if left <= 0 and not first:
                    self.deferred += 1
                    return PENDING
                # A candidate's check costs from nothing (its first character fits no stack) to
                # the grammar's whole width (50 us here, 256 alternatives): chunks grow at most
                # twofold up to `_MAX_CHUNK`, the estimate rises at once and falls slowly, and
                # the last stage goes in a shuffled order, so that a chunk costs about its
                # share of the whole.
                k = int(left / self._per_candidate) if self._per_candidate > 0 and left > 0 else 0
                k = min(max(k, _MIN_CHUNK), 2 * last, _MAX_CHUNK, len(todo))
            first = False
            t0 = time.perf_counter()
            search.took(todo[:k], self._check(todo[:k]))
            if k:
                last = k
                self._per_candidate = max((time.perf_counter() - t0) / k, 0.9 * self._per_candidate)
        self._search = None
        return self._choose(search)

    def _candidates(self, k: int) -> np.ndarray:
        """The first `k` entries of this grammar chain's candidate buffer."""
        if self._cur is None:
            raise RuntimeError("this chain has no grammar to search with")
        return self._cur[:k]

    def _check(self, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` the grammar allows next (a bool per id)."""
        k = len(ids)
        if not k:
            return np.zeros(0, bool)
        cur = self._candidates(k)
        cur["id"] = ids
        cur["logit"] = 0.0
        arr = lc.llama_token_data_array(cur.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), k, -1, False)
        lc.llama_sampler_apply(self._grammar, ctypes.byref(arr))  # sets refused ones to -inf, in place
        self.checked += k
        return cur["logit"] != float("-inf")

    def _choose(self, search: _Search) -> int:
        """The rest of the chain (after the grammar) over the tokens `search` found allowed,
        likeliest first; the token, accepted, or `DEAD_END` when there is none."""
        ids = search.allowed()
        k = len(ids)
        if not k:
            return DEAD_END
        cur = self._candidates(k)
        cur["id"] = ids
        cur["logit"] = search.logits[ids]
        cur["p"] = 0.0
        arr = lc.llama_token_data_array(cur.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), k, -1, False)
        for i in range(1, lc.llama_sampler_chain_n(self.ptr)):  # 0 is the grammar: done
            lc.llama_sampler_apply(lc.llama_sampler_chain_get(self.ptr, i), ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size or arr.data[arr.selected].logit == float("-inf"):
            return DEAD_END
        tok = int(arr.data[arr.selected].id)
        llama.sampler_accept(self.ptr, tok)
        return tok

    def _allowed_argmax(self, logits) -> int | None:
        """The row's argmax if the grammar allows it next (then it is what grammar → greedy
        would choose: both take the first maximum), else None."""
        tok = int(logits.argmax())
        one = self._one
        if one is None:
            raise RuntimeError("this chain has no grammar of its own to check the argmax with")
        one[0] = lc.llama_token_data(tok, 0.0, 0.0)
        lc.llama_sampler_apply(self._grammar, ctypes.byref(lc.llama_token_data_array(one, 1, -1, False)))
        return tok if one[0].logit != float("-inf") else None

    def reset(self) -> None:
        """Forget the previous request: penalty history, a search under way, and a fresh draw
        of an unset seed."""
        self._search = None
        lc.llama_sampler_reset(self.ptr)

    def accept(self, tokens) -> None:
        """Replay tokens chosen before this chain took over (penalty history)."""
        for t in tokens:
            llama.sampler_accept(self.ptr, t)

    def free(self, detach: bool = True) -> None:
        """Free the chain, detaching it from the context first unless `detach` is False (the
        context is gone, or another chain already took its sequence id)."""
        if self._ctx is not None and detach:
            lc.llama_set_sampler(self._ctx, self._seq, None)
        self._ctx = None
        self.direct = False
        if self.ptr:
            lc.llama_sampler_free(self.ptr)  # the grammar with it: the chain owns its samplers
            self.ptr = None
            self._grammar = None


class _Search:
    """One grammar token's search, possibly over several steps: the logits it ranks by (a
    copy: the row is gone after the step), the stage it is in and the allowed tokens so far."""

    __slots__ = ("_found", "_pos", "_seen", "_stages", "_todo", "done", "logits", "need")

    def __init__(self, logits: np.ndarray, need: int):
        self.logits = logits
        self.need = need
        n = len(logits)
        # rank bounds of each stage; a chain that needs every allowed token takes one stage
        self._stages = [k for k in STAGES if k < n and need < k] + [n]
        self._todo: np.ndarray | None = None
        self._pos = 0
        self._found: list[np.ndarray] = []
        self._seen: np.ndarray | None = None  # ids of the stages before this one
        self.done = False

    def todo(self) -> np.ndarray:
        """The current stage's ids not yet checked."""
        return self._stage()[self._pos:]

    def took(self, ids: np.ndarray, allowed: np.ndarray) -> None:
        """The grammar's answer for the first `len(ids)` of `todo()`."""
        self._found.append(ids[allowed])
        self._pos += len(ids)
        if self._pos >= len(self._stage()):
            found = sum(len(f) for f in self._found)
            if found >= self.need or not self._stages:
                self.done = True
            else:
                self._todo = None

    def allowed(self) -> np.ndarray:
        """The allowed ids, likeliest first (ties: the lower id first, as llama.cpp's greedy),
        at most `need` of them."""
        ids = np.concatenate(self._found) if self._found else np.zeros(0, np.int32)
        order = np.lexsort((ids, -self.logits[ids]))
        return ids[order[:self.need]]

    def _stage(self) -> np.ndarray:
        if self._todo is None:
            self._next_stage()
        assert self._todo is not None  # set by _next_stage
        return self._todo

    def _next_stage(self) -> None:
        bound = self._stages.pop(0)
        n = len(self.logits)
        ids = _shuffled(n) if bound >= n else np.argpartition(-self.logits, bound - 1)[:bound].astype(np.int32)
        if self._seen is not None:
            ids = ids[~np.isin(ids, self._seen, assume_unique=True)]
            seen = np.concatenate((self._seen, ids))
        else:
            seen = ids
        self._seen = seen if self._stages else None
        self._todo, self._pos = ids, 0


_SHUFFLED: dict[int, np.ndarray] = {}


def _shuffled(n: int) -> np.ndarray:
    """The ids 0..n-1 in a fixed shuffled order (made once per vocabulary size)."""
    ids = _SHUFFLED.get(n)
    if ids is None:
        ids = _SHUFFLED[n] = np.random.default_rng(0).permutation(n).astype(np.int32)
    return ids


def _penalty(params: SamplingParams) -> tuple | None:
    """llama.cpp penalties' (last_n, repeat, frequency, presence), or None when all are off.
    OpenAI's penalties count every generated token: their window is the request's budget
    (at most `PENALTY_WINDOW`), or `repeat_last_n` if that is longer."""
    openai = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    if params.repeat_penalty == 1.0 and not openai:
        return None
    last_n = max(params.repeat_last_n, min(params.max_tokens, PENALTY_WINDOW)) if openai else params.repeat_last_n
    return (last_n, params.repeat_penalty, params.frequency_penalty, params.presence_penalty)


PENALTY_WINDOW = 4096  # tokens; llama.cpp keeps a ring buffer of this many per chain


class SamplerSlots:
    """One chain per sequence id, kept attached after its request ends, up to the cap.

    Attaching or detaching a device sampler makes llama.cpp re-reserve its compute graph
    before the next decode (measured on the GPU: tens of ms, a stall of every running
    sequence), and a graph can only be reused from step to step while the set of attached
    chains stays the same. So an id keeps its chain when its request ends, and the next request
    with the same settings (`Sampler.key_of`) that lands on that id resets and reuses it
    (`idle_ids` lets the backend steer it there); when a request does need a new chain,
    `prepare` attaches the same chain to more free ids in the same reserve, so a burst
    ramping up to the cap pays one reserve, not one per sequence. Idle chains are not free
    either (each still adds a little to a GPU step: 32 idle ones cost batch-1 decode 30 %), so
    `trim` keeps at most the cap's worth, and none that sat idle for `idle_s` seconds — a
    burst keeps its chains, a chat after it gets its speed back.

    Temperature requests take the fused sampler (`fused_dist`) only once `fused_dist_from` of
    them run (this one and those admitted with it included), or when they carry a seed (one RNG, so a seed reproduces
    alone or batched); below that, llama.cpp's chain per sequence. The chains are faster for
    one sequence, the fused sampler from a few on (`run.sh topk_stages` measures both against
    greedy, docs/performance.md), so the default is 2.
    A request keeps the kind it was admitted with; an idle chain is reused only by a request
    that wants its kind.
    """

    def __init__(self, n_vocab: int, eog_tokens: list[int], on_device: bool, idle_s: float = 2.0,
                 fused: bool = True, n_ids: int = 0, fused_dist_from: int = 2, vocab=None):
        self.n_ids = n_ids  # sequence ids of the context
        self._vocab = vocab
        self._n_vocab = n_vocab
        self._vocab = vocab
        self._eog = eog_tokens
        self.on_device = on_device
        self.fused = on_device and fused  # greedy chains take `fused_greedy` (engine/llama/greedy.py)
        self._slots: dict[int, Sampler] = {}
        self._idle_since: dict[int, float] = {}  # ids whose chain no request uses: since when
        self.idle_s = idle_s
        self.attaches = 0  # chains handed to the context (each costs llama.cpp a graph reserve)
        # ids whose running request samples with `fused_dist`: while none, a step draws no
        # uniforms and makes no per-row Python call for them (the runner asks `fused_busy`)
        self._fused_ids: set[int] = set()
        self.fused_dist_from = fused_dist_from
        self._temperature_ids: set[int] = set()  # ids whose running request samples at a temperature
        self.grammar_checks = 0  # candidates grammar chains checked, counted as their requests end

    @property
    def fused_busy(self) -> bool:
        """Whether a running request samples with a fused temperature chain (`Sampler.dist`)."""
        return bool(self._fused_ids)

    @property
    def attached(self) -> int:
        return sum(1 for s in self._slots.values() if s.on_device())

    def idle_ids(self, params: SamplingParams) -> list[int]:
        """Ids whose idle chain a request with `params` would reuse as it is; for a request
        whose chain stays on the host (`logprobs`), also ids with no chain at all (taking
        one with an attached chain would detach it: a graph reserve)."""
        key, dist = Sampler.key_of(params), self._wants_dist(params)
        same = [i for i in self._idle_since if self._slots[i].key == key and (self._slots[i].dist is not None) == dist]
        if params.logprobs is not None and self.on_device:
            same += [i for i in range(self.n_ids) if i not in self._slots]
        return same

    def _wants_dist(self, params: SamplingParams, alongside: int = 0) -> bool:
        """Whether a new chain for `params` should be a fused one (see the class doc);
        `alongside`: temperature requests admitted with it that have no chain yet."""
        if not self.fused or params.greedy or not fused_dist.supports(params):
            return False
        return params.seed is not None or len(self._temperature_ids) + 1 + alongside >= self.fused_dist_from

    def acquire(self, ctx, seq_id: int, params: SamplingParams, alongside: int = 0) -> Sampler:
        """The chain for the request about to run on `seq_id`, reset or newly attached;
        `alongside`: temperature requests admitted with it that are still to acquire theirs."""
        self._idle_since.pop(seq_id, None)
        self._temperature_ids.discard(seq_id)
        dist = self._wants_dist(params, alongside)
        old = self._slots.get(seq_id)
        if old is not None and old.key == Sampler.key_of(params) and (old.dist is not None) == dist:
            old.reset()
            chain = old
        else:
            chain = self._replace(ctx, seq_id, self._chain(params, dist))
        if not params.greedy:
            self._temperature_ids.add(seq_id)
        if chain.dist is not None:
            self._fused_ids.add(seq_id)
        else:
            self._fused_ids.discard(seq_id)
        return chain

    def ban_eog(self, ctx, seq_id: int, params: SamplingParams, accepted) -> Sampler:
        """Swap `seq_id`'s guarding chain for one that bans end tokens (logit bias), with the
        request's `accepted` tokens replayed into it."""
        new = self._replace(ctx, seq_id, Sampler(params, self._n_vocab, self._eog, vocab=self._vocab))
        self._fused_ids.discard(seq_id)
        new.accept(accepted)
        return new

    def _chain(self, params: SamplingParams, dist: bool = True) -> Sampler:
        return Sampler(params, self._n_vocab, self._eog, self.fused, dist, vocab=self._vocab)

    def _replace(self, ctx, seq_id: int, new: Sampler) -> Sampler:
        old = self._slots.get(seq_id)
        if self.on_device and not new.host:
            new.attach(ctx, seq_id)  # replaces the old chain for this id in one reserve
            self.attaches += 1
        elif old is not None and old.on_device():
            lc.llama_set_sampler(ctx, seq_id, None)  # a host chain: the id must have none
        if old is not None:
            old.free(detach=False)  # llama.cpp already dropped it (for `new`, or just above)
        self._slots[seq_id] = new
        return new

    def prepare(self, ctx, seq_ids, params: SamplingParams) -> int:
        """Attach a chain for `params` to each of `seq_ids` that has none; returns how many."""
        n = 0
        if not params.plain:  # a burst of plain requests is what the extra chains are for
            return 0
        dist = self._wants_dist(params)
        for i in seq_ids:
            if i not in self._slots:
                s = self._chain(params, dist)
                s.attach(ctx, i)
                self._slots[i] = s
                self._idle_since[i] = time.monotonic()
                self.attaches += 1
                n += 1
        return n

    def release(self, seq_id: int) -> None:
        """The request on `seq_id` ended; its chain stays, idle."""
        self._fused_ids.discard(seq_id)
        self._temperature_ids.discard(seq_id)
        if seq_id in self._slots:
            self._idle_since[seq_id] = time.monotonic()
            chain = self._slots[seq_id]
            self.grammar_checks += chain.checked
            chain.checked = 0

    def expires_in(self, now: float) -> float | None:
        """Seconds until the oldest idle chain is due for `trim`; None when none is idle."""
        if not self._idle_since:
            return None
        return min(self._idle_since.values()) + self.idle_s - now

    def trim(self, limit: int, now: float | None = None) -> int:
        """Detach idle chains that sat idle `idle_s` seconds, then more, highest ids first,
        until at most `limit` are attached (one reserve for all of them); returns how many."""
        if not self._idle_since:
            return 0
        now = time.monotonic() if now is None else now
        if len(self._slots) <= limit and min(self._idle_since.values()) + self.idle_s > now:
            return 0  # the common case, once per step: nothing to do
        idle = sorted(self._idle_since, reverse=True)
        stale = {i for i in idle if now - self._idle_since[i] >= self.idle_s}
        excess = len(self._slots) - len(stale) - limit
        going = stale | set([i for i in idle if i not in stale][:max(excess, 0)])
        for i in going:
            self._slots.pop(i).free()
            del self._idle_since[i]
        return len(going)

    def close(self) -> None:
        """Free every chain; call after the context is freed (nothing to detach from)."""
        for s in self._slots.values():
            s.free(detach=False)
        self._slots.clear()
        self._idle_since.clear()
        self._fused_ids.clear()
        self._temperature_ids.clear()
