"""`only:NAME`, `gpu-only`, `cpu-only`: everything to one backend, or to one kind of device
(the study's single-backend baselines)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.errors import BackendUnavailable

from .policy import names_of
from .seed_score import SeedScored
from .types import BackendScore, RouteQuery

HELP = {
    "gpu-only": "Everything to the first GPU backend (the study's baseline).",
    "cpu-only": "Everything to the first CPU backend.",
}


class OnlyBackend(SeedScored):
    """Everything to one backend (`only:NAME`) or to one kind of device (`gpu-only`, `cpu-only`).

    By device means the backends whose device is `cpu` (case-insensitive) for `cpu-only`, and
    those whose device is anything else (gpu, CUDA0, Metal...) for `gpu-only`: with several
    (two contexts on one GPU, several GPUs) the healthy one holding the fewest requests, the
    first in order on a tie.
    """

    def __init__(self, backend: str | None = None, device: str | None = None) -> None:
        if (backend is None) == (device is None):
            raise ValueError("give exactly one of backend, device")
        self.backend = backend
        self.device = device
        self.name = f"only:{backend}" if backend is not None else f"{device}-only"

    def choose(self, query: RouteQuery, scores: Sequence[BackendScore]) -> tuple[str, str]:
        if self.backend is not None:
            matches = [s for s in scores if s.name == self.backend]
            what = f"backend {self.backend!r}"
        else:
            matches = [s for s in scores if _device_kind(s.device) == self.device]
            what = f"a backend with device {self.device!r}"
        if not matches:
            raise BackendUnavailable(f"policy {self.name} needs {what}; backends: {names_of(scores)}")
        if len(matches) > 1:
            healthy = [s for s in matches if s.eligible]
            if not healthy:
                raise BackendUnavailable(f"policy {self.name}: every backend of device {self.device!r} is unhealthy")
            target = min(healthy, key=lambda s: s.n_running + s.n_waiting)
            return target.name, (f"{self.name}: {target.name} holds the fewest requests "
                                 f"({target.n_running + target.n_waiting}) of {names_of(matches)}")
        target = matches[0]
        if not target.eligible:
            raise BackendUnavailable(f"policy {self.name}: backend {target.name!r} is unhealthy")
        return target.name, f"{self.name}: everything goes to {target.name}"


def _device_kind(device: str) -> str:
    return "cpu" if device.strip().lower() == "cpu" else "gpu"
