"""Every private, version-bound part of llama-cpp-python the engine uses, checked when it loads.

llama-cpp-python binds llama.cpp's public C API; the engine goes past it in three places, and
only this module does:

* `llama_cpp.llama_cpp._lib`, llama_cpp's `ctypes.CDLL` of libllama. Its path opens a second
  handle (`ctypes.PyDLL`) whose functions keep the GIL (`engine.llama.holding_gil` says why),
  and ggml's functions, which llama_cpp does not bind, resolve through it (`function()`).
* `_ZN13llama_context21get_sampled_token_ithEi`, the C++ method
  `llama_context::get_sampled_token_ith(int)` that libllama exports: the sampled token without
  the stream sync of the public `llama_get_sampled_token_ith` (`sampled_token_method()`).
* `_ZNK13llama_context18get_sampled_tokensEv`, `llama_context::get_sampled_tokens()`: the
  context's buffer of sampled tokens, one per output row, which the method above indexes
  (`sampled_tokens_reader()`): a step's tokens in one read instead of one call per row.
* `GgmlTensor`, a ctypes mirror of `struct ggml_tensor` (ggml.h), through which the fused
  samplers (`engine.llama.greedy`, `engine.llama.fused_dist`) read the shape and view source of
  the logits llama.cpp hands them, and which output llama.cpp chose for a chain (`flags`)
  (`tensor_facts()`, a copy; `live_tensor()`, the struct in place, for the few fields a hot
  callback reads).

None of these is covered by a stable ABI, so a different llama-cpp-python (another llama.cpp
inside) could crash the process far from here. `check()` runs when `engine.llama` is first
imported, before anything else in the engine touches the library:

1. `llama_cpp.__version__` must be one of `SUPPORTED`, the versions this module was written and
   checked against; any other stops with `NativeABIError` naming the version found and the one
   supported, before a private part is touched.
2. `_lib` must be there, a `ctypes.CDLL` with a path.
3. The mirror must read what ggml wrote: a ggml context builds a matrix and a view of one of its
   rows, and every field the samplers read (`type`, `ne`, `nb`, `view_src`, `view_offs`, `flags`) plus the
   fields around them (`buffer`, `op`, `op_params`, `flags`, `src`, `data`, `name`) is compared
   with what ggml's public functions report. Any difference is a `NativeABIError` naming the field.
4. The C++ methods are looked up. Their absence is not an error: `engine.llama` then reads
   tokens through the public function (one stream sync per read: slower, never wrong), and says
   so in the log; without `get_sampled_tokens` alone, one call per row.

`NativeABIError` is a `ModelLoadError` (the engine's error for a model that cannot be loaded)
and an `ImportError` (it is raised while `engine.llama` is being imported).

Thread contract: `check()` runs once, at import, on the importing thread. `function()`,
`sampled_token_method()`, `sampled_tokens_reader()`, `tensor_facts()` and `live_tensor()` hold no
state of their own and may be called from any thread; the last two only while the tensor they read
is alive (during a graph build).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llama_cpp

from engine.core.errors import ModelLoadError

log = logging.getLogger("llama.cpp")

# llama-cpp-python releases this module was written against and checked with (tests/test_llama_abi.py).
SUPPORTED = ("0.3.36",)

_SAMPLED_TOKEN_METHOD = "_ZN13llama_context21get_sampled_token_ithEi"  # llama_context::get_sampled_token_ith(int)
_SAMPLED_TOKENS_METHOD = "_ZNK13llama_context18get_sampled_tokensEv"  # llama_context::get_sampled_tokens() const


class NativeABIError(ModelLoadError, ImportError):
    """The installed llama-cpp-python is not the one the engine's native layer was written for."""


class GgmlTensor(ctypes.Structure):
    """`struct ggml_tensor` (ggml.h of llama-cpp-python 0.3.36), read-only."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


@dataclass(frozen=True, slots=True)
class TensorFacts:
    """What the sampler needs of one `ggml_tensor`: a copy, so nothing else reads the struct."""

    type: int  # enum ggml_type: 0 is F32
    ne: tuple[int, int, int, int]  # elements per dimension
    nb: tuple[int, int, int, int]  # stride of each dimension, in bytes
    view_src: int  # the tensor this one is a view of; 0 when it is not a view
    view_offs: int  # where the view starts in `view_src`, in bytes
    flags: int  # enum ggml_tensor_flag bits (16: GGML_TENSOR_FLAG_COMPUTE, set by ggml_build_forward_select)


def live_tensor(address: int) -> GgmlTensor:
    """The `ggml_tensor` at `address`, read in place (no copy): for a hot path that reads a few
    fields; only while the tensor is alive (during a graph build)."""
    return GgmlTensor.from_address(address)


def tensor_facts(address: int) -> TensorFacts:
    """The facts of the live `ggml_tensor` at `address`."""
    t = GgmlTensor.from_address(address)
    return TensorFacts(t.type, tuple(t.ne), tuple(t.nb), t.view_src or 0, t.view_offs, t.flags)


# ---- the library's handles ----

_lib: ctypes.CDLL | None = None  # llama_cpp's CDLL of libllama, once `check()` found it
_held: ctypes.PyDLL | None = None  # the same library, with functions that keep the GIL


def function(name: str, argtypes: list, restype: Any, *, keep_gil: bool) -> Callable[..., Any]:
    """A new binding of llama.cpp's or ggml's C function `name` (ggml's symbols resolve through
    libllama, which links them). `keep_gil`: called without releasing the GIL (for calls that
    return within microseconds); otherwise as llama_cpp calls everything. A binding of its own,
    so its argtypes never change one llama_cpp or another caller made of the same symbol.
    AttributeError when libllama has no such symbol."""
    handle = _held if keep_gil else _lib
    assert handle is not None, "engine.llama._abi.check() has not run"
    f = handle[name]
    f.argtypes, f.restype = argtypes, restype
    return f


def sampled_tokens_reader() -> Callable[[Any, int], list[int] | None] | None:
    """`(ctx, n) -> list` of the sampled tokens of output rows 0 .. n - 1 of the last decode, read
    from the buffer `llama_context::get_sampled_tokens()` returns (None when it has none),
    keeping the GIL; or None when libllama exports not both C++ methods. The buffer method
    neither synchronises nor applies llama.cpp's pending output reorder, so one token is read
    through `sampled_token_method()` first, which applies it. Valid only after
    `llama_synchronize` following the last decode."""
    one = sampled_token_method()
    try:
        buffer = function(_SAMPLED_TOKENS_METHOD, [llama_cpp.llama_context_p_ctypes], ctypes.c_void_p, keep_gil=True)
    except AttributeError:
        return None
    if one is None:
        return None

    def read(ctx: Any, n: int) -> list[int] | None:
        one(ctx, 0)
        address = buffer(ctx)
        return (ctypes.c_int32 * n).from_address(address)[:] if address else None

    return read


def sampled_token_method() -> Callable[[Any, int], int] | None:
    """`llama_context::get_sampled_token_ith(int)` as `(ctx, i) -> token`, keeping the GIL, or
    None when libllama does not export it. Valid only after `llama_synchronize` following the
    last decode: unlike the public function it does not synchronise."""
    try:
        return function(_SAMPLED_TOKEN_METHOD, [llama_cpp.llama_context_p_ctypes, ctypes.c_int32],
                        llama_cpp.llama_token, keep_gil=True)
    except AttributeError:
        return None


# ---- the check ----

@dataclass(frozen=True, slots=True)
class Report:
    """What `check()` found."""

    version: str
    library: str  # path of libllama
    sampled_token_method: bool  # libllama exports llama_context::get_sampled_token_ith
    sampled_tokens_method: bool = False  # and llama_context::get_sampled_tokens


def check() -> Report:
    """Check the installed llama-cpp-python against what this module relies on (see the module
    docstring); `NativeABIError` at the first difference."""
    global _lib, _held
    found = str(getattr(llama_cpp, "__version__", "unknown"))
    if found not in SUPPORTED:
        raise NativeABIError(
            f"llama-cpp-python {found} is installed, but Tandem's native layer (engine/llama/_abi.py) "
            f"supports llama-cpp-python {' or '.join(SUPPORTED)} only: it reaches into private parts of "
            f"that version (its library handle, a C++ symbol of libllama, ggml's tensor struct) that "
            f"another version may lay out differently. Install the supported version "
            f"(pip install 'llama-cpp-python=={SUPPORTED[-1]}', with the CMAKE_ARGS of your build; see the "
            f"README), or port engine/llama/_abi.py to {found} and add it to SUPPORTED."
        )
    lib = getattr(llama_cpp.llama_cpp, "_lib", None)
    path = getattr(lib, "_name", None)
    if not isinstance(lib, ctypes.CDLL) or not isinstance(path, str):
        raise NativeABIError(f"llama-cpp-python {found} has no `llama_cpp.llama_cpp._lib` library handle with a "
                             f"path, which engine/llama/_abi.py relies on (supported: {', '.join(SUPPORTED)})")
    _lib, _held = lib, ctypes.PyDLL(path)
    check_tensor_layout(GgmlTensor, found)
    method = sampled_token_method() is not None
    if not method:
        log.warning("libllama (llama-cpp-python %s) does not export %s: sampled tokens are read through "
                    "llama_get_sampled_token_ith, one stream sync per read", found, _SAMPLED_TOKEN_METHOD)
    bulk = sampled_tokens_reader() is not None
    return Report(found, path, method, bulk)


class InitParams(ctypes.Structure):
    """`struct ggml_init_params` (ggml.h; public, but ggml is not bound by llama_cpp)."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


_GGML_TYPE_F32 = 0
_GGML_TENSOR_FLAG_OUTPUT = 2


def check_tensor_layout(mirror: type[ctypes.Structure], version: str | None = None) -> None:
    """Compare what `mirror` (a ctypes mirror of `struct ggml_tensor`) reads from tensors ggml
    builds with what ggml's public functions say about them; `NativeABIError` naming the first
    field that differs. The tensors are a 1000 x 7 F32 matrix named `abi-probe` and a view of
    its row 5, marked as a graph output, in a ggml context of their own."""
    P = ctypes.c_void_p
    init = function("ggml_init", [InitParams], P, keep_gil=False)
    free = function("ggml_free", [P], None, keep_gil=False)
    new_2d = function("ggml_new_tensor_2d", [P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], P, keep_gil=False)
    view_1d = function("ggml_view_1d", [P, P, ctypes.c_int64, ctypes.c_size_t], P, keep_gil=False)
    set_name = function("ggml_set_name", [P, ctypes.c_char_p], P, keep_gil=False)
    get_name = function("ggml_get_name", [P], P, keep_gil=False)
    get_data = function("ggml_get_data", [P], P, keep_gil=False)
    set_output = function("ggml_set_output", [P], None, keep_gil=False)
    op_name = function("ggml_op_name", [ctypes.c_int], ctypes.c_char_p, keep_gil=False)
    type_name = function("ggml_type_name", [ctypes.c_int], ctypes.c_char_p, keep_gil=False)

    ctx = init(InitParams(1 << 20, None, False))
    if not ctx:
        raise NativeABIError("ggml_init could not make a 1 MiB context to check the ggml_tensor layout")
    try:
        row = 5
        m = new_2d(ctx, _GGML_TYPE_F32, 1000, 7)
        set_name(m, b"abi-probe")
        v = view_1d(ctx, m, 1000, row * 4000)
        set_output(v)
        mt, vt = mirror.from_address(m), mirror.from_address(v)
        # (field, what the mirror reads, what ggml says), checked in this order: the last two
        # hand values the mirror read to ggml, which only the fields around them make safe.
        facts = [
            ("type", lambda: mt.type, lambda: _GGML_TYPE_F32),
            ("buffer", lambda: mt.buffer, lambda: None),  # a plain ggml context's tensor has no backend buffer
            ("ne", lambda: tuple(mt.ne), lambda: (1000, 7, 1, 1)),
            ("nb", lambda: tuple(mt.nb), lambda: (4, 4000, 28000, 28000)),
            ("data", lambda: mt.data, lambda: get_data(m)),
            ("name", lambda: ctypes.addressof(mt) + type(mt).name.offset, lambda: get_name(m)),
            ("name text", lambda: mt.name, lambda: b"abi-probe"),
            ("view ne", lambda: tuple(vt.ne), lambda: (1000, 1, 1, 1)),
            ("op_params", lambda: ctypes.c_int64.from_buffer_copy(bytes(vt.op_params)[:8]).value,  # a view's offset
             lambda: row * 4000),
            ("flags", lambda: vt.flags & _GGML_TENSOR_FLAG_OUTPUT, lambda: _GGML_TENSOR_FLAG_OUTPUT),
            ("src", lambda: vt.src[0], lambda: m),
            ("view_src", lambda: vt.view_src, lambda: m),
            ("view_offs", lambda: vt.view_offs, lambda: row * 4000),
            ("view data", lambda: vt.data, lambda: get_data(v)),
            ("type name", lambda: type_name(mt.type), lambda: b"f32"),
            ("op", lambda: op_name(vt.op), lambda: b"VIEW"),
        ]
        for field, read_fn, truth_fn in facts:
            read, truth = read_fn(), truth_fn()
            if read != truth:
                raise NativeABIError(
                    f"the ctypes mirror of struct ggml_tensor in engine/llama/_abi.py does not match the ggml inside "
                    f"llama-cpp-python {version or llama_cpp.__version__}: its `{field}` reads {read!r} where ggml "
                    f"has {truth!r} (supported: llama-cpp-python {', '.join(SUPPORTED)})")
    finally:
        free(ctx)


REPORT = check()
