"""llama.cpp sampler chains built from `SamplingParams`, one per sequence.

Greedy (temperature 0) is the `greedy` sampler after optional penalties; otherwise
penalties → top-k → top-p → min-p → temperature → seeded distribution. `ignore_eos` adds a
logit bias of -inf on every end-of-generation token. The chain is owned by the caller and
freed with `free()`; all calls happen on the backend's thread.
"""

from __future__ import annotations

import random

from .llama import lc
from .request import SamplingParams


class Sampler:
    """A sampler chain for one sequence; on the device when llama.cpp can take it there.

    `attach()` hands the chain to the context for `seq_id` (backend sampling: the token is
    chosen inside the decode graph, so the logits never leave the device); `sample()` then
    reads that token and falls back to host sampling when the backend chose none.
    """

    __slots__ = ("ptr", "_bias", "_ctx", "_seq")

    def __init__(self, params: SamplingParams, n_vocab: int, eog_tokens: list[int]):
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        add = lambda s: lc.llama_sampler_chain_add(chain, s)  # noqa: E731
        self._bias = None
        self._ctx = None
        self._seq = -1
        if params.ignore_eos and eog_tokens:
            self._bias = (lc.llama_logit_bias * len(eog_tokens))(
                *[lc.llama_logit_bias(t, float("-inf")) for t in eog_tokens]
            )
            add(lc.llama_sampler_init_logit_bias(n_vocab, len(eog_tokens), self._bias))
        if params.repeat_penalty != 1.0:
            add(lc.llama_sampler_init_penalties(n_vocab, params.repeat_last_n, params.repeat_penalty, 0.0, 0.0))
        if params.greedy:
            add(lc.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                add(lc.llama_sampler_init_top_k(min(params.top_k, n_vocab)))
            if params.top_p < 1.0:
                add(lc.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                add(lc.llama_sampler_init_min_p(params.min_p, 1))
            add(lc.llama_sampler_init_temp(params.temperature))
            seed = params.seed if params.seed is not None else random.getrandbits(32)
            add(lc.llama_sampler_init_dist(seed))
        self.ptr = chain

    def attach(self, ctx, seq_id: int) -> bool:
        """Sample `seq_id` on the device from now on; False if llama.cpp keeps it on the host."""
        if lc.llama_set_sampler(ctx, seq_id, self.ptr):
            self._ctx, self._seq = ctx, seq_id
            return True
        return False

    def sample(self, ctx, row: int) -> int:
        """The token chosen for output row `row` of the last decode; the chain accepts it."""
        if self._ctx is not None:
            tok = lc.llama_get_sampled_token_ith(ctx, row)
            if tok != lc.LLAMA_TOKEN_NULL:
                lc.llama_sampler_accept(self.ptr, tok)
                return tok
        return lc.llama_sampler_sample(self.ptr, ctx, row)

    def free(self) -> None:
        """Detach from the context (if attached) and free the chain."""
        if self._ctx is not None:
            lc.llama_set_sampler(self._ctx, self._seq, None)
            self._ctx = None
        if self.ptr:
            lc.llama_sampler_free(self.ptr)
            self.ptr = None
