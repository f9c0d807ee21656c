"""Immutable views of a backend's state, taken on the backend's thread and read anywhere.

The router scores snapshots; the UI draws them; `/v1/routing` serialises them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class Rates:
    """A backend's measured speeds.

    One decode step at batch b takes `step_table[b - 1]` seconds where calibration measured
    it (GPU kernels change at some batch sizes: llama.cpp's small-batch matrix kernels stop
    at 8, and a step at 9 costs ~1.5x one at 8, which no straight line follows), else
    `step_alpha_s + step_beta_s * b`, else `b / decode_tok_s`.

    The context term (`step_at`, what the simulator's devices use; the router prices by batch
    alone): a step's attention costs `step_gamma_s * b * cells` on top of the weights' pass,
    `cells` the mean context of its b rows. (llama.cpp's unified KV hands every row all n_kv
    cells, the highest used cell + 1, with a mask; ggml's CPU flash-attention kernel skips a
    masked cell before its dot product, so a row pays for the cells it sees, its own sequence,
    shared prefix included, and only a mask read for the rest.) `step_cells[b - 1]` is the
    context the table's step at b was measured at (none: the table is the step over no context).
    `step_gamma_s` 0: no context term measured (calibrations before it), the table holds at any
    context.

    The masked scan (`step_delta_s`): skipping a masked cell is not free. Every row of a step
    reads the mask of all n_kv cells of the pool in every layer and head, and llama.cpp builds
    that mask on the host, row by row over n_kv, before each step; so a step also costs
    `step_delta_s * b * n_kv`. `step_kv[b - 1]` is the n_kv the table's step at b was measured
    at (the scheduler's KV cells in use, as `tandem calibrate` reads them; none: zero).
    `step_delta_s` 0: not measured (calibrations before it), no such term.
    """

    prefill_tok_s: float
    decode_tok_s: float
    step_alpha_s: float = 0.0
    step_beta_s: float = 0.0
    # "measured" (a short calibration when the engine loaded), "cached" (stored by an earlier
    # run: `measured_at` says when), "calibrated" (`tandem calibrate` / Recalibrate), "online"
    # (refined from served steps), "override" (typed), "default" (a placeholder guess)
    source: str = "default"
    step_table: tuple[float, ...] = ()  # measured seconds per step at batch 1, 2, ...
    measured_at: str = ""  # ISO time of the measurement these rates come from ("" if none)
    step_gamma_s: float = 0.0  # seconds per decode row per KV cell it attends over (0: not measured)
    step_cells: tuple[float, ...] = ()  # the cells each row of a `step_table` entry's step held
    step_delta_s: float = 0.0  # seconds per decode row per cell of the pool it scans (0: not measured)
    step_kv: tuple[float, ...] = ()  # the pool's cells in use (n_kv) at each `step_table` entry

    @property
    def placeholder(self) -> bool:
        """Nothing measured these rates: a guess the router should not be trusted with."""
        return self.source == "default"

    @property
    def origin(self) -> str:
        """Where these rates came from, in a few words: `measured at load`, `cached
        YYYY-MM-DD`, `placeholder`, `online`, `calibrated`, `override`."""
        if self.source == "default":
            return "placeholder"
        if self.source == "measured":
            return "measured at load"
        if self.source == "cached":
            return f"cached {self.measured_at[:10]}" if self.measured_at else "cached"
        return self.source

    def step_s(self, batch: int) -> float:
        """Seconds for one decode step with `batch` running sequences."""
        b = max(batch, 1)
        table = self.step_table
        if table:
            if b <= len(table):
                return table[b - 1]
            slope = self.step_beta_s or (table[-1] - table[-2] if len(table) > 1 else table[-1])
            return table[-1] + slope * (b - len(table))
        if self.step_alpha_s or self.step_beta_s:
            return self.step_alpha_s + self.step_beta_s * b
        return b / self.decode_tok_s

    def peak_decode_tok_s(self, up_to: int) -> float:
        """The most tokens per second a decode step gives at any batch from 1 to `up_to` (0 with
        no decode rate)."""
        if not (self.step_table or self.step_alpha_s or self.step_beta_s or self.decode_tok_s > 0):
            return 0.0
        steps = (self.step_s(b) for b in range(1, max(up_to, 1) + 1))
        return max((b / s if s > 0 else math.inf) for b, s in enumerate(steps, 1))

    def step_at(self, batch: int, cells: float, kv: float | None = None) -> float:
        """Seconds for one decode step of `batch` rows, each over `cells` KV cells of its own,
        in a pool of `kv` cells (n_kv; None: as calibrated): the step at `batch` moved by the
        context term from the cells it was measured at and by the masked scan from the pool it
        was measured in (neither term: `step_s(batch)`)."""
        base = self.step_s(batch)
        b = max(batch, 1)
        if self.step_gamma_s:
            base += self.step_gamma_s * b * (cells - _at(self.step_cells, b))
        if self.step_delta_s and kv is not None:
            base += self.step_delta_s * b * (kv - _at(self.step_kv, b))
        return max(base, 0.0)

    def scaled(self, factor: float) -> tuple[float, float, tuple[float, ...]]:
        """(alpha, beta, table) with every step time multiplied by `factor`."""
        return (self.step_alpha_s * factor, self.step_beta_s * factor,
                tuple(t * factor for t in self.step_table))


def _at(ref: tuple[float, ...], b: int) -> float:
    """The reference at batch `b` (the last one past the table; none, as a typed profile: 0)."""
    return (ref[b - 1] if b <= len(ref) else ref[-1]) if ref else 0.0


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request a backend holds, as the router sees it.

    `prefill_left` counts prompt tokens still to compute (cached ones excluded: for a queued
    request this is the estimate made when it was routed, kept pinned); `decode_left` is the
    unused `max_tokens` budget; `generated` how many tokens it has produced so far.
    """

    request_id: str
    running: bool
    prompt_tokens: int
    cached_tokens: int
    prefill_left: int
    decode_left: int
    generated: int = 0


@dataclass(frozen=True, slots=True)
class CacheStats:
    enabled: bool = True
    query_tokens: int = 0
    hit_tokens: int = 0
    cached_tokens: int = 0
    pinned_tokens: int = 0
    evictions: int = 0
    lost_tokens: int = 0  # admitted prompt tokens this cache had held, then evicted (prefill paid twice)
    recent_lost_share: float = 0.0  # lost / prompt tokens over the last few admissions (engine/sched/prefix_cache.py)
    # What the figures count: "tokens", or "chars/4" where a remote backend without a
    # tokenizer predicts its engine's cache from text (characters / 4 as a token estimate).
    units: str = "tokens"

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(frozen=True, slots=True)
class BackendSnapshot:
    """A backend at one instant. `items` lists running requests first, then the queue in order."""

    name: str
    device: str
    cap: int  # sequences admitted at once now (an adaptive backend's live limit)
    n_ctx: int
    rates: Rates
    items: tuple[WorkItem, ...] = ()
    healthy: bool = True
    error: str | None = None  # why it is unhealthy
    threads: int = 0
    kv_cells_used: int = 0
    kv_cells_total: int = 0
    kv_bytes: int = 0  # KV cells in use × bytes per cell
    kv_bytes_total: int = 0  # the context's whole KV buffer
    model_bytes: int = 0  # weights on this backend's device (shared by backends on the same device)
    # The backend's GPU memory as ggml reports it (ggml_backend_dev_memory; summed over GPUs
    # for a plain `gpu` backend spread over all of them); 0 on a CPU backend.
    device_memory_free_bytes: int = 0
    device_memory_total_bytes: int = 0
    device_name: str = ""  # ggml's device name(s): "CUDA1", "CPU"
    group: str = ""  # the spec whose contexts share this backend's device ("gpu" for gpu-a, gpu-b, ...), or ""
    process_rss_bytes: int = 0  # host memory of the whole process (backends share one process)
    cache: CacheStats = field(default_factory=CacheStats)
    prefill_tok_s: float = 0.0  # observed, recent
    decode_tok_s: float = 0.0  # observed, recent
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens decoded since start (cache hits and shared prompts not)
    time: float = 0.0
    # The user's cap (the live `cap`'s ceiling when adaptive; 0: the same as `cap`), whether the
    # cap adapts (engine/sched/limiter.py), and why it last moved.
    cap_ceiling: int = 0
    cap_adaptive: bool = False
    cap_reason: str = ""
    url: str = ""  # a remote backend's engine (engine/backends/remote/); "" for a local one
    model: str = ""  # the model a remote engine serves; "" for a local one

    @property
    def running(self) -> tuple[WorkItem, ...]:
        return tuple(i for i in self.items if i.running)

    @property
    def waiting(self) -> tuple[WorkItem, ...]:
        return tuple(i for i in self.items if not i.running)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["n_running"] = len(self.running)
        d["n_waiting"] = len(self.waiting)
        d["cache"]["hit_rate"] = self.cache.hit_rate
        d["rates"]["origin"] = self.rates.origin
        return d
