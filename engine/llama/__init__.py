"""The one boundary between the engine and llama.cpp: library start-up, its log, device facts.

The package: this module (start-up, GIL-keeping bindings, devices), `model` (finding, checking
and loading GGUF models), `greedy` and `fused_dist` (our fused greedy and temperature samplers), `synthetic` (writing synthetic
GGUF models) and `_abi`, the only module that touches llama-cpp-python's private parts (its
library handle, a C++ symbol of libllama, a mirror of ggml's tensor struct). `_abi` checks them
against the installed llama-cpp-python when this package is imported, so a version it was not
written for stops here with a `NativeABIError` naming both versions, not with a crash later.

Devices: `devices()` lists ggml's backend devices (CPU, CUDA0, CUDA1, ...) through ggml's
own registry, without loading a model; `gpus()` are the GPUs among them, in ggml's order, so
"GPU N" (`gpu:device=N` in a backend spec) means `gpus()[N]`. `on_device()` restricts a model
to one of them through `llama_model_params.devices`, as `cpu_only()` restricts it to none.

Import order: on the GPU machine a process that had imported numpy *before* the llama.cpp
shared libraries crashed while loading a CPU-only model. So this package is the first import of
`engine.llama.model` (through which every backend loads its model), and the entry points that
load models import it before anything imports numpy: `app/__init__.py` (every `tandem` and
`python -m app...` command) and `tests/conftest.py`. The pure engine (`import engine`,
`engine.routing`, `engine.sched.prefix_cache`, ...) loads no native code at all; import-linter's
contracts in pyproject.toml and `tests/test_import_order.py` check both.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass

# How long OpenMP threads spin at a barrier before they sleep. libgomp reads it once, when
# llama.cpp's CPU library loads it (the import below), so it is set here, unless the user chose
# (`GOMP_SPINCOUNT` or `OMP_WAIT_POLICY` in the environment). libgomp's own default is 300,000
# spins: a CPU backend using every core then collapses when another process holds one. 2,000
# spins keep it usable beside a busy process and cost nothing measurable when idle, where
# sleeping at once (PASSIVE) is ~3x slower at B=1 (docs/performance.md, "First use on a laptop").
# Benchmarks start other engines on their own defaults: `child_env()`.
SPIN_COUNT = "2000"
_OPENMP_SET: dict[str, str] = {}
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = _OPENMP_SET["GOMP_SPINCOUNT"] = SPIN_COUNT


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a process this one starts (another engine a benchmark compares with,
    or a Tandem server, which sets its own): this one's, less what this module set, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if k not in _OPENMP_SET}, **extra}

import llama_cpp as lc  # noqa: E402  (must stay the first heavy import)

from . import _abi  # noqa: E402  (checks the installed llama-cpp-python before anything uses it)

log = logging.getLogger("llama.cpp")


def holding_gil(name: str, argtypes: list, restype):
    """A binding of llama.cpp's (or ggml's) function `name` that keeps the GIL.

    Calls made for every generated token return within microseconds. Through ctypes.CDLL (as
    llama_cpp binds everything) each one releases the GIL and must win it back, and while a
    UI or HTTP thread runs Python that can take the whole switch interval (5 ms) — per call.
    These bindings of the same functions keep the GIL (ctypes.PyDLL); llama_decode and
    llama_synchronize, which wait on the device, still release it.
    """
    return _abi.function(name, argtypes, restype, keep_gil=True)


get_sampled_token_ith = holding_gil("llama_get_sampled_token_ith", [lc.llama_context_p_ctypes, ctypes.c_int32],
                                    lc.llama_token)
sampler_accept = holding_gil("llama_sampler_accept", [lc.llama_sampler_p_ctypes, lc.llama_token], None)

# `llama_get_sampled_token_ith` synchronises the context (a stream sync per backend) before
# every read: B times per step, where the backend has synchronised once already. The
# context's own method, which libllama exports as a C++ symbol, reads the same token without
# that; a build without the symbol gets the public function. Only after `llama_synchronize`
# following the last decode (ContextRunner.execute does it).
sampled_token_after_sync = _abi.sampled_token_method() or get_sampled_token_ith

# The same tokens for rows 0 .. n - 1 of the last decode in one read (a list; None when llama.cpp
# has no sampled tokens), or None where libllama lacks the methods (engine/llama/runner.py:
# BULK_READ_FROM). The buffer holds one token per output row, and after llama.cpp's output
# reorder output row i is the i-th batch row that asked for logits: the batch's first n rows
# when all of them did. Only after `llama_synchronize` following the last decode.
sampled_tokens_after_sync = _abi.sampled_tokens_reader()

_init_lock = threading.Lock()
_initialized = False

# ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR, 5: logging.DEBUG}


_SAMPLER_CALLBACK_TYPES = {
    "apply": "llama_sampler_i_apply", "reset": "llama_sampler_i_reset", "free": "llama_sampler_i_free",
    "backend_init": "llama_sampler_i_backend_init", "backend_apply": "llama_sampler_i_backend_apply",
    "backend_reset": "llama_sampler_i_backend_reset",
}


def sampler_interface(name: bytes, **callbacks):
    """A `llama_sampler_i` for a sampler written here (`fused_greedy`, `fused_dist`): its name
    and the given callbacks (`apply`, `reset`, `free`, `backend_init`, `backend_apply`,
    `backend_reset`) wrapped in their ctypes types. Returns (interface, what must stay alive
    as long as it is used: the name buffer and the wrapped callbacks)."""
    label = ctypes.create_string_buffer(name)
    name_fn = ctypes.CFUNCTYPE(ctypes.c_void_p, lc.llama_sampler_p_ctypes)(lambda _smpl: ctypes.addressof(label))
    wrapped = {k: getattr(lc, _SAMPLER_CALLBACK_TYPES[k])(f) for k, f in callbacks.items()}
    iface = lc.llama_sampler_i(name=ctypes.cast(name_fn, lc.llama_sampler_i_name), **wrapped)
    return iface, (label, name_fn, wrapped)


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
    """Resolve `auto` and refuse a GPU request on a build without GPU offload.

    `gpuN` (one GPU, see `gpus()`) resolves to itself once GPU N is known to exist; anything
    else raises `ModelLoadError` naming the devices there are.
    """
    from engine.core.errors import ModelLoadError

    index = gpu_index(device)
    if device not in ("cpu", "gpu", "auto") and index is None:
        raise ModelLoadError(f"unknown device {device!r}: use cpu, gpu, gpuN or auto")
    if device == "auto":
        return "gpu" if gpu_offload_supported() else "cpu"
    if device != "cpu" and not gpu_offload_supported():
        raise ModelLoadError(
            f"device {device} asked for, but this llama-cpp-python build has no GPU backend "
            f"(devices here: {describe_devices()}; reinstall it with CMAKE_ARGS, see the README)"
        )
    if index is not None:
        gpu(index)  # raises if there is no such GPU
    return device


def gpu_index(device: str) -> int | None:
    """N for a device string `gpuN` (`gpu0`, `gpu1`, ...), else None."""
    if device.startswith("gpu") and device[3:].isdigit():
        return int(device[3:])
    return None


# ---- ggml's device registry ----

# enum ggml_backend_dev_type (ggml-backend.h)
_DEV_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


def _bind(name: str, argtypes: list, restype):
    return _abi.function(name, argtypes, restype, keep_gil=False)


_dev_count = _bind("ggml_backend_dev_count", [], ctypes.c_size_t)
_dev_get = _bind("ggml_backend_dev_get", [ctypes.c_size_t], ctypes.c_void_p)
_dev_name = _bind("ggml_backend_dev_name", [ctypes.c_void_p], ctypes.c_char_p)
_dev_description = _bind("ggml_backend_dev_description", [ctypes.c_void_p], ctypes.c_char_p)
_dev_type = _bind("ggml_backend_dev_type", [ctypes.c_void_p], ctypes.c_int)
_dev_memory = _bind("ggml_backend_dev_memory",
                    [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)], None)


@dataclass(frozen=True, slots=True)
class Device:
    """One ggml backend device. `index` is its place in ggml's registry, `kind` its type
    (`cpu`, `gpu`, `igpu`, `accel`, `meta`), `handle` the `ggml_backend_dev_t`."""

    index: int
    name: str
    description: str
    kind: str
    handle: int

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory, as ggml reports them now."""
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        _dev_memory(self.handle, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value


def devices() -> list[Device]:
    """Every device ggml registered in this process, in registry order (no model needed)."""
    init()
    out = []
    for i in range(_dev_count()):
        h = _dev_get(i)
        out.append(Device(i, (_dev_name(h) or b"").decode(), (_dev_description(h) or b"").decode(),
                          _DEV_TYPES.get(_dev_type(h), "unknown"), h))
    return out


def gpus() -> list[Device]:
    """The GPUs, in registry order: dedicated ones, or the integrated ones where there is no
    dedicated GPU (llama.cpp's own default offload list makes the same choice)."""
    found = devices()
    dedicated = [d for d in found if d.kind == "gpu"]
    return dedicated or [d for d in found if d.kind == "igpu"]


def gpu_count() -> int:
    """How many GPUs `gpu:device=N` can name (0 on a CPU-only build or host)."""
    return len(gpus())


def gpu(index: int) -> Device:
    """GPU `index` (see `gpus()`); `ModelLoadError` naming the devices there are otherwise."""
    from engine.core.errors import ModelLoadError

    found = gpus()
    if not 0 <= index < len(found):
        have = f"GPUs 0-{len(found) - 1}" if found else "no GPU"
        raise ModelLoadError(f"GPU {index} asked for, but this host has {have} (devices: {describe_devices()})")
    return found[index]


def describe_devices() -> str:
    """`CPU (cpu: Intel Xeon), CUDA0 (gpu: NVIDIA H200)`: for error messages and logs."""
    return ", ".join(f"{d.name} ({d.kind}: {d.description})" for d in devices()) or "none"


# One NULL-terminated single-device list per device, kept for the process's life: llama.cpp
# reads the list while loading, and the model keeps using the device.
_DEVICE_LISTS: dict[int, ctypes.Array] = {}


def on_device(model_params, device: Device) -> None:
    """Put the whole model (every layer) on `device` and nowhere else."""
    lst = _DEVICE_LISTS.get(device.index)
    if lst is None:
        lst = _DEVICE_LISTS[device.index] = (ctypes.c_void_p * 2)(device.handle, None)
    model_params.devices = ctypes.cast(lst, ctypes.c_void_p)
    model_params.n_gpu_layers = -1


class MemoryProbe:
    """Devices' (free, total) memory, summed, asked of ggml at most every `max_age_s` seconds:
    snapshots are taken for every routing decision, and on CUDA each ask is a driver call."""

    def __init__(self, devices: list[Device], max_age_s: float = 0.5, clock=time.monotonic):
        self.devices = list(devices)
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._value = (0, 0)

    def read(self) -> tuple[int, int]:
        """(free, total) bytes; (0, 0) without a device."""
        if not self.devices:
            return 0, 0
        with self._lock:
            now = self._clock()
            if now - self._at >= self.max_age_s:
                both = [d.memory() for d in self.devices]
                self._value = (sum(f for f, _ in both), sum(t for _, t in both))
                self._at = now
            return self._value


# An empty, NULL-terminated device list: a model loaded with it never touches a GPU, even in
# a GPU build (n_gpu_layers=0 alone still puts compute buffers and prompt matmuls on the GPU).
_NO_DEVICES = (ctypes.c_void_p * 1)(None)


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_int8" in line for line in f)
    except OSError:
        return False


# ggml repacks CPU weights into "extra buffer types" at load; on a CPU with AMX the first is
# ggml's AMX type, whose kernel crashes the process (SIGSEGV in ggml_backend_amx_mul_mat) on some
# AMX machines as soon as a batch holds more than one token: llama.cpp issue 20824, machine-
# dependent and unfixed upstream; llama-cpp-python's own `Llama` crashes the same way there. A
# crash takes every backend and request down with it, so on a CPU that reports AMX, CPU models
# load into plain CPU buffers (no repacking) unless `TANDEM_CPU_REPACK=1` asks for them.
CPU_REPACK = os.environ.get("TANDEM_CPU_REPACK", "") == "1" or not _cpu_has_amx()


def cpu_only(model_params) -> None:
    model_params.devices = ctypes.cast(_NO_DEVICES, ctypes.c_void_p)
    model_params.n_gpu_layers = 0
    model_params.use_extra_bufts = CPU_REPACK


init()
