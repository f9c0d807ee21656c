"""A remote OpenAI-compatible engine (llama-server, vLLM, SGLang, another Tandem) as a backend.

- `backend.py`: `RemoteBackend`, the queue, flow control and failover;
- `client.py`: the HTTP client, which treats the engine as untrusted (sizes, shapes, output
  and deadlines bounded on every call);
- `probe.py`: health and load probes, one dialect per engine kind;
- `keys.py` and `approx_cache.py`: the prediction of the engine's prefix cache.

Names are imported lazily, so that the pure `approx_cache` loads no HTTP stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backend import RemoteBackend
    from .keys import VocabOnly

__all__ = ["RemoteBackend", "VocabOnly"]


def __getattr__(name: str):
    if name == "RemoteBackend":
        from .backend import RemoteBackend

        return RemoteBackend
    if name == "VocabOnly":
        from .keys import VocabOnly

        return VocabOnly
    raise AttributeError(name)
