"""Backend specs from the command line: `gpu:cap=4`, `cpu:threads=15,cap=4,name=big`.

`default_specs()` is a GPU and a CPU backend where the llama.cpp build can offload, and two
CPU backends that split the cores otherwise (so routing is still live on a laptop).
"""

from __future__ import annotations

import dataclasses
import os

from .backend import BackendConfig
from .errors import InvalidRequest

_INT_KEYS = {"cap", "n_ctx", "ctx", "n_batch", "batch", "n_ubatch", "ubatch", "threads",
             "threads_batch", "n_seq_max", "max_queue", "idle_cache_cells", "busy_chunk"}
_ALIASES = {"ctx": "n_ctx", "batch": "n_batch", "ubatch": "n_ubatch"}
_BOOL_KEYS = {"kv_unified", "cache", "backend_sampling", "fused_greedy", "overlap_text"}
_FLOAT_KEYS = {"queue_timeout": "queue_timeout_s"}


def parse_backend_spec(spec: str, **defaults) -> BackendConfig:
    """`DEVICE[:key=value,...]` → a BackendConfig (name defaults to the device)."""
    device, _, rest = spec.partition(":")
    device = device.strip().lower()
    if device not in ("cpu", "gpu", "auto"):
        raise InvalidRequest(f"backend spec {spec!r}: device must be cpu, gpu or auto")
    fields: dict = {"device": device, **defaults}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key = _ALIASES.get(key.strip(), key.strip())
        if not eq:
            raise InvalidRequest(f"backend spec {spec!r}: {item!r} is not key=value")
        if key in _INT_KEYS or key in _ALIASES.values():
            try:
                fields[key] = int(value)
            except ValueError:
                raise InvalidRequest(f"backend spec {spec!r}: {key} must be an integer") from None
        elif key in _FLOAT_KEYS:
            try:
                fields[_FLOAT_KEYS[key]] = float(value)
            except ValueError:
                raise InvalidRequest(f"backend spec {spec!r}: {key} must be a number") from None
        elif key in _BOOL_KEYS:
            fields[key] = value.lower() in ("1", "true", "yes", "on")
        elif key in ("name", "flash_attn"):
            fields[key] = value
        else:
            valid = sorted(_INT_KEYS | _BOOL_KEYS | set(_FLOAT_KEYS) | {"name", "flash_attn"})
            raise InvalidRequest(f"backend spec {spec!r}: unknown key {key!r} (valid: {', '.join(valid)})")
    fields.setdefault("name", device)
    return BackendConfig(**fields)


def name_backends(configs: list[BackendConfig], explicit: list[bool]) -> list[BackendConfig]:
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
            c = dataclasses.replace(c, name=f"{c.device}{i}")
        out.append(c)
    names = [c.name for c in out]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise InvalidRequest(f"backend names must be unique: {', '.join(sorted(dupes))}")
    return out


def parse_backend_specs(specs: list[str], **defaults) -> list[BackendConfig]:
    configs = [parse_backend_spec(s, **defaults) for s in specs]
    explicit = ["name=" in s for s in specs]
    return name_backends(configs, explicit)


def default_specs(gpu: bool, cores: int | None = None) -> list[str]:
    """Two backends: GPU + CPU where offload works, else two CPU backends splitting the cores."""
    cores = cores or os.cpu_count() or 2
    if gpu:
        return ["gpu:cap=4", f"cpu:threads={max(cores - 1, 1)},cap=4"]
    half = max(cores // 2, 1)
    return [f"cpu:threads={half},cap=4", f"cpu:threads={max(cores - half, 1)},cap=4"]
