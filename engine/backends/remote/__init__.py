"""A remote OpenAI-compatible engine (llama-server, vLLM, SGLang, another Tandem) as a backend.

One object per job, from the protocol's face down:
- `backend.py`: `RemoteBackend`, the protocol's methods over the parts below;
- `flight.py`: requests in flight (send, stream, finish); `queue.py`: the queue under the cap;
- `failover.py`: what a failed engine's requests become; `monitor.py`: health probe, load
  poll, quarantine, what the engine serves;
- `dialects.py`: one dialect per engine kind (body fields, grammar and continuation, how to
  identify it, its load endpoints); `probe.py`: what every kind answers alike;
- `client.py`: the HTTP client, which treats the engine as untrusted (sizes, shapes, counts,
  output and deadlines bounded on every call);
- `prediction.py`, `keys.py`, `approx_cache.py`: the prediction of the engine's prefix cache;
  `online.py`: rates refined from finished requests; `job.py`: one request; `loop.py`: the
  backend's asyncio thread; `config.py`: the `remote:` spec.

Names are imported lazily, so that the spec and the pure `approx_cache` load no HTTP stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backend import RemoteBackend
    from .keys import VocabOnly

__all__ = ["RemoteBackend", "VocabOnly"]


def __getattr__(name: str) -> type:
    if name == "RemoteBackend":
        from .backend import RemoteBackend

        return RemoteBackend
    if name == "VocabOnly":
        from .keys import VocabOnly

        return VocabOnly
    raise AttributeError(name)
