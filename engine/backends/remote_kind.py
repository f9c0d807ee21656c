"""The remote kind's builder: an OpenAI-compatible engine elsewhere (engine/remote.py) as a
backend, registered for `RemoteConfig`. (It joins the remote backend's own module when that
module is reworked; the remote backend's class then takes `BackendBase` itself.)"""

from __future__ import annotations

from typing import cast

from engine.backends.config import RemoteConfig
from engine.backends.protocol import BackendBase, BackendProtocol
from engine.backends.registry import BuildContext, backend_kind
from engine.remote import RemoteBackend  # aiohttp and its loop thread: imported when a fleet is built


class Remote(RemoteBackend, BackendBase):
    """`RemoteBackend` with the protocol's defaults for what it leaves out (group enqueue, info,
    KV state, local model)."""


@backend_kind(RemoteConfig)
def build(c: RemoteConfig, ctx: BuildContext) -> BackendProtocol:
    """Started and probed once; an engine that does not answer yet starts unhealthy."""
    backend = Remote(c, ctx.bus, ctx.rates.get(c.name))
    backend.start()
    return cast("BackendProtocol", backend)  # its annotations (`on_unhealthy`, `set_cap`) predate the protocol's
