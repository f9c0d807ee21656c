"""Greedy sampling on the device: one argmax for every sequence of a step.

llama.cpp builds each sequence's device sampler chain on its own: its `greedy` sampler adds
an argmax over that sequence's row of logits (151,936 entries for a Qwen2.5 vocabulary) as
a kernel of its own, and CUDA runs an argmax with one block per row, so a step of B sequences
runs B argmax kernels one after another, each on one of the GPU's SMs. `fused_greedy()` makes
the same choice for all rows at once: the first chain to build its part of a step's graph
adds one argmax over the whole logits matrix, and every chain takes its own row's result as
a view of it (`t_sampled` of that row).

It relies on how llama.cpp hands a chain its logits — a 1-D view of one row of a 2-D F32
matrix (`build_sampling` in llama-graph.cpp), read through our mirror of `struct ggml_tensor`
(`_abi.tensor_facts`, checked against ggml when the package loads). Where that is not so (a sampler earlier in the
chain made a new tensor, or another llama.cpp) it adds the argmax of its own row, exactly
what llama.cpp's greedy does. `BUILDS` counts which way each build went. On the host
(`apply`: a chain that llama.cpp keeps off the device) it picks the largest logit.

Graph building happens on the thread that calls `llama_decode` (each backend's worker), so
the shared argmax is remembered per thread and forgotten at `backend_reset`, which llama.cpp
calls for every chain before each graph's sampling part is built.
"""

from __future__ import annotations

import collections
import ctypes
import threading
from typing import Any

import numpy as np

from . import _abi, holding_gil, lc, sampler_interface

_GGML_TYPE_F32 = 0

_P = ctypes.c_void_p
ggml_argmax = holding_gil("ggml_argmax", [_P, _P], _P)
ggml_view_1d = holding_gil("ggml_view_1d", [_P, _P, ctypes.c_int64, ctypes.c_size_t], _P)
ggml_reshape_1d = holding_gil("ggml_reshape_1d", [_P, _P, ctypes.c_int64], _P)
ggml_nelements = holding_gil("ggml_nelements", [_P], ctypes.c_int64)
ggml_set_name = holding_gil("ggml_set_name", [_P, ctypes.c_char_p], _P)

# "shared": argmaxes over a whole logits matrix; "row": chain builds that took their row of
# one; "own": chain builds with an argmax of their own (incl. llama.cpp's probe at attach)
BUILDS: collections.Counter = collections.Counter()
_built = threading.local()  # per thread: (ggml context, logits matrix) -> _Matrix, this build's


class _Matrix:
    """A logits matrix of the graph being built, checked once per build: its shape, and the
    argmax over all its rows once a chain took a row of it."""

    __slots__ = ("n_cols", "n_rows", "row_bytes", "rows")

    def __init__(self, n_cols: int, n_rows: int) -> None:
        self.n_cols, self.n_rows, self.row_bytes = n_cols, n_rows, 4 * n_cols
        self.rows = None  # the shared argmax, made by the first chain that takes a row


def _matrix(address: int) -> _Matrix | None:
    """The matrix at `address` when it is a contiguous 2-D F32 one, else None."""
    m = _abi.tensor_facts(address)
    if (m.type != _GGML_TYPE_F32 or m.ne[0] <= 0 or m.nb[0] != 4 or m.nb[1] != 4 * m.ne[0]
            or m.ne[2:] != (1, 1)):
        return None
    return _Matrix(m.ne[0], m.ne[1])


def _row(t: _abi.GgmlTensor, m: _Matrix) -> int | None:
    """The row of `m` that the live tensor `t` (a view of `m`) is, whole; else None."""
    if t.type != _GGML_TYPE_F32:
        return None
    ne = t.ne
    row, off = divmod(t.view_offs, m.row_bytes)
    return row if ne[0] == m.n_cols and ne[1] == ne[2] == ne[3] == 1 and not off and row < m.n_rows else None


def row_of(logits: int) -> tuple[int, int] | None:
    """(matrix, row) when `logits` is one whole row of a contiguous 2-D F32 matrix (one read in
    place and one of the matrix: the samplers' build callbacks, this module's and fused_dist's)."""
    t = _abi.live_tensor(logits)
    m = _matrix(t.view_src) if t.view_src else None
    row = _row(t, m) if m is not None else None
    return None if row is None else (t.view_src, row)


def _backend_apply(_smpl: Any, ctx: Any, _gf: Any, data: Any) -> None:
    # Runs for every attached chain at every graph build (at B = 128, every second step, as
    # n_kv grows). Two full `tensor_facts` copies per chain took 8-12 us a chain, ~1.5 ms a
    # build; the matrix is now checked once per build and each chain reads a few fields of its
    # own view in place: 2.4 us a chain, 3.8 with llama.cpp's two calls into Python (2-core dev
    # machine, 128 rows of a 151,936-column matrix).
    d = data.contents
    t = _abi.live_tensor(d.logits)
    src = t.view_src
    cache = _built.__dict__.setdefault("matrices", {})
    m = cache.get((ctx, src), False)
    if m is False:
        m = cache[(ctx, src)] = _matrix(src) if src else None
    row = _row(t, m) if m is not None else None
    if row is None:  # not one whole row of a contiguous F32 matrix: an argmax of its own, as llama.cpp's greedy
        BUILDS["own"] += 1
        flat = ggml_reshape_1d(ctx, d.logits, ggml_nelements(d.logits))
        d.sampled = ggml_set_name(ggml_argmax(ctx, flat), b"greedy_argmax")
        return
    BUILDS["row"] += 1
    if m.rows is None:
        BUILDS["shared"] += 1
        m.rows = ggml_set_name(ggml_argmax(ctx, src), b"greedy_argmax_rows")
    d.sampled = ggml_view_1d(ctx, m.rows, 1, row * 4)


def _backend_reset(_smpl: Any) -> None:
    _built.__dict__.pop("matrices", None)


def _backend_init(_smpl: Any, _buft: Any, _n_outputs_max_per_seq: Any) -> bool:
    return True


def _apply(_smpl: Any, cur_p: Any) -> None:
    """Host greedy: the index of the largest logit among the candidates."""
    arr = cur_p.contents
    data = np.ctypeslib.as_array(ctypes.cast(arr.data, ctypes.POINTER(ctypes.c_float)), shape=(arr.size * 3,))
    arr.selected = int(np.argmax(data[1::3]))  # llama_token_data: id, logit, p


_IFACE, _KEEP = sampler_interface(b"fused-greedy", apply=_apply, backend_init=_backend_init,
                                  backend_apply=_backend_apply, backend_reset=_backend_reset)


def fused_greedy() -> Any:
    """A new greedy sampler (stateless; a chain that takes it owns and frees it)."""
    return lc.llama_sampler_init(ctypes.byref(_IFACE), None)
