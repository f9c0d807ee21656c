"""Backend specs from the command line, and the local kind's config: `gpu:cap=4`,
`cpu:threads=15,cap=4,name=big`, `gpu:device=1,cap=8`. `parse_backend_spec` looks a spec's
prefix up in the table each kind registers (engine/backends/registry.py): `cpu`, `gpu` and `auto`
here, `remote:url=…` (engine/backends/remote/config.py), `null` (engine/backends/null.py).

`gpu` offloads the model with llama.cpp's default (every GPU); `gpu:device=N` loads it on GPU N
alone (`engine.llama.gpus()[N]`), as the device `gpuN`, and the backend is named `gpuN` unless
named otherwise. Several backends on one GPU share its model; each GPU loads its own.

`default_specs()`: one backend per GPU plus a CPU backend on a host with several GPUs; a GPU
and a CPU backend with one; one CPU backend with every core otherwise (see `default_specs`
for the measurement that chose it).
`cap`: with no cap (or `cap=auto`) a backend's cap adapts (engine/sched/limiter.py) from a start
up to the device's ceiling (`START`, `CEILING` there), for each context of a `contexts=N` spec
alike; `cap=N` makes N the ceiling (the
limit starts there and moves only below it); `adaptive=0` fixes the cap at N.

`kv=split` gives every sequence its own KV stream (`kv_unified=0`), so a step attends only
over each sequence's own cells, not over every cached prefix; `seq_ctx=N` sizes each stream
(the context is then N × n_seq_max cells). Unified or split, and why: docs/design/sched.md.

`contexts=N` makes N backends of one spec, named NAME-a, NAME-b, ... (`gpu:contexts=2` → gpu-a,
gpu-b), each a llama.cpp context with its own cap, KV pool and prefix cache, sharing the
device's model. Without it (`contexts=auto`) the count is chosen when the model loads, from
its size and the device's free memory (`resolve_contexts`; `AUTO_CONTEXTS`). For many tenants on one GPU: the router's `cache-aware` policy keeps a tenant on
one context, whose prompt chunks then stall only its own decodes and attend over its own pool
(docs/design/backends.md).

`share_prefill=0` stops publishing a running prompt into the prefix cache at its prefill's end,
`defer_shared=0` stops deferring a queued request behind a running prefill of its prefix
(both on by default; engine/sched/scheduler.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import engine.backends.null  # each kind's config module registers its spec prefix
import engine.backends.remote.config  # noqa: F401
from engine.backends.registry import BackendSpec, parse_spec, spec_error, spec_kind
from engine.core.errors import InvalidRequest
from engine.sched.limiter import CEILING, START
from engine.sched.scheduler import default_seq_slots

_INT_KEYS = {"cap", "n_ctx", "ctx", "n_batch", "batch", "n_ubatch", "ubatch", "threads",
             "threads_batch", "n_seq_max", "max_queue", "idle_cache_cells", "busy_chunk", "seq_ctx", "contexts",
             "fused_dist_from"}
_ALIASES = {"ctx": "n_ctx", "batch": "n_batch", "ubatch": "n_ubatch"}
_BOOL_KEYS = {"kv_unified", "cache", "backend_sampling", "fused_greedy", "overlap_text", "adaptive",
              "share_prefill", "defer_shared"}
_FLOAT_KEYS = {"queue_timeout": "queue_timeout_s"}


# No cap given: the ceiling the limiter may grow to, and where it starts, for each context on a
# device (`auto_limits`; engine/sched/limiter.py says what set them): two contexts on one GPU get
# a ceiling each, as two processes would (issue 26: two contexts sharing one ceiling of 32
# answered a returning chat user in 1.14 s, two processes with 32 each in 0.17 s).
AUTO_CAP = CEILING  # engine/sched/limiter.py, the one place they are set
AUTO_START = START
# KV cells when a spec names no ctx: what AUTO_CTX_MEMORY_SHARE of the device's free memory holds
# (a CPU's: the host's available memory), shared among the contexts the spec makes there, at least
# AUTO_CTX["cpu"] and at most AUTO_CTX_MAX_CELLS (`auto_pool_cells`); AUTO_CTX where memory is not
# known. GPU: 65,536 cells hold 32 tenants' 1,550-token prefixes beside 32 running requests
# (768 MiB for Qwen2.5-0.5B). A unified pool may exceed the model's training context
# (engine/llama/runner.py).
AUTO_CTX = {"gpu": 65536, "cpu": 4096}
AUTO_CTX_MEMORY_SHARE = 0.25
# The most cells a pool sized from memory takes. GPU: 65,536 per context (four contexts: 262,144
# on the device; a single 262,144-cell pool ran the chat workload slower, 67.4 s against 63.4 s).
# CPU: 16,384 (SmolLM2: 360 MiB): 8 conversations of 4 turns (~1,700 tokens each by the last, a
# 760-token system prompt shared) thrashed 4,096 cells, running sequences preempting each other by
# recompute (docs/performance.md, "First use on a laptop"). A larger pool costs nothing
# while few cells are in use: llama.cpp places cells within the used ones + 2 ubatches.
AUTO_CTX_MAX_CELLS = {"gpu": 65536, "cpu": 16384}
# Unified KV, no idle_cache_cells given: while B sequences run the prefix cache keeps at most
# AUTO_IDLE_CELLS / B cells none of them uses (engine/sched/scheduler.py `_shed_idle_cache`): what a
# default pool gave before the pool was sized from memory (n_ctx / B), now apart from the pool.
AUTO_IDLE_CELLS = {"gpu": 65536, "cpu": 4096}
# Contexts per GPU when a spec names no count (`contexts=auto`, the default; `auto_contexts`):
# AUTO_CONTEXTS by the model's size. In one unified pool every step attends over every cell in
# use, so N contexts each attend over their own share while the GPU runs them side by side.
# On one H200 with Qwen2.5-0.5B q8_0 (0.5 GB) and the chat workload (96 conversations x 8
# turns), each doubling of the contexts from one to eight ran the chats faster, and on the grid
# (N=48, long prompts, tenants) eight stayed within a few per cent of four. Each
# context's step reads all the weights again, so a larger model gets fewer: 4 up to
# AUTO_CONTEXTS_MAX_MODEL_BYTES (measured only at 0.5 GB), one above it. Each context beyond
# the first needs AUTO_CONTEXT_BYTES of free device memory beside the model (its pool, compute
# buffers).
AUTO_CONTEXTS = ((1 << 30, 8), (4 << 30, 4))  # (model bytes up to, contexts)
AUTO_CONTEXTS_MAX_MODEL_BYTES = AUTO_CONTEXTS[-1][0]
AUTO_CONTEXT_BYTES = 2 << 30
# Flash attention when the spec does not say (`flash_attn=auto`): llama.cpp's choice on a GPU
# (on); off on the CPU, whose flash-attention kernel is slow for the few query rows of a decode
# step or a short prompt chunk: decode runs 1.6-4.5x faster without it over 512-2,000-token
# contexts (docs/performance.md, "First use on a laptop"). A long prompt alone prefills faster
# with it on, which decode over that context outweighs.
AUTO_FLASH_ATTN = {"gpu": "auto", "cpu": "off"}


def auto_limits(kind: str) -> tuple[int, int]:
    """(ceiling, start) of an adaptive cap for one context on a `kind` device, however many
    contexts share the device."""
    return AUTO_CAP[kind], AUTO_START[kind]


def auto_pool_cells(kind: str, fits: int, contexts: int = 1, *, ceiling: int | None = None) -> int:
    """The pool of a `kind` backend whose spec names no ctx: `fits` (the cells AUTO_CTX_MEMORY_SHARE
    of the device's free memory holds; 0: unknown, then AUTO_CTX) shared among `contexts`, at most
    `ceiling` (AUTO_CTX_MAX_CELLS) and never under the CPU's default; a multiple of 256."""
    top = AUTO_CTX_MAX_CELLS[kind] if ceiling is None else ceiling
    if not fits:
        return min(AUTO_CTX[kind], top)
    share = fits // max(contexts, 1) // 256 * 256
    return max(AUTO_CTX["cpu"], min(top, share))


def host_available_bytes() -> int:
    """The host's available memory (/proc/meminfo's MemAvailable), 0 where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def auto_contexts(model_bytes: int, free_bytes: int, *, want: int | None = None,
                  max_model_bytes: int | None = None, context_bytes: int | None = None) -> int:
    """Contexts for a GPU spec that names no count: `want` (by AUTO_CONTEXTS), one for a model over
    `max_model_bytes`, and no more than the device's free memory (`free_bytes`; 0: unknown)
    holds beside the model at `context_bytes` each beyond the first."""
    if want is None:
        want = next((n for limit, n in AUTO_CONTEXTS if model_bytes <= limit), 1)
    max_model_bytes = AUTO_CONTEXTS_MAX_MODEL_BYTES if max_model_bytes is None else max_model_bytes
    context_bytes = AUTO_CONTEXT_BYTES if context_bytes is None else context_bytes
    if want <= 1 or model_bytes > max_model_bytes:
        return 1
    if free_bytes:
        want = min(want, 1 + max(free_bytes - model_bytes, 0) // context_bytes)
    return max(1, min(want, 26))


@spec_kind("cpu", "gpu", "auto")
@dataclass(frozen=True)
class BackendConfig:
    """How to build a backend. `cap` bounds the sequences running at once: with `adaptive`
    (the default) it is the ceiling of the live limit (engine/sched/limiter.py), which starts there;
    0 (`cap=auto`) means the device's `AUTO_CAP` ceiling, starting at `AUTO_START`. With
    `adaptive=False` the cap is fixed (4 when 0)."""

    builder_module: ClassVar[str] = "engine.backends.local"  # registers this kind's builder
    needs_model: ClassVar[bool] = True  # runs the local model file

    name: str = "cpu"
    device: str = "cpu"
    cap: int = 0
    adaptive: bool = True
    n_ctx: int = 0  # cells, all sequences together; 0: from the device's memory (`auto_pool_cells`)
    n_batch: int = 512
    n_ubatch: int = 512
    threads: int = 0  # 0: all cores
    threads_batch: int = 0  # 0: same as threads
    n_seq_max: int = 0  # 0: engine/sched/scheduler.py default_seq_slots (cap + 64 on a GPU, + 8 on a CPU)
    kv_unified: bool = True
    # Split KV (`kv=split`): cells of each sequence's stream; the context is then seq_ctx ×
    # n_seq_max cells. 0: n_ctx is the whole context, which llama.cpp divides among the streams.
    seq_ctx: int = 0
    flash_attn: str = "auto"  # auto | on | off
    cache: bool = True
    max_queue: int = 4096
    backend_sampling: bool = True  # sample inside the decode graph (logits stay on the device)
    fused_greedy: bool = True  # on the device, one computation for all sequences of a step (argmax, or fused_dist)
    # temperature requests take the fused sampler once this many run (or with a seed); fewer run
    # llama.cpp's chain per sequence (engine/llama/sampling.py, SamplerSlots)
    fused_dist_from: int = 2
    queue_timeout_s: float = 0.0  # a request waiting longer ends with an error (0: no limit)
    idle_sampler_s: float = 2.0  # an idle sequence id's sampler chain is detached after this
    # Unified KV: while B sequences run, the prefix cache keeps at most idle_cache_cells / B
    # cells that none of them uses (every step attends over all cells in use). -1: n_ctx.
    idle_cache_cells: int = -1
    # Turn a step's tokens into text (pieces, deliveries) while the next step runs on the
    # device, for requests without stop strings. None: on for GPU backends, whose
    # llama_decode returns before the device is done; on the CPU nothing would overlap.
    overlap_text: bool | None = None
    # The most prompt tokens one chunk takes while any other request runs or waits, so that a
    # cancel lands at the next chunk boundary and nobody waits behind a long chunk. 0: n_batch
    # on a GPU (a 512-token chunk takes milliseconds), n_batch / 8 on the CPU (measured: a
    # 512-token chunk held a cancel and the next request's first token for 4.3 s).
    busy_chunk: int = 0
    # Publish a running prompt into the prefix cache once its prefill ends, so requests admitted
    # while it runs reuse it (engine/sched/scheduler.py), and defer a queued request behind a running
    # prefill of its prefix (`defer_shared`).
    share_prefill: bool = True
    defer_shared: bool = True
    # Contexts its spec makes on the device (`contexts=N`, engine/backends/config.py); 0: auto, decided
    # when the model loads (`auto_contexts`, `resolve_contexts`): one on a CPU.
    contexts: int = 0
    # The spec's name for each of the contexts it made (gpu-a, gpu-b, ... → "gpu"): they share
    # one device, which the default policy chooses first ("" for a spec of one context).
    group: str = ""

    @property
    def auto_cap(self) -> bool:
        """No cap given: the limiter starts low and may grow to the device's ceiling."""
        return self.cap == 0 and self.adaptive

    def resolved(self, device: str | None = None) -> BackendConfig:
        """Threads, the cap (0 → the ceiling for `device`, the model's device once known),
        sequence slots and flash attention (`AUTO_FLASH_ATTN`) filled in."""
        threads = self.threads or os.cpu_count() or 1
        kind = "cpu" if (device or self.device) == "cpu" else "gpu"
        cap = self.cap or min(auto_limits(kind)[0] if self.adaptive else 4, self.n_seq_max or 256)
        n_seq_max = self.n_seq_max or default_seq_slots(cap, kind)
        n_ctx = self.seq_ctx * n_seq_max if (self.seq_ctx and not self.kv_unified) else (self.n_ctx or AUTO_CTX[kind])
        flash_attn = AUTO_FLASH_ATTN[kind] if self.flash_attn == "auto" else self.flash_attn
        idle = self.idle_cache_cells if self.idle_cache_cells >= 0 or self.n_ctx else AUTO_IDLE_CELLS[kind]
        return replace(self, threads=threads, threads_batch=self.threads_batch or threads, n_seq_max=n_seq_max,
                       cap=cap, n_ctx=n_ctx, flash_attn=flash_attn, idle_cache_cells=idle)

    def speed_key(self, device: str | None = None) -> str:
        """What about this configuration changes its speed, as a stable string: stored rates are
        filed under it (engine/rates/store.py). `device` is the model's resolved device; it names
        the key only where the config says `auto`. A config for one GPU keeps its own (`gpu0`,
        `gpu1`): each GPU of a fleet in one process is calibrated, and priced, on its own."""
        c = self.resolved()
        dev = (device or c.device) if c.device == "auto" else c.device
        return (f"{dev}:threads={c.threads},threads_batch={c.threads_batch},"
                f"n_batch={c.n_batch},n_ubatch={min(c.n_ubatch, c.n_batch)},"
                f"kv_unified={int(c.kv_unified)},flash_attn={c.flash_attn},"
                f"backend_sampling={int(c.backend_sampling)}")

    @classmethod
    def from_spec(cls, spec: str, rest: str, defaults: Mapping[str, Any]) -> BackendConfig:
        """`cpu|gpu|auto[:key=value,...]` (see the module docstring); the name defaults to the device."""
        device = spec.partition(":")[0].strip().lower()
        fields: dict[str, Any] = {"device": device, **defaults}
        for i, item in enumerate(filter(None, (p.strip() for p in rest.split(","))), 1):
            key, eq, value = item.partition("=")
            if not eq:
                raise spec_error(spec, f"item {i} is not key=value")
            fields.update(_local_item(spec, device, _ALIASES.get(key.strip(), key.strip()), value))
        fields.setdefault("name", fields["device"])
        return cls(**fields)


def _number(spec: str, key: str, value: str, kind: type[int] | type[float]) -> int | float:
    """`value` as an int or a float, or the spec's error naming the key."""
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise spec_error(spec, f"{key} must be {what}") from None


def _local_item(spec: str, device: str, key: str, value: str) -> dict[str, Any]:
    """One `key=value` of a local spec as config fields."""
    low = value.strip().lower()
    if key == "device":
        return {"device": _gpu_device(spec, device, value)}
    if key == "cap" and low == "auto":
        return {"cap": 0}  # adaptive up to the device's ceiling (engine/sched/limiter.py)
    if key == "contexts" and low == "auto":
        return {"contexts": 0}  # decided when the model loads (`resolve_contexts`)
    if key == "kv":
        if low not in ("unified", "split"):
            raise spec_error(spec, "kv must be unified or split")
        return {"kv_unified": low == "unified"}
    if key in _INT_KEYS or key in _ALIASES.values():
        n = _number(spec, key, value, int)
        if key == "contexts" and not 1 <= n <= 26:
            raise spec_error(spec, f"contexts must be 1 to 26 (or auto), got {n}")
        return {key: n}
    if key in _FLOAT_KEYS:
        return {_FLOAT_KEYS[key]: _number(spec, key, value, float)}
    if key in _BOOL_KEYS:
        return {key: low in ("1", "true", "yes", "on")}
    if key in ("name", "flash_attn"):
        return {key: value}
    valid = sorted(_INT_KEYS | _BOOL_KEYS | set(_FLOAT_KEYS) | {"name", "flash_attn", "device", "kv"})
    raise spec_error(spec, f"unknown key {key!r} (valid: {', '.join(valid)})")


def parse_backend_spec(spec: str, **defaults: Any) -> BackendSpec:
    """`KIND[:key=value,...]` -> the config of the kind that registered `KIND` (the table
    `registry.SPEC_KINDS`: cpu, gpu, auto, remote, null)."""
    return parse_spec(spec, defaults)


def _gpu_device(spec: str, device: str, value: str) -> str:
    """`device=N` on a gpu spec → the device string `gpuN` (whether GPU N exists is checked
    when the model loads, `engine.llama.pick_device`)."""
    if device != "gpu":
        raise spec_error(spec, "device=N picks one GPU, so it needs a gpu spec (gpu:device=N)")
    try:
        index = int(value)
    except ValueError:
        raise spec_error(spec, "device must be a GPU number (0, 1, ...)") from None
    if index < 0:
        raise spec_error(spec, f"device must be a GPU number (0, 1, ...), got {index}")
    return f"gpu{index}"


def name_backends(configs: list[BackendSpec], explicit: list[bool]) -> list[BackendSpec]:
    """Repeated devices without an explicit name become cpu0, cpu1, ..."""
    counts: dict[str, int] = {}
    for c, named in zip(configs, explicit):
        if not named:
            counts[c.device] = counts.get(c.device, 0) + 1
    seen: dict[str, int] = {}
    out = []
    for c, named in zip(configs, explicit):
        if not named and counts[c.device] > 1:
            i = seen.get(c.device, 0)
            seen[c.device] = i + 1
            c = dataclasses.replace(c, name=f"{c.device}{i}")  # type: ignore[type-var]  # every config is a dataclass
        out.append(c)
    names = [c.name for c in out]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise InvalidRequest(f"backend names must be unique: {', '.join(sorted(dupes))}")
    return out


def parse_backend_specs(specs: list[str], **defaults: Any) -> list[BackendSpec]:
    configs: list[BackendSpec] = []
    explicit: list[bool] = []
    for s in specs:
        c = parse_backend_spec(s, **defaults)
        for part in _contexts(c):
            configs.append(part)
            explicit.append("name=" in s or part is not c)
    return name_backends(configs, explicit)


def _contexts(c: BackendSpec) -> list[BackendSpec]:
    """`contexts=N`: N backends on the spec's device sharing its model, named NAME-a, NAME-b, ...,
    each with the spec's settings (its own cap, context and prefix cache; without a cap, the
    device's adaptive ceiling each: `auto_limits`). `contexts=auto` (0, the
    default) stays one config until the model loads (`resolve_contexts`)."""
    if not isinstance(c, BackendConfig) or c.contexts in (0, 1):
        return [c]
    n = c.contexts
    return [dataclasses.replace(c, name=f"{c.name}-{chr(ord('a') + i)}", group=c.name) for i in range(n)]


def resolve_contexts(configs: Sequence[BackendSpec], model_bytes: int,
                     free_bytes: Callable[[str], int] | None = None) -> list[BackendSpec]:
    """Each `contexts=auto` spec as the contexts its device gets (`auto_contexts`,
    from the model's size and the device's free memory, `free_bytes(device)`; default: ggml's
    report), split as `contexts=N` would split it; 1 on a CPU, and 1 for a GPU another spec
    of this command also uses (the user laid that device out). Called when the model is
    resolved, before any backend is built."""
    devices = [c.device for c in configs if isinstance(c, BackendConfig)]
    out: list[BackendSpec] = []
    for c in configs:
        if not isinstance(c, BackendConfig) or c.contexts != 0:
            out.append(c)
            continue
        n = 1
        if c.device not in ("cpu",) and devices.count(c.device) == 1:
            n = auto_contexts(model_bytes, (free_bytes or _device_free_bytes)(c.device))
        one = dataclasses.replace(c, contexts=n)
        out += _contexts(one)
    return out


def _device_free_bytes(device: str) -> int:
    """Free memory of the GPU a device string names (`gpu`: the first; `gpuN`: GPU N), 0 if unknown."""
    from engine import llama

    found = llama.gpus()
    index = int(device[3:]) if device.startswith("gpu") and device[3:].isdigit() else 0
    if not 0 <= index < len(found):
        return 0
    return found[index].memory()[0]


CPU_ONLY_CAP = 8  # the study's N=8 ran in 12.5 s at cap 8 on 2 cores (one 2-thread backend)


def default_specs(gpu: bool, cores: int | None = None, gpus: int | None = None) -> list[str]:
    """The backends to run when none are named.

    - several GPUs: one backend per GPU (`gpu:device=N`, named gpu0, gpu1, ...) and a CPU
      backend on the cores left after one per GPU backend's worker thread;
    - one GPU: GPU + CPU. The GPU spec names no context count, so the model's size and the
      device's memory choose it when the model loads (`auto_contexts`: eight for a small
      model). The default policy leaves the CPU out where its peak decode is under a tenth
      of the GPU's (an H200's: 4 %), and sends it work where it pays (the study's M2: 15 %);
    - no offload: one CPU backend with every core, cap 8 (`CPU_ONLY_CAP`).

    Why one on a CPU-only machine (docs/performance.md, "First use on a laptop"): splitting the
    cores halves each backend's prefill, and a backend that has not seen a prompt's shared
    prefix computes it again for every request admitted before the first of them finishes
    (the prefix cache takes a sequence at its finish). On 2 cores the study's N=8 over HTTP
    took 12.5 s on one 2-thread backend at cap 8, 16.9 s on two 1-thread backends with
    measured rates and 25.4 s with placeholder ones; two backends won only with both caches
    already warm (9.6 vs 11.7 s). `--backend cpu:threads=1 --backend cpu:threads=1` still
    gives two, for a routing view with a choice in it.

    `gpus` is the GPU count; None counts them (`engine.llama.gpu_count()`, no model loaded)
    where `gpu` says the build can offload. A build that offloads but lists no GPU device
    still gets one plain `gpu` backend (llama.cpp picks the device).
    """
    cores = cores or os.cpu_count() or 2
    if gpus is None:
        if gpu:
            from engine import llama

            gpus = max(llama.gpu_count(), 1)
        else:
            gpus = 0
    if gpus >= 2:
        return [f"gpu:device={n}" for n in range(gpus)] + [f"cpu:threads={max(cores - gpus, 1)}"]
    if gpus == 1:
        return ["gpu", f"cpu:threads={max(cores - 1, 1)}"]
    return [f"cpu:threads={cores},cap={CPU_ONLY_CAP}"]


def synthetic_specs() -> list[str]:
    """Every `synthetic:` model spec after the prefix (`tiny`, `tiny:q8_0`, ...), for pickers.

    Imports `engine.llama.synthetic` (and so llama.cpp) on the first call, never at import.
    """
    from engine.llama.synthetic import spec_names

    return spec_names()
