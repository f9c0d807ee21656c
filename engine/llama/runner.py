"""The llama.cpp side of a backend: one context, and the plans the scheduler makes run on it.

`ContextRunner` owns a `llama_context`, its `Batch` (engine/llama/batch.py) and the sampler chains
(`SamplerSlots`, engine/llama/sampling.py). It applies the scheduler's `KvOp`s
(`llama_memory_seq_cp` / `seq_rm`), turns a `Plan` into one batch (decode rows first, then
prompt chunks; only a chunk that ends its prompt asks for logits), decodes it and samples each
row that asked: the token, or None where a chain that guards end tokens (`ignore_eos` on the
device) sampled one — the runner switches that sequence to a chain that bans them, and the
scheduler decodes the same input again.

The hot path is the decode: nothing here adds per-token Python work beyond the batch's writes
(three list assignments for 8 rows or more) and one token read per sampled row (the token of
an attached stateless chain, `Sampler.direct`, is read in the loop itself). While the device
runs a step, the `during` callback (the previous step's text and the Outbox flush,
engine/backend.py) runs between `llama_decode`, which releases the GIL, and
`llama_synchronize`.

Thread contract: everything runs on the backend's worker thread, except the read-only counters
(`graphs_reused`, `sampler_attaches`, `samplers_attached`), which any thread may read.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .. import llama
from ..errors import BackendUnavailable
from ..scheduler import KvOp, Plan, SeqState
from . import lc
from .batch import Batch
from .model import Model
from .sampling import DEAD_END, SamplerSlots

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


class ContextRunner:
    """A llama.cpp context with its batch and sampler chains (worker thread only)."""

    def __init__(self, config, model: Model, name: str):
        c = config
        self.model = model
        p = lc.llama_context_default_params()
        train = model.n_ctx_train * (1 if c.kv_unified else c.n_seq_max)  # per sequence
        p.n_ctx = min(c.n_ctx, train) if train > 0 else c.n_ctx
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
        self._mem = lc.llama_get_memory(self.ctx)
        self._batch = Batch(max(c.n_batch, c.n_seq_max))
        self.samplers = SamplerSlots(model.n_vocab, model.eog_tokens, c.backend_sampling,
                                     idle_s=c.idle_sampler_s, fused=c.fused_greedy, vocab=model.vocab)
        self.eog_redos = 0  # end tokens a guarding chain sampled and the runner took back
        # Sequences whose grammar allowed no token this step (sampled as None): the backend
        # fails them after the step.
        self.dead_ends: list[SeqState] = []
        self.kv_cell_bytes = kv_bytes_per_cell(model)

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
        for s in seqs:
            if s.warm or s.seq_id < 0:
                continue
            attached = self.samplers.attaches
            s.sampler = self.samplers.acquire(self.ctx, s.seq_id, s.sp)
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
        batch = self._batch
        decode = plan.decode
        batch.set_decode(decode)  # decode rows are rows 0 .. n_decode - 1, in plan order
        n_decode = batch.n
        for s, start, k, logits in plan.chunks:
            s.row = batch.add(s.tokens[start:start + k], s.seq_id, start, logits)
        n_prefill = batch.n - n_decode
        ctx = self.ctx
        t0 = time.perf_counter()
        rc = lc.llama_decode(ctx, batch.full())
        if during is not None:  # host work while the device runs this step
            during()
        if rc == 0:
            lc.llama_synchronize(ctx)  # so `dt` is the device's time, not a launch
        dt = time.perf_counter() - t0
        if rc != 0:
            return RunnerOutput(rc, [], n_decode, n_prefill, dt)
        # One loop, no call per row beyond the token read: the host's share of a GPU step
        # grows with every per-row call (docs/performance.md, "Host work per step after the
        # backend split").
        read, null, is_eog = llama.sampled_token_after_sync, lc.LLAMA_TOKEN_NULL, self.model.is_eog
        sampled: list[int | None] = []
        append = sampled.append
        for row, s in enumerate(decode):
            smp = s.sampler
            tok = read(ctx, row) if smp.direct else null
            if tok == null:
                tok = smp.sample(ctx, row)
                if tok == DEAD_END:
                    self.dead_ends.append(s)
                    tok = None
            if smp.guards_eog and tok is not None and is_eog(tok):
                self._redo(s)
                tok = None
            append(tok)
        for s, _, _, logits in plan.chunks:
            if logits:
                tok = s.sampler.sample(ctx, s.row)
                if tok == DEAD_END:
                    self.dead_ends.append(s)
                    tok = None
                elif s.sampler.guards_eog and is_eog(tok):
                    self._redo(s)
                    tok = None
                append(tok)
        return RunnerOutput(0, sampled, n_decode, n_prefill, dt)

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


def kv_bytes_per_cell(model: Model) -> int:
    """K and V of one token in every layer, f16."""
    n_head = lc.llama_model_n_head(model.ptr)
    n_head_kv = lc.llama_model_n_head_kv(model.ptr)
    head_dim = model.info.n_embd // max(n_head, 1)
    return model.info.n_layer * 2 * n_head_kv * head_dim * 2


def process_rss() -> int:
    """Resident set size of this process from /proc (0 where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
