"""llama.cpp sampler chains built from `SamplingParams`, one per sequence.

Greedy (temperature 0) is the `greedy` sampler after optional penalties; otherwise
penalties → top-k → top-p → min-p → temperature → seeded distribution. `ignore_eos` adds a
logit bias of -inf on every end-of-generation token. On the device, greedy chains use
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
SmolLM2's 49k tokens (a loaded two-core machine), so a greedy grammar chain first checks only
the row's argmax (llama.cpp's common sampler does the same): when the grammar allows it, it is
the token the whole chain would choose; only a refused one costs the full pass. The full pass
is made here, not by `llama_sampler_sample`, so that a grammar that allows no token at all
(one asking for a character no token of the vocabulary spells, e.g. NUL) is seen: llama.cpp
would accept the token anyway and abort the process. Such a row samples `DEAD_END`, and the
backend fails that request alone.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from .. import llama
from ..request import SamplingParams
from . import lc
from .greedy import fused_greedy

DEAD_END = -1  # `Sampler.sample` of a grammar chain whose grammar allows no token
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Sampler:
    """A sampler chain for one sequence; on the device when llama.cpp can take it there.

    `attach()` hands the chain to the context for `seq_id` (backend sampling: the token is
    chosen inside the decode graph, so the logits never leave the device); `sample()` then
    reads that token and falls back to host sampling when the backend chose none.
    """

    __slots__ = ("ptr", "key", "guards_eog", "direct", "host_only", "_stateless", "_bias", "_ctx", "_seq",
                 "_grammar", "_one", "_n_vocab", "_cur")

    @staticmethod
    def key_of(params: SamplingParams) -> tuple:
        """What makes two chains the same once reset (an unset seed draws anew at each reset)."""
        penalty = (params.repeat_penalty, params.repeat_last_n) if params.repeat_penalty != 1.0 else None
        if params.greedy:
            return ("greedy", params.ignore_eos, penalty, params.grammar)
        return ("dist", params.ignore_eos, penalty, params.top_k, params.top_p, params.min_p,
                params.temperature, params.seed, params.grammar)

    def __init__(self, params: SamplingParams, n_vocab: int, eog_tokens: list[int], fused: bool = False,
                 vocab=None):
        """`fused`: a greedy chain for the device, with `fused_greedy` and, for `ignore_eos`,
        no bias but `guards_eog` (the caller must not keep an end token it samples). `vocab`
        (the model's `llama_vocab`) is needed for a grammar."""
        self.host_only = params.grammar is not None
        grammar = None
        if self.host_only:  # checked when the request came in (`grammar.check`); built before the chain
            grammar = lc.llama_sampler_init_grammar(vocab, params.grammar.encode("utf-8"), b"root")
            if not grammar:
                raise ValueError("llama.cpp cannot parse the request's grammar")
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        add = lambda s: lc.llama_sampler_chain_add(chain, s)  # noqa: E731
        if grammar is not None:
            add(grammar)
        # Greedy with nothing between the grammar and the argmax: the argmax, if the grammar
        # allows it, is the chain's own choice (`_allowed_argmax`).
        plain_greedy = params.greedy and params.repeat_penalty == 1.0
        self._grammar = grammar if plain_greedy else None
        self._one = (lc.llama_token_data * 1)() if plain_greedy else None
        self._n_vocab = n_vocab
        self._cur = np.zeros(n_vocab, _TOKEN_DATA) if self.host_only else None  # the full pass's candidates
        fused = fused and params.greedy and not self.host_only
        self.key = self.key_of(params)
        self.guards_eog = fused and params.ignore_eos
        self._stateless = fused and params.repeat_penalty == 1.0  # nothing in it keeps history
        self._bias = None
        self._ctx = None
        self._seq = -1
        # Attached and stateless: its token is read straight from the context, and nothing
        # is accepted (the runner's per-row fast path; `sample` does the same, one call deeper).
        self.direct = False
        if params.ignore_eos and eog_tokens and not fused:
            self._bias = (lc.llama_logit_bias * len(eog_tokens))(
                *[lc.llama_logit_bias(t, float("-inf")) for t in eog_tokens]
            )
            add(lc.llama_sampler_init_logit_bias(n_vocab, len(eog_tokens), self._bias))
        if params.repeat_penalty != 1.0:
            add(lc.llama_sampler_init_penalties(n_vocab, params.repeat_last_n, params.repeat_penalty, 0.0, 0.0))
        if params.greedy:
            add(fused_greedy() if fused else lc.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                add(lc.llama_sampler_init_top_k(min(params.top_k, n_vocab)))
            if params.top_p < 1.0:
                add(lc.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                add(lc.llama_sampler_init_min_p(params.min_p, 1))
            add(lc.llama_sampler_init_temp(params.temperature))
            add(lc.llama_sampler_init_dist(params.seed if params.seed is not None else lc.LLAMA_DEFAULT_SEED))
        self.ptr = chain

    def attach(self, ctx, seq_id: int) -> bool:
        """Sample `seq_id` on the device from now on; False if llama.cpp keeps it on the host."""
        if not self.host_only and lc.llama_set_sampler(ctx, seq_id, self.ptr):
            self._ctx, self._seq = ctx, seq_id
            self.direct = self._stateless
            return True
        return False

    def on_device(self) -> bool:
        return self._ctx is not None

    def sample(self, ctx, row: int) -> int:
        """The token chosen for output row `row` of the last decode (the caller synchronised
        the context after it); the chain accepts it."""
        if self._ctx is not None:
            tok = llama.sampled_token_after_sync(ctx, row)  # both keep the GIL (engine/llama.py)
            if tok != lc.LLAMA_TOKEN_NULL:
                if not self._stateless:
                    llama.sampler_accept(self.ptr, tok)
                return tok
        if self.host_only:
            return self._constrained(ctx, row)
        return lc.llama_sampler_sample(self.ptr, ctx, row)

    def _constrained(self, ctx, row: int) -> int:
        """A grammar chain's token (accepted), or `DEAD_END`: what `llama_sampler_sample`
        does (candidates from the row's logits, the chain, accept), but never accepting a
        token the grammar refused."""
        ptr = lc.llama_get_logits_ith(ctx, row)
        if not ptr:
            raise RuntimeError(f"llama.cpp has no logits for output row {row}")
        logits = np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))
        if self._grammar is not None:
            tok = self._allowed_argmax(logits)
            if tok is not None:
                llama.sampler_accept(self.ptr, tok)
                return tok
        cur = self._cur
        cur["id"] = np.arange(self._n_vocab, dtype=np.int32)  # the chain reorders them in place
        cur["logit"] = logits
        cur["p"] = 0.0
        data = cur.ctypes.data_as(ctypes.POINTER(lc.llama_token_data))
        arr = lc.llama_token_data_array(data, self._n_vocab, -1, False)
        lc.llama_sampler_apply(self.ptr, ctypes.byref(arr))
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
        one[0] = lc.llama_token_data(tok, 0.0, 0.0)
        lc.llama_sampler_apply(self._grammar, ctypes.byref(lc.llama_token_data_array(one, 1, -1, False)))
        return tok if one[0].logit != float("-inf") else None

    def reset(self) -> None:
        """Forget the previous request: penalty history, and a fresh draw of an unset seed."""
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
    """

    def __init__(self, n_vocab: int, eog_tokens: list[int], on_device: bool, idle_s: float = 2.0,
                 fused: bool = True, vocab=None):
        self._n_vocab = n_vocab
        self._vocab = vocab
        self._eog = eog_tokens
        self.on_device = on_device
        self.fused = on_device and fused  # greedy chains take `fused_greedy` (engine/llama/greedy.py)
        self._slots: dict[int, Sampler] = {}
        self._idle_since: dict[int, float] = {}  # ids whose chain no request uses: since when
        self.idle_s = idle_s
        self.attaches = 0  # chains handed to the context (each costs llama.cpp a graph reserve)

    @property
    def attached(self) -> int:
        return sum(1 for s in self._slots.values() if s.on_device())

    def idle_ids(self, params: SamplingParams) -> list[int]:
        """Ids whose idle chain a request with `params` would reuse as it is."""
        key = Sampler.key_of(params)
        return [i for i in self._idle_since if self._slots[i].key == key]

    def acquire(self, ctx, seq_id: int, params: SamplingParams) -> Sampler:
        """The chain for the request about to run on `seq_id`, reset or newly attached."""
        self._idle_since.pop(seq_id, None)
        old = self._slots.get(seq_id)
        if old is not None and old.key == Sampler.key_of(params):
            old.reset()
            return old
        return self._replace(ctx, seq_id, self._chain(params))

    def ban_eog(self, ctx, seq_id: int, params: SamplingParams, accepted) -> Sampler:
        """Swap `seq_id`'s guarding chain for one that bans end tokens (logit bias), with the
        request's `accepted` tokens replayed into it."""
        new = self._replace(ctx, seq_id, Sampler(params, self._n_vocab, self._eog, vocab=self._vocab))
        new.accept(accepted)
        return new

    def _chain(self, params: SamplingParams) -> Sampler:
        return Sampler(params, self._n_vocab, self._eog, self.fused, vocab=self._vocab)

    def _replace(self, ctx, seq_id: int, new: Sampler) -> Sampler:
        old = self._slots.get(seq_id)
        attached = self.on_device and new.attach(ctx, seq_id)  # replaces the old chain in one reserve
        if attached:
            self.attaches += 1
        if old is not None:
            # llama.cpp already dropped it for `new`, unless `new` stays on the host (a grammar)
            old.free(detach=not attached)
        self._slots[seq_id] = new
        return new

    def prepare(self, ctx, seq_ids, params: SamplingParams) -> int:
        """Attach a chain for `params` to each of `seq_ids` that has none; returns how many."""
        n = 0
        if params.grammar is not None:  # host-only chains are never attached
            return 0
        for i in seq_ids:
            if i not in self._slots:
                s = self._chain(params)
                s.attach(ctx, i)
                self._slots[i] = s
                self._idle_since[i] = time.monotonic()
                self.attaches += 1
                n += 1
        return n

    def release(self, seq_id: int) -> None:
        """The request on `seq_id` ended; its chain stays, idle."""
        if seq_id in self._slots:
            self._idle_since[seq_id] = time.monotonic()

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
