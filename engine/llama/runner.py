"""The llama.cpp side of a backend: one context, and the plans the scheduler makes run on it.

`ContextRunner` owns a `llama_context`, its `Batch` (engine/llama/batch.py) and the sampler chains
(`SamplerSlots`, engine/llama/sampling.py). It applies the scheduler's `KvOp`s
(`llama_memory_seq_cp` / `seq_rm`), turns a `Plan` into one batch (decode rows first, then
prompt chunks; only a chunk that ends its prompt asks for logits), decodes it and samples each
row that asked: the token, or None where a chain that guards end tokens (`ignore_eos` on the
device) sampled one — the runner switches that sequence to a chain that bans them, and the
scheduler decodes the same input again.

A sequence whose request asked for `logprobs` samples on the host (`Sampler.host`: its id has
no device chain, so llama.cpp returns its logits): after the decode the runner reads that row's
raw logits (`llama_get_logits_ith`, a view, no copy) and takes their log-softmax with numpy —
the chosen token's logprob and the top alternatives (`TokenLogprob`), in `RunnerOutput.logprobs`
by output row. Other sequences of the same step keep their device chains.

The hot path is the decode: nothing here adds per-token Python work beyond the batch's writes
(three list assignments for 8 rows or more), the sampled tokens' read (the decode rows' device
tokens in one read from `BULK_READ_FROM` rows on, else one per row; the token of an attached
stateless chain, `Sampler.direct`, is taken in the loop itself) and, while fused
temperature chains run, one uniform per sampled row drawn before the step and uploaded in one
copy (`fused_dist.draw`); a step with no running fused chain makes no per-row call for them,
even while idle ones stay attached (`SamplerSlots.fused_busy`). While the device
runs a step, the `during` callback (the previous step's text and the Outbox flush,
engine/backends/local.py) runs between `llama_decode`, which releases the GIL, and
`llama_synchronize`.

Thread contract: everything runs on the backend's worker thread, except the read-only counters
(`graphs_reused`, `sampler_attaches`, `samplers_attached`) and `gaps`, which any thread may read
(`gaps` while the worker is idle).
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass

import numpy as np

from engine.core.errors import BackendUnavailable
from engine.core.request import TokenLogprob
from engine.sched.scheduler import SEARCHING, KvOp, Plan, SeqState

from .. import llama
from . import fused_dist, lc
from .batch import Batch
from .model import Model
from .sampling import DEAD_END, PENDING, SamplerSlots

# From this many decode rows on, their tokens are read in one go (`llama.sampled_tokens_after_sync`):
# one by one cost 0.4 us a row, at once 1.2 us for any number (128 rows: 51 vs 1.3 us a step;
# 2-core dev machine).
BULK_READ_FROM = 3
# A step's grammar searches (host sampling of constrained sequences, engine/llama/sampling.py)
# stop at this share of the step's decode time, or at the floor, whichever is longer; a search
# not done by then goes on at the next step (`SEARCH_SLICE_S` below). The share is
# what the searches may delay every other sequence of the step: two 128-value enum schemas at
# temperature 1 beside two chats held the chats' p95 at 2.14x quiet with a quarter, 1.63x with
# a tenth (`tandem bench attack`, docs/security.md). A step of constrained sequences alone
# delays nobody, and its searches may take `GRAMMAR_ALONE_SHARE`.
GRAMMAR_SHARE = 0.1
GRAMMAR_ALONE_SHARE = 1.0
GRAMMAR_FLOOR_S = 0.0005
# A search that runs past its share goes on in later steps over the logits it has, its sequence
# taking no row meanwhile (`SEARCHING`; a request with logprobs decodes its input again instead,
# as the logprobs are read from the row). A step with nothing to decode gives the searches this
# slice of host time, so a request that arrives meanwhile is admitted within it.
SEARCH_SLICE_S = 0.01

_FLASH = {"auto": lc.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": lc.LLAMA_FLASH_ATTN_TYPE_ENABLED,
          "off": lc.LLAMA_FLASH_ATTN_TYPE_DISABLED}


@dataclass(slots=True)
class RunnerOutput:
    """One executed plan: `rc` is llama_decode's (0: done; 1: no KV room; else a failure)."""

    rc: int
    sampled: list  # token per logits row (decode rows, then prompt ends), None: taken back
    n_decode: int
    n_prefill: int
    seconds: float  # inside llama_decode, plus the device sync
    logprobs: dict | None = None  # index in `sampled` -> TokenLogprob, for rows that asked


class ContextRunner:
    """A llama.cpp context with its batch and sampler chains (worker thread only)."""

    def __init__(self, config, model: Model, name: str):
        c = config
        self.model = model
        p = lc.llama_context_default_params()
        train = model.n_ctx_train
        # Unified KV: every sequence draws its cells from one pool, so the pool may exceed the
        # training context (only a sequence's own positions may not: n_ctx_seq below). With
        # 16 tenants of 1,550-token prefixes beside 32 running requests, a pool clamped to the
        # 32k training context evicted and recomputed prefixes (more than twice the prompt
        # tokens computed that were needed). Split KV: a stream each.
        p.n_ctx = c.n_ctx if c.kv_unified or train <= 0 else min(c.n_ctx, train * c.n_seq_max)
        p.n_batch = c.n_batch
        p.n_ubatch = min(c.n_ubatch, c.n_batch)
        p.n_seq_max = c.n_seq_max
        p.n_threads = c.threads
        p.n_threads_batch = c.threads_batch
        p.kv_unified = c.kv_unified
        p.flash_attn_type = _FLASH[c.flash_attn]
        p.no_perf = True
        if model.device == "cpu":
            p.offload_kqv = False
            p.op_offload = False
        self.ctx = lc.llama_init_from_model(model.ptr, p)
        if not self.ctx:
            raise BackendUnavailable(f"{name}: llama.cpp could not create a context ({c})")
        self.n_ctx = lc.llama_n_ctx(self.ctx)  # cells, all sequences together
        # The most one sequence may hold: all cells (unified KV) or its own stream's (split).
        self.n_ctx_seq = lc.llama_n_ctx_seq(self.ctx)
        if train > 0:
            self.n_ctx_seq = min(self.n_ctx_seq, train)
        self._mem = lc.llama_get_memory(self.ctx)
        self._batch = Batch(max(c.n_batch, c.n_seq_max))
        self.samplers = SamplerSlots(model.n_vocab, model.eog_tokens, c.backend_sampling,
                                     idle_s=c.idle_sampler_s, fused=c.fused_greedy, n_ids=c.n_seq_max,
                                     fused_dist_from=c.fused_dist_from, vocab=model.vocab)
        self.eog_redos = 0  # end tokens a guarding chain sampled and the runner took back
        self.grammar_deferrals = 0  # grammar searches that went on at the next step (GRAMMAR_SHARE)
        # Sequences whose grammar allowed no token this step (sampled as None): the backend
        # fails them after the step.
        self.dead_ends: list[SeqState] = []
        self.kv_cell_bytes = kv_bytes_per_cell(model)
        # Seconds from the end of one step (its device sync) to the next step's llama_decode:
        # the host work between two steps that no device work overlaps (and any idle wait
        # between them). The benchmarks take the median over a run (bench/common.py).
        self.gaps: collections.deque = collections.deque(maxlen=8192)
        self._t_end = 0.0

    # ---- the scheduler's effects ----

    def apply(self, ops: list[KvOp]) -> None:
        mem = self._mem
        for op in ops:
            if op.kind == "cp":
                lc.llama_memory_seq_cp(mem, op.src, op.dst, op.p0, op.p1)
            else:
                lc.llama_memory_seq_rm(mem, op.src, op.p0, op.p1)

    def admit(self, seqs: list[SeqState], cap: int, free_ids) -> None:
        """Give each newly admitted sequence a sampler chain on its id; when that costs a graph
        reserve anyway, attach the same chain to the next free ids too (`free_ids(n)`)."""
        reserve_for = None
        # temperature requests admitted with this one count toward `fused_dist_from` at once, so
        # a burst takes one kind of chain (SamplerSlots)
        alongside = sum(1 for s in seqs if not (s.warm or s.seq_id < 0 or s.sp.greedy))
        for s in seqs:
            if s.warm or s.seq_id < 0:
                continue
            attached = self.samplers.attaches
            alongside -= 0 if s.sp.greedy else 1
            s.sampler = self.samplers.acquire(self.ctx, s.seq_id, s.sp, alongside)
            if s.generated:  # resumed after a preemption: the chain's history
                s.sampler.accept(s.tokens[s.n_prompt:])
            if self.samplers.attaches > attached and reserve_for is None:
                reserve_for = s.sp
        if reserve_for is not None and self.samplers.on_device:  # a reserve is due anyway
            room = cap - self.samplers.attached
            self.samplers.prepare(self.ctx, free_ids(room), reserve_for)

    def release(self, s: SeqState) -> None:
        """The sequence left its id: its chain stays there, idle (SamplerSlots)."""
        if s.sampler is not None:
            self.samplers.release(s.ran_on)
            s.sampler = None

    # ---- one step ----

    def execute(self, plan: Plan, kv_unified: bool, during=None) -> RunnerOutput:
        if plan.batch_empty:  # only searches go on: no decode
            if during is not None:
                during()
            deadline = time.perf_counter() + SEARCH_SLICE_S
            return RunnerOutput(0, [self._go_on(s, deadline) for s in plan.searching], 0, 0, 0.0)
        batch = self._batch
        decode = plan.decode
        batch.set_decode(decode)  # decode rows are rows 0 .. n_decode - 1, in plan order
        n_decode = batch.n
        for s, start, k, logits in plan.chunks:
            s.row = batch.add(s.tokens[start:start + k], s.seq_id, start, logits, s.prompt_logprobs is not None)
        n_prefill = batch.n - n_decode
        ctx = self.ctx
        if self.samplers.fused_busy:  # fused temperature chains run: this step's uniforms, one upload
            fused_dist.draw([(s.seq_id, s.sampler.dist) for s in decode]
                            + [(s.seq_id, s.sampler.dist) for s, _, _, logits in plan.chunks if logits])
        elif fused_dist.live():  # only idle ones: no row to draw for, and their builds stay cheap
            fused_dist.draw(())
        t0 = time.perf_counter()
        self.gaps.append(t0 - self._t_end)
        rc = lc.llama_decode(ctx, batch.full())
        if during is not None:  # host work while the device runs this step
            during()
        if rc == 0:
            lc.llama_synchronize(ctx)  # so `dt` is the device's time, not a launch
        self._t_end = time.perf_counter()
        dt = self._t_end - t0
        if rc != 0:
            return RunnerOutput(rc, [], n_decode, n_prefill, dt)
        # One loop, no call per row beyond the token read: the host's share of a GPU step
        # grows with every per-row call (`host_us_per_step` in `tandem bench overhead`).
        read, null, is_eog = llama.sampled_token_after_sync, lc.LLAMA_TOKEN_NULL, self.model.is_eog
        # The decode rows' device tokens in one read where libllama allows it (they are the
        # batch's first rows, all with logits); a few rows are cheaper read one by one.
        bulk = llama.sampled_tokens_after_sync
        device = bulk(ctx, n_decode) if bulk is not None and n_decode >= BULK_READ_FROM else None
        sampled: list[int | None] = []
        append = sampled.append
        lps = None
        deadline = 0.0  # for grammar searches: set by the first row sampled on the host
        for row, s in enumerate(decode):
            smp = s.sampler
            tok = (read(ctx, row) if device is None else device[row]) if smp.direct else null
            if tok == null:
                deadline = deadline or self._search_deadline(decode, plan, dt)
                tok = smp.sample(ctx, row, deadline)
                if tok in (DEAD_END, PENDING):
                    append(self._unsettled(s, tok))
                    continue
                if s.sp.logprobs is not None:  # its chain is a host one (`Sampler.host`)
                    lps = lps or {}
                    lps[row] = self.token_logprob(row, tok, s.sp.logprobs)
            if smp.guards_eog and is_eog(tok):
                self._redo(s)
                tok = None
            append(tok)
        for s, start, k, logits in plan.chunks:
            if s.prompt_logprobs is not None:
                self._prompt_logprobs(s, start, k)
            if logits:
                smp = s.sampler
                deadline = deadline or self._search_deadline(decode, plan, dt)
                tok = smp.sample(ctx, s.row, deadline)
                if tok in (DEAD_END, PENDING):
                    tok = self._unsettled(s, tok)
                else:
                    if s.sp.logprobs is not None:
                        lps = lps or {}
                        lps[len(sampled)] = self.token_logprob(s.row, tok, s.sp.logprobs)
                    if smp.guards_eog and is_eog(tok):
                        self._redo(s)
                        tok = None
                append(tok)
        if plan.searching:
            deadline = deadline or self._search_deadline(decode, plan, dt)
            sampled += [self._go_on(s, deadline) for s in plan.searching]
        return RunnerOutput(0, sampled, n_decode, n_prefill, dt, lps)

    def _go_on(self, s: SeqState, deadline: float) -> int | None:
        """A searching sequence's token (`SEARCHING` while its search goes on; None when its
        grammar allows nothing, the sequence then in `dead_ends`)."""
        if s.sampler is None:
            raise RuntimeError(f"request {s.req.id} searches for a token without a sampler chain")
        tok = s.sampler.go_on(deadline)
        return self._unsettled(s, tok) if tok in (DEAD_END, PENDING) else tok

    def _unsettled(self, s: SeqState, tok: int) -> int | None:
        """What a grammar search that gave no token leaves in the step's answer: None for a
        dead end (`s` into `dead_ends`); for a search that goes on, `SEARCHING`, or None for a
        request with logprobs (they are read from the row, so its input is decoded again)."""
        if tok == DEAD_END:
            self.dead_ends.append(s)
            return None
        self.grammar_deferrals += 1
        return SEARCHING if s.sp.logprobs is None else None

    def _search_deadline(self, decode: list[SeqState], plan: Plan, dt: float) -> float:
        """When this step's grammar searches stop (`GRAMMAR_SHARE`, `GRAMMAR_ALONE_SHARE`)."""
        alone = all(s.sp.grammar is not None for s in decode) and all(c[0].sp.grammar is not None
                                                                      for c in plan.chunks)
        return self._t_end + max(GRAMMAR_FLOOR_S, (GRAMMAR_ALONE_SHARE if alone else GRAMMAR_SHARE) * dt)

    def _prompt_logprobs(self, s: SeqState, start: int, k: int) -> None:
        """The logprob of each prompt token this chunk's rows predict (position p's row
        predicts p + 1), appended in order; a recompute after a preemption adds nothing."""
        recorded = s.prompt_logprobs
        if recorded is None:
            raise ValueError(f"request {s.req.id} did not ask for prompt logprobs")
        row0 = s.row - k + 1
        top = s.sp.logprobs or 0
        for p in range(start, min(start + k, s.n_prompt - 1)):
            if p == len(recorded):  # not yet recorded
                recorded.append(self.token_logprob(row0 + p - start, s.tokens[p + 1], top))

    def token_logprob(self, row: int, token: int, k: int) -> TokenLogprob:
        """`token`'s log-probability in output row `row` of the last decode, under the raw
        model distribution (log-softmax of the logits, no temperature, bias or penalty), with
        the `k` most likely tokens. Only for rows of sequences without a device sampler."""
        ptr = lc.llama_get_logits_ith(self.ctx, row)
        n_vocab = self.model.n_vocab
        x = np.ctypeslib.as_array(ptr, shape=(n_vocab,))
        m = float(x.max())
        lse = m + float(np.log(np.exp(x - m, dtype=np.float64).sum()))
        top: tuple = ()
        if k:
            idx = np.argpartition(x, n_vocab - k)[n_vocab - k:] if k < n_vocab else np.arange(n_vocab)
            idx = idx[np.argsort(-x[idx], kind="stable")]
            piece = self.model.piece
            top = tuple((int(t), piece(int(t)), float(x[t]) - lse) for t in idx)
        return TokenLogprob(token, self.model.piece(token), float(x[token]) - lse, top)

    def _redo(self, s: SeqState) -> None:
        """`s` ignores end tokens and its chain guarded one (engine/llama/sampling.py): forget it;
        the scheduler removes the cell and the same input is decoded again next step, with a
        chain that bans end tokens."""
        s.sampler = self.samplers.ban_eog(self.ctx, s.seq_id, s.sp, s.tokens[s.n_prompt:])
        self.eog_redos += 1

    # ---- state ----

    def state_bytes(self) -> int:
        """llama.cpp's own serialised-state size: grows with KV cells in use."""
        return lc.llama_state_get_size(self.ctx)

    @property
    def graphs_reused(self) -> int:
        return lc.llama_perf_context(self.ctx).n_reused if self.ctx else 0

    def close(self) -> None:
        if self.ctx:
            lc.llama_free(self.ctx)
            self.ctx = None
            self.samplers.close()


def kv_cells_that_fit(model: Model, share: float) -> int:
    """KV cells (multiple of 256) in `share` of the free memory of the model's devices; 0 where
    they do not say (the CPU: RSS is the limit there, not a device's memory)."""
    free, _ = model.memory.read()
    return int(free * share) // kv_bytes_per_cell(model) // 256 * 256 if free else 0


def kv_bytes_per_cell(model: Model) -> int:
    """K and V of one token in every layer, f16."""
    n_head = lc.llama_model_n_head(model.ptr)
    n_head_kv = lc.llama_model_n_head_kv(model.ptr)
    head_dim = model.info.n_embd // max(n_head, 1)
    return model.info.n_layer * 2 * n_head_kv * head_dim * 2


RSS_MAX_AGE_S = 0.5
_rss: tuple[float, int] = (-float("inf"), 0)  # (when read, time.monotonic; bytes)


def process_rss() -> int:
    """Resident set size of this process from /proc (0 where there is no /proc), read again at
    most every RSS_MAX_AGE_S seconds. Every backend's snapshot reports it, and the engine takes
    every backend's snapshot for each request it routes, under its routing lock: each file read
    gives the GIL away and waits to win it back from the busy workers. On this machine, four
    CPU contexts under load, the snapshots of one decision took 0.39 ms reading it each time,
    0.18 ms with this."""
    global _rss
    now = time.monotonic()
    if now - _rss[0] < RSS_MAX_AGE_S:
        return _rss[1]
    try:
        with open("/proc/self/statm") as f:
            value = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        value = 0
    _rss = (now, value)
    return value
