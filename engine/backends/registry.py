"""Backend kinds: the spec grammar (a spec's prefix -> its kind's config) and the builders (a
config type -> the builder that makes a started backend from it).

Each kind registers both halves itself: its config class with `@spec_kind("PREFIX", ...)` (a
`from_spec` classmethod parses what follows `PREFIX:`), its builder with `@backend_kind(ItsConfig)`.
A config class names the module of its builder (`builder_module`), which `build` imports on first
use, so a kind that needs native code (engine/backends/local.py) or an event loop (the remote
engine) loads it only when a config of that kind is built; config modules stay light. A new kind
is its config module, its builder module, and one import line in engine/backends/config.py (which
imports every config module, so that the table is full before a spec is parsed).

Messages never show a secret of a spec: `spec_error` masks every `key=` value, and a URL's
credentials and query (`shown`).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from engine.core.errors import InvalidRequest
from engine.core.events import EventBus
from engine.core.snapshot import Rates

if TYPE_CHECKING:
    from engine.backends.protocol import BackendProtocol

# Used for a backend that `tandem calibrate` has not measured (stored rates are picked up
# by `Engine.load`; explicit `rates` win over both).
DEFAULT_RATES = {
    "gpu": Rates(prefill_tok_s=20000.0, decode_tok_s=500.0, source="default"),
    "cpu": Rates(prefill_tok_s=400.0, decode_tok_s=40.0, source="default"),
}


class BackendSpec(Protocol):
    """What every kind's config is: a frozen dataclass a spec parses into (`from_spec`), named,
    on a device, that names its builder's module and whether it runs the local model file."""

    builder_module: ClassVar[str]
    needs_model: ClassVar[bool]

    @property
    def name(self) -> str: ...

    @property
    def device(self) -> str: ...


class StoredRates(Protocol):
    """Rates stored for the model file (engine/rates/store.py `ModelRates`)."""

    def get(self, config: Any, device: str | None = None) -> Rates | None: ...


class ModelSource(Protocol):
    """The per-device model registry (engine/llama/model.py `ModelRegistry`) as a builder sees
    it: one loaded model per file and device, shared by every backend on that device."""

    def acquire(self, path: Path, device: str, progress: Callable | None = None) -> Any:
        """The model of `path` on `device`, loaded on first use (engine/llama/model.py `Model`)."""
        ...

    def release(self, model: Any) -> None:
        """One user fewer of `model`: the last frees it."""
        ...


@dataclass(frozen=True)
class BuildContext:
    """What a backend builder may use: the resolved model file, the per-device model
    registry, the shared bus, stored calibrations, explicit rates, a progress callback."""

    model_path: Path | None  # None: no local backend, no model loaded
    registry: ModelSource | None
    bus: EventBus
    calibrated: StoredRates | None
    rates: dict
    progress: Callable | None = None


# ---- the spec grammar ----

# (the whole spec, what follows `PREFIX:`, defaults from the command line) -> its config
SpecParser = Callable[[str, str, Mapping[str, Any]], BackendSpec]
SPEC_KINDS: dict[str, SpecParser] = {}
SpecType = TypeVar("SpecType", bound=type)

_SECRET = re.compile(r"(?i)(^|,)(\s*key\s*)[=:][^,]*")
_USERINFO = re.compile(r"(//)[^/@,]*@")
_QUERY = re.compile(r"\?[^,]*")


def spec_kind(*prefixes: str) -> Callable[[SpecType], SpecType]:
    """Register a config class's `from_spec(spec, rest, defaults)` as the parser of the specs
    that start with one of `prefixes` (class decorator)."""

    def register(cls: SpecType) -> SpecType:
        for prefix in prefixes:
            SPEC_KINDS[prefix] = cls.from_spec  # type: ignore[attr-defined]  # every config class has one
        return cls

    return register


def parse_spec(spec: str, defaults: Mapping[str, Any]) -> BackendSpec:
    """`PREFIX[:key=value,...]` -> the config of the kind that registered `PREFIX`."""
    prefix, _, rest = spec.partition(":")
    parser = SPEC_KINDS.get(prefix.strip().lower())
    if parser is None:
        raise spec_error(spec, f"it must start with one of {', '.join(sorted(SPEC_KINDS))}")
    return parser(spec, rest, defaults)


def shown(spec: str) -> str:
    """`spec` as messages may show it: every `key=` value, a URL's user:password and query masked."""
    return _QUERY.sub("?***", _USERINFO.sub(r"\1***@", _SECRET.sub(r"\1\2=***", spec)))


def spec_error(spec: str, why: str) -> InvalidRequest:
    """The error for a spec that cannot be parsed, its secrets masked (`shown`)."""
    return InvalidRequest(f"backend spec {shown(spec)!r}: {why}")


# ---- the builders ----

# config type -> builder(config, BuildContext) -> a started backend
BACKEND_KINDS: dict[type, Callable[..., BackendProtocol]] = {}


Builder = TypeVar("Builder", bound=Callable[..., "BackendProtocol"])  # (config, BuildContext) -> a started backend


def backend_kind(config_type: type) -> Callable[[Builder], Builder]:
    """Register the builder of one kind of backend (decorator)."""

    def register(build: Builder) -> Builder:
        BACKEND_KINDS[config_type] = build
        return build

    return register


def needs_model(config: BackendSpec) -> bool:
    """Whether a backend of `config`'s kind runs the local model file (its config says; one that
    does not say is taken to)."""
    return bool(getattr(type(config), "needs_model", True))


def build(config: BackendSpec, ctx: BuildContext) -> BackendProtocol:
    """A started backend of `config`'s kind."""
    kind = type(config)
    if kind not in BACKEND_KINDS and getattr(kind, "builder_module", None):
        importlib.import_module(kind.builder_module)  # the kind's module registers its builder
    builder = BACKEND_KINDS.get(kind)
    if builder is None:
        raise InvalidRequest(f"no backend kind builds a {kind.__name__}")
    return builder(config, ctx)
