"""The one place that loads llama.cpp: library start-up, its log, device facts.

Import order: on the GPU machine a process that had imported numpy *before* the llama.cpp
shared libraries crashed while loading a CPU-only model. `engine/__init__.py` imports this
module first, so any `import engine...` loads libllama (and its ggml backends) before numpy
is touched by our code; `tests/test_import_order.py` checks it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import llama_cpp as lc  # noqa: E402  (must stay the first heavy import)
from llama_cpp.llama_cpp import _lib as _lc_lib  # noqa: E402

log = logging.getLogger("llama.cpp")

# Calls made for every generated token return within microseconds. Through ctypes.CDLL (as
# llama_cpp binds everything) each one releases the GIL and must win it back, and while a
# UI or HTTP thread runs Python that can take the whole switch interval (5 ms) — per call.
# These bindings of the same functions keep the GIL (ctypes.PyDLL); llama_decode and
# llama_synchronize, which wait on the device, still release it. ggml's functions resolve
# through the same handle (libllama's dependencies).
_held = ctypes.PyDLL(_lc_lib._name)


def holding_gil(name: str, argtypes: list, restype):
    """A binding of llama.cpp's (or ggml's) function `name` that keeps the GIL."""
    f = getattr(_held, name)
    f.argtypes, f.restype = argtypes, restype
    return f


get_sampled_token_ith = holding_gil("llama_get_sampled_token_ith", [lc.llama_context_p_ctypes, ctypes.c_int32],
                                    lc.llama_token)
sampler_accept = holding_gil("llama_sampler_accept", [lc.llama_sampler_p_ctypes, lc.llama_token], None)


def _sampled_token_after_sync():
    """`llama_get_sampled_token_ith` synchronises the context (a stream sync per backend)
    before every read: B times per step, where the backend has synchronised once already.
    The context's own method, which libllama exports as a C++ symbol, reads the same token
    without that; a build without the symbol gets the public function."""
    try:
        f = holding_gil("_ZN13llama_context21get_sampled_token_ithEi",  # llama_context::get_sampled_token_ith(int)
                        [lc.llama_context_p_ctypes, ctypes.c_int32], lc.llama_token)
    except AttributeError:
        return get_sampled_token_ith
    return f


# Only after `llama_synchronize` following the last decode (ContextRunner.execute does it).
sampled_token_after_sync = _sampled_token_after_sync()

_init_lock = threading.Lock()
_initialized = False

# ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR, 5: logging.DEBUG}


@lc.llama_log_callback
def _log_callback(level, text, _user_data):
    # Called from llama.cpp threads; keep it cheap. Only warnings and errors are forwarded
    # unless TANDEM_LLAMA_LOG=1 asks for everything.
    lvl = _LEVELS.get(level, logging.DEBUG)
    if lvl >= logging.WARNING or _verbose:
        log.log(max(lvl, logging.INFO) if _verbose else lvl, text.decode("utf-8", "replace").rstrip())


_verbose = os.environ.get("TANDEM_LLAMA_LOG") == "1"


def init() -> None:
    """Initialise llama.cpp once per process (idempotent, thread-safe)."""
    global _initialized
    with _init_lock:
        if _initialized:
            return
        lc.llama_log_set(_log_callback, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _initialized = True


def gpu_offload_supported() -> bool:
    """Whether this llama.cpp build has a GPU backend (CUDA, Metal, Vulkan, ...)."""
    init()
    return bool(lc.llama_supports_gpu_offload())


def pick_device(device: str) -> str:
    """Resolve `auto` and refuse a GPU request on a build without GPU offload."""
    from .errors import ModelLoadError

    if device not in ("cpu", "gpu", "auto"):
        raise ModelLoadError(f"unknown device {device!r}: use cpu, gpu or auto")
    if device == "auto":
        return "gpu" if gpu_offload_supported() else "cpu"
    if device == "gpu" and not gpu_offload_supported():
        raise ModelLoadError(
            "device gpu asked for, but this llama-cpp-python build has no GPU backend "
            "(reinstall it with CMAKE_ARGS, see the README)"
        )
    return device


# An empty, NULL-terminated device list: a model loaded with it never touches a GPU, even in
# a GPU build (n_gpu_layers=0 alone still puts compute buffers and prompt matmuls on the GPU).
_NO_DEVICES = (ctypes.c_void_p * 1)(None)


def cpu_only(model_params) -> None:
    model_params.devices = ctypes.cast(_NO_DEVICES, ctypes.c_void_p)
    model_params.n_gpu_layers = 0


def system_info() -> str:
    init()
    return lc.llama_print_system_info().decode("utf-8", "replace")


init()
