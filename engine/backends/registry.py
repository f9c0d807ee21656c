"""Backend kinds: a config type -> the builder that makes a started backend from it.

Each kind's module registers its builder with `@backend_kind(ItsConfig)`; its config class names
that module (`builder_module`), which `build` imports on first use, so a kind that needs native code
(engine/backends/local.py) or an event loop (the remote engine) loads it only when a config of
that kind is built. A new kind is its module plus its line in the spec grammar
(engine/backends/config.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from engine.core.errors import InvalidRequest
from engine.core.events import EventBus
from engine.core.snapshot import Rates

if TYPE_CHECKING:
    from engine.backends.protocol import BackendProtocol
    from engine.llama.model import ModelRegistry

# Used for a backend that `tandem calibrate` has not measured (stored rates are picked up
# by `Engine.load`; explicit `rates` win over both).
DEFAULT_RATES = {
    "gpu": Rates(prefill_tok_s=20000.0, decode_tok_s=500.0, source="default"),
    "cpu": Rates(prefill_tok_s=400.0, decode_tok_s=40.0, source="default"),
}


class StoredRates(Protocol):
    """Rates stored for the model file (engine/rates/store.py `ModelRates`)."""

    def get(self, config, device: str | None = None) -> Rates | None: ...


@dataclass(frozen=True)
class BuildContext:
    """What a backend builder may use: the resolved model file, the per-device model
    registry, the shared bus, stored calibrations, explicit rates, a progress callback."""

    model_path: Path | None  # None: no local backend, no model loaded
    registry: ModelRegistry | None
    bus: EventBus
    calibrated: StoredRates | None
    rates: dict
    progress: Callable | None = None


# config type -> builder(config, BuildContext) -> a started backend
BACKEND_KINDS: dict[type, Callable[..., BackendProtocol]] = {}


def backend_kind(config_type: type):
    """Register the builder of one kind of backend (decorator)."""

    def register(build):
        BACKEND_KINDS[config_type] = build
        return build

    return register


def needs_model(config) -> bool:
    """Whether a backend of `config`'s kind runs the local model file (its config says; one that
    does not say is taken to)."""
    return bool(getattr(type(config), "needs_model", True))


def build(config, ctx: BuildContext) -> BackendProtocol:
    """A started backend of `config`'s kind."""
    kind = type(config)
    if kind not in BACKEND_KINDS and getattr(kind, "builder_module", None):
        importlib.import_module(kind.builder_module)  # the kind's module registers its builder
    builder = BACKEND_KINDS.get(kind)
    if builder is None:
        raise InvalidRequest(f"no backend kind builds a {kind.__name__}")
    return builder(config, ctx)
