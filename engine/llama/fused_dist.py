"""Temperature sampling on the device: one top-k / top-p / min-p / temperature / draw for every
sequence of a step.

How it computes, how it finds each chain's row, and why: docs/design/llama.md, "The fused temperature
sampler, in detail".

Thread contract: a context's graph builds and `draw` run on the thread that calls
`llama_decode` (the backend's worker); each such thread has its own `_Table`. `BUILDS` is read
anywhere. `TOP_K_CHUNK` and `TOP_K_STAGES_ON_CPU` are read by each build: `top_k_stages` on
any thread takes effect at the next graph build (a graph reused from the step before keeps its
top-k)."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import itertools
import logging
import math
import os
import random
import threading

import numpy as np

from . import _abi, greedy, holding_gil, lc, sampler_interface, sortfree

log = logging.getLogger(__name__)
_P = ctypes.c_void_p
_I64, _F = ctypes.c_int64, ctypes.c_float
_F32, _I32 = 0, 26  # enum ggml_type
_SORT_DESC = 1  # enum ggml_sort_order
_FLAG_COMPUTE = 16  # GGML_TENSOR_FLAG_COMPUTE: set on the output llama.cpp chose for a chain
_DEVICE_CPU = 0  # GGML_BACKEND_DEVICE_TYPE_CPU

_SIGNATURES: list[tuple[str, list, object]] = [
    ("ggml_top_k", [_P, _P, ctypes.c_int], _P),
    ("ggml_argsort", [_P, _P, ctypes.c_int], _P),
    ("ggml_argmax", [_P, _P], _P),
    ("ggml_get_rows", [_P, _P, _P], _P),
    ("ggml_reshape_1d", [_P, _P, _I64], _P),
    ("ggml_reshape_2d", [_P, _P, _I64, _I64], _P),
    ("ggml_reshape_3d", [_P, _P, _I64, _I64, _I64], _P),
    ("ggml_view_1d", [_P, _P, _I64, ctypes.c_size_t], _P),
    ("ggml_view_2d", [_P, _P, _I64, _I64, ctypes.c_size_t, ctypes.c_size_t], _P),
    ("ggml_soft_max", [_P, _P], _P),
    ("ggml_cumsum", [_P, _P], _P),
    ("ggml_add", [_P, _P, _P], _P),
    ("ggml_sub", [_P, _P, _P], _P),
    ("ggml_mul", [_P, _P, _P], _P),
    ("ggml_step", [_P, _P], _P),
    ("ggml_log", [_P, _P], _P),
    ("ggml_cont", [_P, _P], _P),
    ("ggml_sum_rows", [_P, _P], _P),
    ("ggml_scale_bias", [_P, _P, _F, _F], _P),
    ("ggml_cast", [_P, _P, ctypes.c_int], _P),
    ("ggml_repeat", [_P, _P, _P], _P),
    ("ggml_arange", [_P, _F, _F, _F], _P),
    ("ggml_pad", [_P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int], _P),
    ("ggml_pool_2d", [_P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, _F, _F], _P),
    ("ggml_soft_max_ext", [_P, _P, _P, _F, _F], _P),
    ("ggml_scale", [_P, _P, _F], _P),
    ("ggml_clamp", [_P, _P, _F, _F], _P),
    ("ggml_new_tensor_3d", [_P, ctypes.c_int, _I64, _I64, _I64], _P),
    ("ggml_set_name", [_P, ctypes.c_char_p], _P),
    ("ggml_get_name", [_P], ctypes.c_char_p),
    ("ggml_new_tensor_1d", [_P, ctypes.c_int, _I64], _P),
    ("ggml_get_data", [_P], _P),
    ("ggml_init", [_abi.InitParams], _P),
    ("ggml_free", [_P], None),
    ("ggml_new_graph", [_P], _P),
    ("ggml_build_forward_expand", [_P, _P], None),
    ("ggml_graph_n_nodes", [_P], ctypes.c_int),
    ("ggml_graph_node", [_P, ctypes.c_int], _P),
    ("ggml_graph_compute_with_ctx", [_P, _P, ctypes.c_int], ctypes.c_int),
    ("ggml_backend_alloc_ctx_tensors_from_buft", [_P, _P], _P),
    ("ggml_backend_buffer_free", [_P], None),
    ("ggml_backend_tensor_set", [_P, _P, ctypes.c_size_t, ctypes.c_size_t], None),
    ("ggml_backend_buft_get_device", [_P], _P),
    ("ggml_backend_buft_name", [_P], ctypes.c_char_p),
    ("ggml_backend_buft_is_host", [_P], ctypes.c_bool),
    ("ggml_backend_dev_type", [_P], ctypes.c_int),
    ("ggml_backend_dev_supports_op", [_P, _P], ctypes.c_bool),
    ("ggml_op_desc", [_P], ctypes.c_char_p),
]
_g = {name: holding_gil(name, args, res) for name, args, res in _SIGNATURES}  # ggml, keeping the GIL

# "shared": computations over a whole logits matrix; "row": chain builds that took their row of
# one; "own": chain builds that computed their row alone; "idle": chain builds in a step where no
# fused chain's sequence drew (one argmax, never read); "host": chains kept on the host because
# the device lacks an operation; "late": builds whose settings reached the device a step late
# (fewer chains registered than were on the device: not expected); "two-stage": computations
# ("shared" or "own") whose top-k ran in stages of small sorts (`_top_k_in_stages`); "sortfree":
# computations on that path, "maxima" whose top-k ran by maxima, "proposals" whose rows had no top-k
BUILDS: collections.Counter = collections.Counter()
# Where the latest tables were allocated: the buffer type llama.cpp gave the chains, whether it is
# host memory (then every step copies what the graph reads from it to the device), the variant.
PLACEMENT: dict = {}

# Per-row settings, one column each, in this order (a row of a graph's settings block).
_COLUMNS = ("seq", "inv_temp", "top_p", "min_p", "k", "ban", "log_min_p")
_NC = len(_COLUMNS)
_SEQS = 8192  # sequence ids the uniforms table covers (llama.cpp's n_seq_max is far below)
_ROWS = 8193  # rows of one graph's settings block (n_batch outputs + llama.cpp's padding row)
_SLOTS = 16  # settings blocks, used in turn by successive builds (a step's ubatches may be in flight)
_NO_CUT = 2.0  # top_p of a row without top-p: no cumulative probability reaches it
_BAN = -1e30  # ignore_eos: added to end-of-generation logits
_MAX_CHUNK = 8192  # the largest chunk of the two-stage top-k (the padding table covers it)


def _chunk_from(value: str | None) -> int:
    """`TANDEM_TOPK_CHUNK` as a chunk size: a power of two up to `_MAX_CHUNK`, or 0 (off)."""
    if value is None or value.strip() == "":
        return 1024
    try:
        return _checked_chunk(int(value))
    except ValueError as e:
        log.warning("fused_dist: TANDEM_TOPK_CHUNK=%r ignored (%s); using 1024", value, e)
        return 1024


def _checked_chunk(n: int) -> int:
    if n != 0 and not (16 <= n <= _MAX_CHUNK and n & (n - 1) == 0):
        raise ValueError(f"a top-k chunk is 0 (off) or a power of two from 16 to {_MAX_CHUNK}, not {n}")
    return n


# Values per first-stage sort of the two-stage top-k (`_top_k_in_stages`); 0: one `ggml_top_k`
# over each whole row. Read at each graph build; `TANDEM_TOPK_CHUNK` sets it at import,
# `top_k_stages` for a while (bench overhead's one-stage variants).
TOP_K_CHUNK = _chunk_from(os.environ.get("TANDEM_TOPK_CHUNK"))
# Whether the CPU backend takes the stages too. Off: there ggml's own top-k is one pass per row
# and the stages' sorts cost more (this 2-core machine, 1 thread, 49,152 tokens, k 40, the whole
# sampler via `sample_rows`: 0.6 ms vs 3.9 ms at B = 1, 1.7 vs 35 ms at B = 8). Tests turn it on.
TOP_K_STAGES_ON_CPU = False


@contextlib.contextmanager
def top_k_stages(chunk: int, on_cpu: bool | None = None):
    """Within the block, graphs built use the top-k in stages of `chunk` (0: one `ggml_top_k`
    per row), on the CPU backend too if `on_cpu` (None: as it was); the previous settings after.
    ValueError for a chunk that is not 0 or a power of two from 16 to 8192. A graph reused from
    a step before keeps its top-k."""
    global TOP_K_CHUNK, TOP_K_STAGES_ON_CPU
    previous = TOP_K_CHUNK, TOP_K_STAGES_ON_CPU
    TOP_K_CHUNK = _checked_chunk(int(chunk))
    if on_cpu is not None:
        TOP_K_STAGES_ON_CPU = bool(on_cpu)
    try:
        yield
    finally:
        TOP_K_CHUNK, TOP_K_STAGES_ON_CPU = previous


# The sort-free computation (engine/llama/sortfree.py): the top-k by maxima and a shorter draw, and
# top-p over the whole vocabulary by proposals; "staged" is the computation before it (the top-k by
# sorts, in stages up to STAGES_MAX_ROWS rows). Read at each graph build: `TANDEM_FUSED_PATH` sets it
# at import, `fused_path` for a while (bench overhead's `-staged` variants).
PATHS = ("sortfree", "staged")
PATH = os.environ.get("TANDEM_FUSED_PATH", "sortfree") if os.environ.get("TANDEM_FUSED_PATH") in PATHS else "sortfree"
# Whether the CPU backend takes the top-k by maxima (tests turn it on; there ggml's own top-k, one
# pass a row, is what it already runs fast).
POOLED_ON_CPU = False


@contextlib.contextmanager
def fused_path(name: str, pooled_on_cpu: bool | None = None):
    """Within the block, graphs built take computation `name` (PATHS); the previous after."""
    global PATH, POOLED_ON_CPU
    if name not in PATHS:
        raise ValueError(f"a fused path is one of {', '.join(PATHS)}, not {name!r}")
    previous = PATH, POOLED_ON_CPU
    PATH = name
    if pooled_on_cpu is not None:
        POOLED_ON_CPU = bool(pooled_on_cpu)
    try:
        yield
    finally:
        PATH, POOLED_ON_CPU = previous


# The most rows whose top-k runs in stages. On the H200 (Qwen2.5, 151,936 tokens, k 40; `run.sh
# topk_stages`) the stages win clearly up to B = 16 and lose at 32: one sort per row occupies the
# GPU once there are enough rows, and 149 x B chunk sorts then cost more.
STAGES_MAX_ROWS = 24  # a step of B sequences may have a row or two more (prompt ends beside them)


def in_stages(n_vocab: int, k: int, chunk: int, n_rows: int = 1) -> bool:
    """Whether a top-k of `k` over `n_rows` rows of `n_vocab` runs in stages with chunks of
    `chunk`: only where k is small against the chunk, the row spans several chunks and there
    are at most `STAGES_MAX_ROWS` rows."""
    return (chunk > 0 and 4 * k <= chunk and 4 * chunk <= n_vocab < 1 << 24  # F32 ids exact below 2^24
            and n_rows <= STAGES_MAX_ROWS)


# SamplingParams fields the fused computation covers (or that do not touch the chain); any other
# field away from its default (a repetition penalty, and whatever the chain learns later: a
# grammar, logit biases, log-probabilities) keeps llama.cpp's samplers.
_COVERED = {"temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "stop", "ignore_eos", "repeat_last_n"}


def add_temperature_chain(add, params, n_vocab: int) -> None:
    """llama.cpp's own samplers for a temperature request, in our chain's order (top-k → top-p →
    min-p → temperature → seeded draw): the host path here, and the per-sequence chain
    (engine/llama/sampling.py) that this module's fused computation stands for."""
    if params.top_k > 0:
        add(lc.llama_sampler_init_top_k(min(params.top_k, n_vocab)))
    if params.top_p < 1.0:
        add(lc.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        add(lc.llama_sampler_init_min_p(params.min_p, 1))
    add(lc.llama_sampler_init_temp(params.temperature))
    add(lc.llama_sampler_init_dist(params.seed if params.seed is not None else lc.LLAMA_DEFAULT_SEED))


def supports(params) -> bool:
    """Whether `fused_dist` stands for the whole chain of `params`: a temperature chain with
    nothing before top-k."""
    if params.greedy:
        return False
    return all(getattr(params, f.name) == _default(f) for f in dataclasses.fields(params) if f.name not in _COVERED)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return object()  # no default: never "at its default"


def _settings(params, n_vocab: int) -> tuple[float, ...]:
    """A row's settings column values (`_COLUMNS` without the sequence id)."""
    k = min(params.top_k, n_vocab) if params.top_k > 0 else n_vocab
    top_p = params.top_p if params.top_p < 1.0 else _NO_CUT
    # kept: p >= min_p * p_max; a hair below so that a tie with the largest stays (min_p = 1)
    min_p = params.min_p * (1 - 1e-6) if params.min_p > 0.0 else -1e30
    log_min_p = math.log(params.min_p) - 1e-6 if params.min_p > 0.0 else -1e30
    return (1.0 / params.temperature, top_p, min_p, float(k), 1.0 if params.ignore_eos else 0.0, log_min_p)


# ---- the computation ----

def _top_k_in_stages(ctx, lg: int, n_vocab: int, n_rows: int, k: int, chunk: int,
                     tail: int) -> tuple[int, int]:
    """The k best of each row of `lg` (n_vocab x n_rows), in descending order: (their logits,
    k x n_rows; their token ids as F32, 1 x k x n_rows), exact, by stages of small sorts.

    A stage views each row as chunks of `chunk` values (the row padded with -inf to a whole
    number of chunks: `tail` is F32, 0 for the first n_vocab values and -inf for `_MAX_CHUNK`
    after, and a view of it starting `n_vocab - n` values in is the padding bias of a row of n),
    and keeps the first k of each chunk's `ggml_argsort`: one small sort per chunk, all in one
    launch (CUDA: a bitonic sort in one thread block per chunk, up to 1,024 values). The k best
    of a row are among the k best of their chunks, so the survivors (k per chunk) hold them;
    stages repeat while more than a chunk survive, and the last one sorts the survivors. Each
    survivor's token id travels with it: the first stage's is its chunk's start plus its place
    in the chunk (gathered from an F32 ramp, exact below 2^24), later stages gather the previous
    stage's ids like the values."""
    g = _g
    n, values, ids = n_vocab, lg, None
    while n > chunk:
        c = -(-n // chunk)
        if c * chunk > n:  # pad to whole chunks: zeros, then -inf from the tail table
            bias = g["ggml_view_1d"](ctx, tail, c * chunk, (n_vocab - n) * 4)
            values = g["ggml_add"](ctx, g["ggml_pad"](ctx, values, c * chunk - n, 0, 0, 0), bias)
            if ids is not None:
                ids = g["ggml_pad"](ctx, ids, c * chunk - n, 0, 0, 0)
        rows = g["ggml_reshape_3d"](ctx, values, 1, chunk, c * n_rows)
        # the first k of each chunk's sort, k x (c x n_rows): an argsort, not `ggml_top_k`, which
        # CUDA runs row by row (one launch per row) where CUB has a top-k
        best = g["ggml_argsort"](ctx, g["ggml_reshape_2d"](ctx, values, chunk, c * n_rows), _SORT_DESC)
        best = g["ggml_cont"](ctx, g["ggml_view_2d"](ctx, best, k, c * n_rows, chunk * 4, 0))
        values = g["ggml_reshape_2d"](ctx, g["ggml_get_rows"](ctx, rows, best), k * c, n_rows)
        if ids is None:  # place in the chunk (an F32 ramp gathered by the I32 places) + the chunk's start
            ramp = g["ggml_reshape_2d"](ctx, g["ggml_arange"](ctx, 0.0, float(chunk), 1.0), 1, chunk)
            places = g["ggml_get_rows"](ctx, ramp, g["ggml_reshape_1d"](ctx, best, k * c * n_rows))
            starts = g["ggml_reshape_2d"](ctx, g["ggml_arange"](ctx, 0.0, float(c * chunk), float(chunk)), 1, c)
            ids = g["ggml_add"](ctx, g["ggml_reshape_3d"](ctx, places, k, c, n_rows), starts)
        else:
            ids = g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, ids, 1, chunk, c * n_rows), best)
        ids = g["ggml_reshape_2d"](ctx, ids, k * c, n_rows)
        n = k * c
    order = g["ggml_argsort"](ctx, values, _SORT_DESC)
    order = g["ggml_cont"](ctx, g["ggml_view_2d"](ctx, order, k, n_rows, n * 4, 0))
    logits = g["ggml_reshape_2d"](ctx, g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, values, 1, n, n_rows), order),
                                  k, n_rows)
    return logits, g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, ids, 1, n, n_rows), order)


def _top_k(ctx, lg: int, n_vocab: int, n_rows: int, k: int, variant: tuple[bool, ...], tail: int | None,
           chunk: int) -> tuple[int, int, bool]:
    """The k best of each row of `lg` in descending order: (their logits, k x n_rows; their token
    ids, 1 x k x n_rows; whether the ids are I32, else F32). `_build` says the rest."""
    top_k_op, int_ids, staged = variant[:3]
    g = _g
    if staged and tail is not None and in_stages(n_vocab, k, chunk, n_rows):
        logits, ids = _top_k_in_stages(ctx, lg, n_vocab, n_rows, k, chunk, tail)
        int_ids = False  # the ids come as F32
    elif k < n_vocab and top_k_op:
        top = g["ggml_top_k"](ctx, lg, k)  # k x n_rows, in no particular order
        lk = g["ggml_reshape_2d"](ctx, g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, lg, 1, n_vocab, n_rows), top),
                                  k, n_rows)
        order = g["ggml_argsort"](ctx, lk, _SORT_DESC)
        logits = g["ggml_reshape_2d"](ctx, g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, lk, 1, k, n_rows), order),
                                      k, n_rows)
        src = top if int_ids else g["ggml_cast"](ctx, top, _F32)
        ids = g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, src, 1, k, n_rows), order)  # 1 x k x n_rows
    else:
        order = g["ggml_argsort"](ctx, lg, _SORT_DESC)
        if k < n_vocab:  # the first k of each sorted row
            order = g["ggml_cont"](ctx, g["ggml_view_2d"](ctx, order, k, n_rows, n_vocab * 4, 0))
        logits = g["ggml_reshape_2d"](ctx, g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, lg, 1, n_vocab, n_rows),
                                                              order), k, n_rows)
        ids = g["ggml_reshape_3d"](ctx, order if int_ids else g["ggml_cast"](ctx, order, _F32), 1, k, n_rows)
    return logits, ids, int_ids


@dataclasses.dataclass(frozen=True)
class Shape:
    """What a build knows of its rows beyond their columns: whether any asks min-p, one inverse
    temperature all share (None: each its own), the per-sequence table of PROPOSALS uniforms
    (`sortfree.rejection`; None: not allocated), whether the chains' buffers are the CPU's, and
    the computation (PATHS)."""

    min_p: bool = True
    scale: float | None = None
    proposals: int | None = None
    cpu: bool = False
    path: str = "sortfree"
    whole: bool = False  # every row asks no top-k (then `sortfree.rejection` takes them)


def _build(ctx, m: int, n_vocab: int, n_rows: int, k: int, block: int, stride: int, uniforms: int,
           eog: int | None, ban: str, mixed_k: bool, variant: tuple[bool, ...] = (True, True, True, True),
           tail: int | None = None, chunk: int = 0, shape: Shape = Shape()) -> int:
    """Sampled tokens (I32, n_rows) for every row of `m`: the sort-free computation where the
    variant and `shape.path` allow (`_build_sortfree`), else the one by sorts (`_build_staged`)."""
    if shape.path == "sortfree" and len(variant) > 3 and variant[3] and tail is not None:
        BUILDS["sortfree"] += 1
        return _build_sortfree(ctx, m, n_vocab, n_rows, k, block, stride, uniforms, eog, ban, mixed_k, variant,
                               tail, chunk, shape)
    return _build_staged(ctx, m, n_vocab, n_rows, k, block, stride, uniforms, eog, ban, mixed_k, variant[:3],
                         tail, chunk)


def _columns(g, ctx, block: int, n_rows: int, stride: int):
    def col(c: int) -> int:  # column c of the settings, as a 1 x n_rows row
        return g["ggml_reshape_2d"](ctx, g["ggml_view_1d"](ctx, block, n_rows, c * stride * 4), 1, n_rows)
    return col


def _banned(g, ctx, m: int, eog: int | None, ban: str, col) -> int:
    if ban == "all":
        return g["ggml_add"](ctx, m, eog)
    if ban == "mixed":
        return g["ggml_add"](ctx, m, g["ggml_mul"](ctx, g["ggml_repeat"](ctx, eog, m), col(5)))
    return m


def _build_sortfree(ctx, m: int, n_vocab: int, n_rows: int, k: int, block: int, stride: int, uniforms: int,
                    eog: int | None, ban: str, mixed_k: bool, variant: tuple[bool, ...], tail: int, chunk: int,
                    shape: Shape) -> int:
    """`sortfree`'s computation: whole-vocabulary rows (no top-k asked) by proposals; a top-k of
    at most POOL_MAX_K by maxima (on the CPU backend ggml's own top-k, unless POOLED_ON_CPU);
    other top-k as `_top_k` takes it; then the short draw."""
    g = _g
    col = _columns(g, ctx, block, n_rows, stride)
    lg = _banned(g, ctx, m, eog, ban, col)
    seqs = g["ggml_cast"](ctx, g["ggml_view_1d"](ctx, block, n_rows, 0), _I32)
    if shape.whole and k >= n_vocab and shape.proposals is not None:
        n_seqs = _abi.tensor_facts(shape.proposals).ne[0] // sortfree.PROPOSALS
        u = g["ggml_get_rows"](ctx, g["ggml_reshape_2d"](ctx, shape.proposals, sortfree.PROPOSALS, n_seqs), seqs)
        size = sortfree.chunk_for(n_vocab)
        n_pad = -(-n_vocab // size) * size
        BUILDS["proposals"] += 1
        return g["ggml_set_name"](sortfree.rejection(g, ctx, lg, n_vocab, n_pad, n_rows, col, u, shape.scale),
                                  b"fused_dist_tokens")
    if sortfree.pooled(n_vocab, k) and (POOLED_ON_CPU or not shape.cpu):
        n_pad = -(-n_vocab // sortfree.POOL) * sortfree.POOL
        x = lg
        if n_pad > n_vocab:  # -inf past the vocabulary: zeros padded, then the tail table's view
            x = g["ggml_add"](ctx, g["ggml_pad"](ctx, lg, n_pad - n_vocab, 0, 0, 0), g["ggml_view_1d"](ctx, tail, n_pad, 0))
        logits, ids = sortfree.pooled_top_k(g, ctx, x, n_pad, n_rows, k)
        int_ids = False
        BUILDS["maxima"] += 1
    else:
        logits, ids, int_ids = _top_k(ctx, lg, n_vocab, n_rows, k, variant[:3], tail, chunk)
    if mixed_k:
        logits = _masked_beyond(g, ctx, logits, k, col)
    u = g["ggml_get_rows"](ctx, g["ggml_reshape_2d"](ctx, uniforms, 1, _abi.tensor_facts(uniforms).ne[0]), seqs)
    u = g["ggml_reshape_2d"](ctx, u, 1, n_rows)
    tokens = sortfree.draw(g, ctx, logits, ids, int_ids, k, n_rows, col, u, min_p=shape.min_p, scale=shape.scale)
    return g["ggml_set_name"](tokens, b"fused_dist_tokens")


def _masked_beyond(g, ctx, logits: int, k: int, col) -> int:
    """Rows that keep fewer than k: log(j < k_row) = -inf beyond their k."""
    pos = g["ggml_reshape_2d"](ctx, g["ggml_arange"](ctx, 0.0, float(k), 1.0), k, 1)
    room = g["ggml_sub"](ctx, g["ggml_repeat"](ctx, col(4), logits), pos)  # k_row - j
    return g["ggml_add"](ctx, logits, g["ggml_log"](ctx, g["ggml_step"](ctx, g["ggml_scale_bias"](ctx, room, 1.0, -0.5))))


def _build_staged(ctx, m: int, n_vocab: int, n_rows: int, k: int, block: int, stride: int, uniforms: int,
                  eog: int | None, ban: str, mixed_k: bool, variant: tuple[bool, ...] = (True, True, True),
                  tail: int | None = None, chunk: int = 0) -> int:
    """Sampled tokens (I32, n_rows) for every row of the F32 logits matrix `m` (n_vocab x n_rows).
    `block`: F32 settings, column c of row r at c * stride + r; `uniforms`: F32, one per sequence
    id; `eog`: F32 n_vocab, `_BAN` at end-of-generation tokens; `ban`: "none", "all" or "mixed"
    (rows whose `ban` column is 1). `variant`, for devices that lack an operation: (the k best by
    `ggml_top_k`, else the first k of a whole-row argsort; token ids gathered as I32, else as
    F32, exact below 2^24; the top-k in stages of `chunk`, `_top_k_in_stages`, where `in_stages`
    says and `tail` is given). `tail`: F32, 0 for the first n_vocab values, -inf for
    `_MAX_CHUNK` after (the padding of the stages)."""
    g = _g
    col = _columns(g, ctx, block, n_rows, stride)
    lg = _banned(g, ctx, m, eog, ban, col)
    # the k best of each row, in descending order, and their token ids
    logits, ids, int_ids = _top_k(ctx, lg, n_vocab, n_rows, k, variant, tail, chunk)
    if mixed_k:
        logits = _masked_beyond(g, ctx, logits, k, col)
    # top-p and min-p on the probabilities at temperature 1 over the top k
    probs = g["ggml_soft_max"](ctx, logits)
    before = g["ggml_sub"](ctx, probs, g["ggml_cumsum"](ctx, probs))  # -(probability before each token)
    keep = g["ggml_step"](ctx, g["ggml_add"](ctx, before, col(2)))  # p - before > 0
    largest = g["ggml_cont"](ctx, g["ggml_view_2d"](ctx, probs, 1, n_rows, k * 4, 0))
    floor = g["ggml_mul"](ctx, largest, col(3))
    keep = g["ggml_mul"](ctx, keep, g["ggml_step"](ctx, g["ggml_sub"](ctx, probs, floor)))
    # temperature, then the draw: the first token whose cumulative sum reaches u x total
    final = g["ggml_add"](ctx, g["ggml_mul"](ctx, logits, col(1)), g["ggml_log"](ctx, keep))
    cdf = g["ggml_cumsum"](ctx, g["ggml_soft_max"](ctx, final))
    total = g["ggml_cont"](ctx, g["ggml_view_2d"](ctx, cdf, 1, n_rows, k * 4, (k - 1) * 4))
    seqs = g["ggml_cast"](ctx, g["ggml_view_1d"](ctx, block, n_rows, 0), _I32)
    u = g["ggml_get_rows"](ctx, g["ggml_reshape_2d"](ctx, uniforms, 1, _abi.tensor_facts(uniforms).ne[0]), seqs)
    target = g["ggml_mul"](ctx, g["ggml_reshape_2d"](ctx, u, 1, n_rows), total)
    past = g["ggml_sum_rows"](ctx, g["ggml_step"](ctx, g["ggml_sub"](ctx, cdf, target)))  # tokens beyond
    index = g["ggml_cast"](ctx, g["ggml_scale_bias"](ctx, past, -1.0, float(k)), _I32)
    tokens = g["ggml_get_rows"](ctx, ids, index)  # 1 x 1 x n_rows
    if not int_ids:
        tokens = g["ggml_cast"](ctx, tokens, _I32)
    return g["ggml_set_name"](g["ggml_reshape_1d"](ctx, tokens, n_rows), b"fused_dist_tokens")


# ---- device memory: uniforms per sequence, settings blocks, the end-token bias ----

class _Table:
    """One thread's device memory for its context's fused chains, allocated at the first build
    from the buffer type llama.cpp gave the chains, and what a step's builds share."""

    def __init__(self) -> None:
        self.buft = None
        self.n_vocab = 0
        self._ctx = self._buffer = None
        # ggml tensors (pointers), None until `allocate`
        self.uniforms: int | None = None
        self.proposals: int | None = None  # sortfree.PROPOSALS uniforms per sequence id
        self.blocks: int | None = None
        self.eog: int | None = None
        self.tail: int | None = None
        self.staged = np.zeros(_SEQS, dtype=np.float32)  # this step's uniform per sequence id
        self.staged4 = np.zeros((_SEQS, sortfree.PROPOSALS), dtype=np.float32)  # ... and proposals
        self.active: set[int] = set()  # sequence ids that drew for this step
        self.live = 0  # fused chains made on this thread
        self.variant = _VARIANTS[0]  # what the device runs (`_build`)
        self.cpu = True  # whether the chains' buffers belong to the CPU backend (no top-k stages there)
        self.slot = 0
        self.last: _Build | None = None  # the latest build of a shared computation

    def allocate(self, buft, n_vocab: int, eog_tokens) -> None:
        if self.buft == buft and self.n_vocab == n_vocab:
            return
        self.free()
        g = _g
        self._ctx = g["ggml_init"](_abi.InitParams(8 * 1024, None, True))
        self.uniforms = g["ggml_new_tensor_1d"](self._ctx, _F32, _SEQS)
        self.proposals = g["ggml_new_tensor_1d"](self._ctx, _F32, _SEQS * sortfree.PROPOSALS)
        self.blocks = g["ggml_new_tensor_1d"](self._ctx, _F32, _SLOTS * _NC * _ROWS)
        self.eog = g["ggml_new_tensor_1d"](self._ctx, _F32, n_vocab)
        self.tail = g["ggml_new_tensor_1d"](self._ctx, _F32, n_vocab + _MAX_CHUNK)
        self._buffer = g["ggml_backend_alloc_ctx_tensors_from_buft"](self._ctx, buft)
        if not self._buffer:
            raise MemoryError("fused_dist: could not allocate its device tables")
        bias = np.zeros(n_vocab, dtype=np.float32)
        bias[[t for t in eog_tokens if 0 <= t < n_vocab]] = _BAN
        _set(self.eog, bias)
        _set(self.tail, _tail(n_vocab))
        _set(self.uniforms, self.staged)
        _set(self.proposals, self.staged4.reshape(-1))
        self.buft, self.n_vocab = buft, n_vocab
        dev = g["ggml_backend_buft_get_device"](buft)
        self.cpu = not dev or g["ggml_backend_dev_type"](dev) == _DEVICE_CPU
        PLACEMENT.update(buffer=(g["ggml_backend_buft_name"](buft) or b"").decode(),
                         host=bool(g["ggml_backend_buft_is_host"](buft)), variant=list(self.variant))

    def free(self) -> None:
        if self._buffer:
            _g["ggml_backend_buffer_free"](self._buffer)
        if self._ctx:
            _g["ggml_free"](self._ctx)
        self._ctx = self._buffer = self.buft = None
        self.n_vocab = 0

    def next_block(self) -> tuple[int, int]:
        """A settings block for a new build: (its index, its first element)."""
        self.slot = (self.slot + 1) % _SLOTS
        return self.slot, self.slot * _NC * _ROWS

    def __del__(self):
        try:
            self.free()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


def _tail(n_vocab: int) -> np.ndarray:
    """The padding table of the two-stage top-k: 0 for n_vocab values, then -inf."""
    return np.concatenate([np.zeros(n_vocab, np.float32), np.full(_MAX_CHUNK, -np.inf, np.float32)])


def _set(tensor: int, values: np.ndarray, offset: int = 0) -> None:
    values = np.ascontiguousarray(values, dtype=np.float32)
    _g["ggml_backend_tensor_set"](tensor, values.ctypes.data, offset, values.nbytes)


_local = threading.local()


def _table() -> _Table:
    t = getattr(_local, "table", None)
    if t is None:
        t = _local.table = _Table()
    return t


def live() -> bool:
    """Whether fused chains are on the device on this thread (the runner then calls `draw`)."""
    t = getattr(_local, "table", None)
    return t is not None and t.live > 0


def draw(samplers) -> None:
    """Before a step: each fused chain among `samplers` (the step's output rows, as
    `(seq_id, FusedDist or None)`) draws its uniform from its own RNG; all go to the device in
    one copy."""
    t = _table()
    if t.last is not None and t.last.dirty:  # a build where fewer chains registered than expected
        BUILDS["late"] += 1
        t.last.upload()
    staged, staged4, active = t.staged, t.staged4, t.active
    active.clear()
    top = top4 = -1
    scale = sortfree.U_SCALE
    for seq, d in samplers:
        if d is not None and 0 <= seq < _SEQS:
            u = staged[seq] = d.rng.random() * scale
            if d.proposals:  # a chain without top-k: `sortfree.rejection`'s proposals too
                staged4[seq, 0] = u
                for i in range(1, d.proposals):
                    staged4[seq, i] = d.rng.random() * scale
                top4 = max(top4, seq)
            active.add(seq)
            top = max(top, seq)
    if top >= 0 and t.uniforms:
        _set(t.uniforms, staged[:top + 1])
    if top4 >= 0 and t.proposals:
        _set(t.proposals, staged4[:top4 + 1].reshape(-1))


# ---- one graph build ----

class _Build:
    """The shared computation of one logits matrix in the graph being built, and its rows.

    Each of the graph's fused chains registers once (`add`, in llama.cpp's order of sequence
    ids); the settings block goes to the device once all have (`expected`), so a build costs
    two small copies: safe defaults at the start, the rows at the end."""

    def __init__(self, t: _Table, ctx, matrix: int, n_rows: int, chains: list):
        if t.uniforms is None or t.blocks is None:
            raise RuntimeError("fused_dist: a build before the thread's device tables were allocated")
        self.t = t
        self.n_rows = n_rows
        self.slot, self.base = t.next_block()
        self.values = np.zeros((_NC, n_rows), dtype=np.float32)
        self.values[2] = _NO_CUT  # rows no fused chain owns: harmless settings
        self.values[1] = self.values[4] = 1.0
        n_vocab = _abi.tensor_facts(matrix).ne[0]  # the model's, but for llama.cpp's probes at attach
        ks = {min(int(c.row_settings[3]), n_vocab) for c in chains}
        self.k = max(ks)
        bans = {c.row_settings[4] for c in chains} if n_vocab == t.n_vocab else {0.0}
        ban = self.ban = "none" if bans == {0.0} else "all" if bans == {1.0} else "mixed"
        block = _g["ggml_view_1d"](ctx, t.blocks, _NC * n_rows, self.base * 4)
        tail = t.tail if n_vocab <= t.n_vocab else None  # its zeros must cover the row
        chunk = TOP_K_CHUNK if TOP_K_STAGES_ON_CPU or not t.cpu else 0
        temps = {c.row_settings[0] for c in chains}
        shape = Shape(min_p=any(c.row_settings[2] > 0 for c in chains), scale=temps.pop() if len(temps) == 1 else None,
                      proposals=t.proposals, cpu=t.cpu, path=PATH, whole=ks == {n_vocab})
        self.tokens = _build(ctx, matrix, n_vocab, n_rows, self.k, block, n_rows, t.uniforms, t.eog, ban,
                             len(ks) > 1, t.variant, tail, chunk, shape)
        if PATH == "staged" and t.variant[2] and tail is not None and in_stages(n_vocab, self.k, chunk, n_rows):
            BUILDS["two-stage"] += 1
        self.owned = np.zeros(n_rows, dtype=bool)  # rows whose owner is known to be active
        self.pending: tuple | None = None  # the previous chain's (view, row, chain, seq): active or not?
        self.expected, self.seen = len(chains), 0
        self.dirty = False
        self.upload()  # no row of the block may name a sequence beyond the uniforms

    def add(self, ctx, row: int, chain: FusedDist, seq: int) -> int:
        """A chain's view of its row's token; settles the previous chain with llama.cpp's flag."""
        self.settle()
        view = _g["ggml_view_1d"](ctx, self.tokens, 1, row * 4)
        # Rows other than 0 are always their owner's; row 0 is also every idle chain's. Until
        # the next chain's build shows llama.cpp's choice, take this one if its sequence drew.
        if row != 0 or (seq in self.t.active and not self.owned[0]):
            self.write(row, chain, seq)
        self.pending = (view, row, chain, seq)
        self.seen += 1
        if self.seen >= self.expected and self.dirty:
            self.upload()
        return view

    def settle(self) -> None:
        if self.pending is None:
            return
        view, row, chain, seq = self.pending
        self.pending = None
        if _abi.tensor_facts(view).flags & _FLAG_COMPUTE:
            self.owned[row] = True
            self.write(row, chain, seq)

    def write(self, row: int, chain: FusedDist, seq: int) -> None:
        new = (float(seq), *chain.row_settings)
        if tuple(self.values[:, row]) != new:
            self.values[:, row] = new
            self.dirty = True

    def upload(self) -> None:
        blocks = self.t.blocks
        if blocks is None:
            raise RuntimeError("fused_dist: the thread's device tables were freed before the build's upload")
        _set(blocks, self.values.reshape(-1), self.base * 4)
        self.dirty = False


# ---- the sampler ----

_chains: dict[int, FusedDist] = {}
_ids = itertools.count(1)
_built = threading.local()  # per thread: (ggml ctx, matrix) -> _Build


class FusedDist:
    """One sequence's top-k → top-p → min-p → temperature → dist, for a llama.cpp chain."""

    def __init__(self, params, n_vocab: int, eog_tokens: list[int]):
        self.params = params
        self.n_vocab = n_vocab
        self.eog = list(eog_tokens)
        self.row_settings = _settings(params, n_vocab)
        # uniforms a step: sortfree.PROPOSALS for a chain without top-k (its own settings decide,
        # so a seed draws the same alone or batched), else one
        self.proposals = sortfree.PROPOSALS if int(self.row_settings[3]) >= n_vocab else 0
        self.rng = random.Random()
        self.on_device = False
        self.buft = None
        table = _table()  # the creating thread's (the backend's worker)
        table.live += 1
        self._table: _Table | None = table
        self._reseed()
        # On the host (a chain llama.cpp keeps there): llama.cpp's own samplers, in the same order.
        self._host = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        add = lambda s: lc.llama_sampler_chain_add(self._host, s)  # noqa: E731
        self._bias = None
        if params.ignore_eos and eog_tokens:
            self._bias = (lc.llama_logit_bias * len(eog_tokens))(
                *[lc.llama_logit_bias(t, float("-inf")) for t in eog_tokens])
            add(lc.llama_sampler_init_logit_bias(n_vocab, len(eog_tokens), self._bias))
        add_temperature_chain(add, params, n_vocab)
        self.id = next(_ids)
        _chains[self.id] = self
        self.ptr = lc.llama_sampler_init(ctypes.byref(_IFACE), ctypes.c_void_p(self.id))

    def table(self) -> _Table:
        """The thread's table this chain draws from; gone once llama.cpp freed the chain."""
        if self._table is None:
            raise RuntimeError("this fused-dist chain was freed by llama.cpp")
        return self._table

    def _reseed(self) -> None:
        seed = self.params.seed
        self.rng.seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def _of(smpl) -> FusedDist:
    return _chains[smpl.contents.ctx]


def _name_of(view: int) -> int | None:
    """The sequence id in llama.cpp's name of a chain's logits view (`logits_seq_<id>_<i>`)."""
    name = _g["ggml_get_name"](view) or b""
    if not name.startswith(b"logits_seq_"):
        return None
    try:
        return int(name[len(b"logits_seq_"):].split(b"_")[0])
    except ValueError:
        return None


def _backend_apply(smpl, ctx, _gf, data) -> None:
    d, chain = data.contents, _of(smpl)
    t = chain.table()
    if t.blocks is None:  # a build before this chain's backend_init: not expected, but be safe
        if chain.buft is None:
            return
        t.allocate(chain.buft, chain.n_vocab, chain.eog)
    if not t.active:  # no fused chain's sequence drew for this step: all of them are idle here
        BUILDS["idle"] += 1
        d.sampled = _g["ggml_argmax"](ctx, d.logits)  # one cheap kernel, never read
        return
    seq = _name_of(d.logits)
    where = greedy.row_of(d.logits)
    if where is None or seq is None or not 0 <= seq < _SEQS:
        d.sampled = _alone(ctx, t, d.logits, chain, seq)
        return
    matrix, row = where
    builds = _built.__dict__.setdefault("builds", {})
    b = builds.get((ctx, matrix))
    if b is None:
        n_rows = _abi.tensor_facts(matrix).ne[1]  # once per build
        if n_rows > _ROWS:
            d.sampled = _alone(ctx, t, d.logits, chain, seq)
            return
        BUILDS["shared"] += 1
        b = builds[(ctx, matrix)] = t.last = _Build(t, ctx, matrix, n_rows, [c for c in _chains.values()
                                                                            if c._table is t and c.on_device] or [chain])
    BUILDS["row"] += 1
    if int(chain.row_settings[3]) > b.k or (chain.row_settings[4] and b.ban == "none"):
        d.sampled = _alone(ctx, t, d.logits, chain, seq)  # not covered by the shared part
        return
    d.sampled = b.add(ctx, row, chain, seq)


def _alone(ctx, t: _Table, logits: int, chain: FusedDist, seq: int | None) -> int:
    """The computation on one chain's logits alone (its sequence's uniform, its settings)."""
    BUILDS["own"] += 1
    facts = _abi.tensor_facts(logits)
    n = facts.ne[0] * facts.ne[1] * facts.ne[2] * facts.ne[3]
    matrix = _g["ggml_reshape_2d"](ctx, _g["ggml_cont"](ctx, logits), n, 1)
    b = _Build(t, ctx, matrix, 1, [chain])
    b.write(0, chain, seq if seq is not None and 0 <= seq < _SEQS else 0)
    b.upload()
    return _g["ggml_view_1d"](ctx, b.tokens, 1, 0)


def _backend_reset(_smpl) -> None:
    _built.__dict__.pop("builds", None)


def _backend_init(smpl, buft, _n_outputs_max_per_seq) -> bool:
    chain = _of(smpl)
    chain.buft = buft
    t = chain.table()
    missing = []
    for variant in _VARIANTS:
        op = _missing_op(buft, chain, variant)
        if op is None:
            break
        missing.append(op)
    else:
        BUILDS["host"] += 1
        log.warning("fused_dist: the device lacks %s; temperature chains sample on the host", ", ".join(missing))
        return False
    if variant != t.variant:
        log.info("fused_dist: the device lacks %s; running variant %s", ", ".join(missing), variant)
        t.variant = variant
    t.allocate(buft, chain.n_vocab, chain.eog)
    chain.on_device = True
    return True


# (ggml_top_k, I32 ids, top-k in stages, the sort-free computation) first; then without what a device
# may lack: the sort-free computation (ggml_pool_2d, ggml_soft_max_ext with a mask, ggml_clamp...),
# then as before it (the stages gather F32 ids only, so they need no I32 gathers; without them, one
# ggml_top_k per row)
_VARIANTS = ((True, True, True, True), (True, False, True, True),
             (True, True, True, False), (True, False, True, False), (True, True, False, False),
             (True, False, False, False), (False, True, False, False), (False, False, False, False))


def _missing_op(buft, chain: FusedDist, variant: tuple[bool, ...]) -> str | None:
    """The first operation of the computation the device behind `buft` does not run, by name;
    None when it runs them all (the CPU runs them all)."""
    dev = _g["ggml_backend_buft_get_device"](buft)
    if not dev:
        return None
    g = _g
    ctx = g["ggml_init"](_abi.InitParams(256 * 1024, None, True))
    try:
        n_vocab = chain.n_vocab
        m = g["ggml_reshape_2d"](ctx, g["ggml_new_tensor_1d"](ctx, _F32, n_vocab * 2), n_vocab, 2)
        block = g["ggml_new_tensor_1d"](ctx, _F32, _NC * 2)
        uniforms = g["ggml_new_tensor_1d"](ctx, _F32, 4)
        proposals = g["ggml_new_tensor_1d"](ctx, _F32, _SEQS * sortfree.PROPOSALS)
        eog = g["ggml_new_tensor_1d"](ctx, _F32, n_vocab)
        tail = g["ggml_new_tensor_1d"](ctx, _F32, n_vocab + _MAX_CHUNK)
        # the chain's k, a chat k (40) for the top-k in stages or by maxima, and no top-k (the
        # proposals), which other chains may ask; one temperature for all rows and one each
        ks = {min(int(chain.row_settings[3]), n_vocab), min(40, max(TOP_K_CHUNK // 4, 1), n_vocab), n_vocab}
        gf = g["ggml_new_graph"](ctx)
        for k in ks:
            for scale in (None, 1.25):
                shape = Shape(scale=scale, proposals=proposals, whole=k == n_vocab)
                out = _build(ctx, m, n_vocab, 2, k, block, 2, uniforms, eog, "mixed", k != n_vocab, variant, tail,
                             TOP_K_CHUNK, shape)
                g["ggml_build_forward_expand"](gf, out)
        for i in range(g["ggml_graph_n_nodes"](gf)):
            node = g["ggml_graph_node"](gf, i)
            if not g["ggml_backend_dev_supports_op"](dev, node):
                return _g["ggml_op_desc"](node).decode()
        return None
    finally:
        g["ggml_free"](ctx)


def _apply(smpl, cur_p) -> None:
    """On the host: llama.cpp's own top-k, top-p, min-p, temperature and dist."""
    lc.llama_sampler_apply(_of(smpl)._host, cur_p)


def _reset(smpl) -> None:
    chain = _of(smpl)
    chain._reseed()
    lc.llama_sampler_reset(chain._host)


def _free(smpl) -> None:
    chain = _chains.pop(smpl.contents.ctx, None)
    if chain is None:
        return
    if chain._table is not None:
        chain._table.live -= 1
        chain._table = None
    chain.on_device = False
    lc.llama_sampler_free(chain._host)
    chain._host = None


_IFACE, _KEEP = sampler_interface(b"fused-dist", apply=_apply, reset=_reset, free=_free,
                                  backend_init=_backend_init, backend_apply=_backend_apply,
                                  backend_reset=_backend_reset)


def fused_dist(params, n_vocab: int, eog_tokens: list[int]) -> FusedDist:
    """A new sampler for `params` (see `supports`); a chain that takes its `ptr` owns and frees it."""
    return FusedDist(params, n_vocab, eog_tokens)


# ---- the same computation on ggml's CPU backend, for tests and checks ----

def sample_rows(logits: np.ndarray, settings: list, uniforms: np.ndarray, eog_tokens=(), threads: int = 1,
                variant: tuple[bool, ...] = _VARIANTS[0], chunk: int | None = None) -> np.ndarray:
    """Tokens the device computation draws for each row of `logits` (rows x n_vocab, F32), row r
    with `settings[r]` (`SamplingParams`) and uniform `uniforms[r]` (rows x sortfree.PROPOSALS for
    rows without top-k: their proposals; a row of one: the first, the others drawn from a fixed
    seed), computed by ggml's CPU backend from the graph `_build` makes on the path `PATH`
    (`variant`: see `_build`; `chunk`: the two-stage top-k's, `TOP_K_CHUNK` when None)."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    n_rows, n_vocab = logits.shape
    cols = np.zeros((_NC, n_rows), dtype=np.float32)
    cols[0] = np.arange(n_rows)
    for r, p in enumerate(settings):
        cols[1:, r] = _settings(p, n_vocab)
    ks = {int(v) for v in cols[4]}
    temps = set(cols[1].tolist())
    bans = set(cols[5].tolist())
    ban = "none" if bans == {0.0} else "all" if bans == {1.0} else "mixed"
    bias = np.zeros(n_vocab, dtype=np.float32)
    bias[[t for t in eog_tokens if 0 <= t < n_vocab]] = _BAN
    u = np.asarray(uniforms, np.float64).reshape(n_rows, -1)
    props = np.random.default_rng(12345).random((n_rows, sortfree.PROPOSALS))
    props[:, :u.shape[1]] = u[:, :sortfree.PROPOSALS]
    props = (props * sortfree.U_SCALE).astype(np.float32)
    shape = Shape(min_p=bool((cols[3] > 0).any()), scale=temps.pop() if len(temps) == 1 else None,
                  cpu=True, path=PATH, whole=ks == {n_vocab})

    def build(ctx, tensor) -> int:
        m = _g["ggml_reshape_2d"](ctx, tensor(logits.reshape(-1)), n_vocab, n_rows)
        return _build(ctx, m, n_vocab, n_rows, max(ks), tensor(cols.reshape(-1)), n_rows,
                      tensor(props[:, 0].copy()), tensor(bias), ban, len(ks) > 1, variant,
                      tensor(_tail(n_vocab)), TOP_K_CHUNK if chunk is None else _checked_chunk(chunk),
                      dataclasses.replace(shape, proposals=tensor(props.reshape(-1))))

    # every intermediate lives in the context: the proposals' are PROPOSALS rows wide
    return _on_cpu(build, logits.nbytes, threads, 48 + 16 * shape.whole).view(np.int32).copy()


def top_k_rows(logits: np.ndarray, k: int, chunk: int | None = None, threads: int = 1,
               maxima: bool = False) -> np.ndarray:
    """The token ids (rows x k, by descending logit) that the device computation keeps for a
    top-k of `k` over each row of `logits` (rows x n_vocab, F32), computed by ggml's CPU
    backend: by maxima (`maxima`, `sortfree.pooled_top_k`), else in stages of `chunk`
    (`TOP_K_CHUNK` when None) where `in_stages` says, else one `ggml_top_k` per row."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    n_rows, n_vocab = logits.shape
    if not 0 < k <= n_vocab:
        raise ValueError(f"k must be in 1..{n_vocab}, not {k}")
    if maxima and not sortfree.pooled(n_vocab, k):
        raise ValueError(f"no top-k of {k} by maxima over {n_vocab} tokens")
    size = TOP_K_CHUNK if chunk is None else _checked_chunk(chunk)

    def build(ctx, tensor) -> int:
        m = _g["ggml_reshape_2d"](ctx, tensor(logits.reshape(-1)), n_vocab, n_rows)
        if maxima:
            n_pad = -(-n_vocab // sortfree.POOL) * sortfree.POOL
            x = _g["ggml_add"](ctx, _g["ggml_pad"](ctx, m, n_pad - n_vocab, 0, 0, 0),
                               _g["ggml_view_1d"](ctx, tensor(_tail(n_vocab)), n_pad, 0))
            return sortfree.pooled_top_k(_g, ctx, x, n_pad, n_rows, k)[1]
        _, ids, _int_ids = _top_k(ctx, m, n_vocab, n_rows, k, (True, False, True), tensor(_tail(n_vocab)), size)
        return ids  # F32 ids (int_ids is False for this variant)

    return _on_cpu(build, logits.nbytes, threads).reshape(n_rows, k).astype(np.int64)


def _on_cpu(build, input_bytes: int, threads: int, scale: int = 48) -> np.ndarray:
    """Run `build(ctx, tensor)`'s output on ggml's CPU backend (`tensor(values)`: an F32 input);
    its values as F32 (the bytes of an I32 output: view them as such)."""
    g = _g
    work = input_bytes * scale + (1 << 26)  # every intermediate of the graph lives in this context
    ctx = g["ggml_init"](_abi.InitParams(work, None, False))
    if not ctx:
        raise MemoryError("ggml_init failed")
    try:
        def tensor(values: np.ndarray) -> int:
            x = g["ggml_new_tensor_1d"](ctx, _F32, values.size)
            ctypes.memmove(g["ggml_get_data"](x), np.ascontiguousarray(values, np.float32).ctypes.data,
                           values.size * 4)
            return x

        out = build(ctx, tensor)
        gf = g["ggml_new_graph"](ctx)
        g["ggml_build_forward_expand"](gf, out)
        if g["ggml_graph_compute_with_ctx"](ctx, gf, threads) != 0:
            raise RuntimeError("ggml_graph_compute_with_ctx failed")
        facts = _abi.tensor_facts(out)
        n = facts.ne[0] * facts.ne[1] * facts.ne[2] * facts.ne[3]
        return np.ctypeslib.as_array(ctypes.cast(g["ggml_get_data"](out), ctypes.POINTER(ctypes.c_float)),
                                     shape=(n,)).copy()
    finally:
        g["ggml_free"](ctx)


def reference_probs(logits: np.ndarray, params, eog_tokens=()) -> np.ndarray:
    """llama.cpp's own chain for `params` (logit bias for ignore_eos, top-k, top-p, min-p,
    temperature, dist) applied on the host to one row of logits: the probability of each token."""
    n_vocab = logits.shape[0]
    chain = FusedDist(params, n_vocab, list(eog_tokens))
    try:
        arr = (lc.llama_token_data * n_vocab)(*[lc.llama_token_data(i, float(x), 0.0) for i, x in enumerate(logits)])
        cur = lc.llama_token_data_array(arr, n_vocab, -1, False)
        lc.llama_sampler_apply(chain._host, ctypes.byref(cur))
        probs = np.zeros(n_vocab)
        for i in range(cur.size):
            probs[arr[i].id] = arr[i].p
        return probs
    finally:
        lc.llama_sampler_free(chain.ptr)


def chi_square_ok(counts: np.ndarray, probs: np.ndarray, alpha_z: float = 3.719) -> tuple[bool, float, float]:
    """Pearson's chi-square of `counts` against `probs` (cells with expected < 5 pooled), and
    its critical value at the one-sided normal quantile `alpha_z` (3.719: 1e-4) by the
    Wilson–Hilferty approximation: (statistic <= critical, statistic, critical). Counts on a
    zero-probability token fail outright."""
    n = counts.sum()
    if counts[probs <= 0].sum() > 0:
        return False, math.inf, 0.0
    exp = probs * n
    big = exp >= 5
    obs_cells = list(counts[big]) + [counts[~big & (probs > 0)].sum()]
    exp_cells = list(exp[big]) + [exp[~big & (probs > 0)].sum()]
    if exp_cells[-1] < 1e-9:
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
    stat = float(sum((o - e) ** 2 / e for o, e in zip(obs_cells, exp_cells)))
    df = max(len(exp_cells) - 1, 1)
    crit = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat <= crit, stat, crit
