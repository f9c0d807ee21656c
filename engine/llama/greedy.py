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
_built = threading.local()  # per thread: (ggml context, logits matrix) -> their argmax


def _row_of(logits: int) -> tuple[int, int] | None:
    """(matrix, row) when `logits` is one whole row of a contiguous 2-D F32 matrix."""
    t = _abi.tensor_facts(logits)
    if not t.view_src or t.type != _GGML_TYPE_F32 or t.ne[1:] != (1, 1, 1):
        return None
    m = _abi.tensor_facts(t.view_src)
    row_bytes = m.nb[1]
    if (m.type != _GGML_TYPE_F32 or m.ne[0] != t.ne[0] or m.nb[0] != 4 or row_bytes != 4 * m.ne[0]
            or m.ne[2:] != (1, 1) or t.view_offs % row_bytes or t.view_offs // row_bytes >= m.ne[1]):
        return None
    return t.view_src, t.view_offs // row_bytes


def _backend_apply(_smpl, ctx, _gf, data) -> None:
    d = data.contents
    where = _row_of(d.logits)
    if where is None:
        BUILDS["own"] += 1
        flat = ggml_reshape_1d(ctx, d.logits, ggml_nelements(d.logits))
        d.sampled = ggml_set_name(ggml_argmax(ctx, flat), b"greedy_argmax")
        return
    BUILDS["row"] += 1
    matrix, row = where
    cache = _built.__dict__.setdefault("argmax", {})
    rows = cache.get((ctx, matrix))
    if rows is None:
        BUILDS["shared"] += 1
        rows = cache[(ctx, matrix)] = ggml_set_name(ggml_argmax(ctx, matrix), b"greedy_argmax_rows")
    d.sampled = ggml_view_1d(ctx, rows, 1, row * 4)


def _backend_reset(_smpl) -> None:
    _built.__dict__.pop("argmax", None)


def _backend_init(_smpl, _buft, _n_outputs_max_per_seq) -> bool:
    return True


def _apply(_smpl, cur_p) -> None:
    """Host greedy: the index of the largest logit among the candidates."""
    arr = cur_p.contents
    data = np.ctypeslib.as_array(ctypes.cast(arr.data, ctypes.POINTER(ctypes.c_float)), shape=(arr.size * 3,))
    arr.selected = int(np.argmax(data[1::3]))  # llama_token_data: id, logit, p


_IFACE, _KEEP = sampler_interface(b"fused-greedy", apply=_apply, backend_init=_backend_init,
                                  backend_apply=_backend_apply, backend_reset=_backend_reset)


def fused_greedy():
    """A new greedy sampler (stateless; a chain that takes it owns and frees it)."""
    return lc.llama_sampler_init(ctypes.byref(_IFACE), None)
