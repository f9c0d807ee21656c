"""Loading a model without freezing the window.

`ModelLoader` runs a load function (`fn(spec, progress) -> Engine`, supplied by the app) on a
worker thread. llama.cpp reports progress on that thread; the loader forwards it, and the
outcome, through queued signals. If the loader is cancelled (the window closed) the engine
it produced is closed on the worker thread instead of being handed over.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, Signal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """What to load: a model spec (`default`, a path, `synthetic:SHAPE`), backends, policy."""

    model: str = "default"
    backends: tuple[str, ...] = field(default_factory=tuple)  # empty: the engine's defaults
    policy: str = "seed-score"

    def describe(self) -> str:
        return self.model + (f" on {', '.join(self.backends)}" if self.backends else "")


class ModelLoader(QObject):
    progress = Signal(float)  # 0..1
    loaded = Signal(object, object)  # Engine, ModelSpec
    failed = Signal(str, object)  # message, ModelSpec

    def __init__(self, load_fn, parent: QObject | None = None):
        super().__init__(parent)
        self._load_fn = load_fn
        self._thread: threading.Thread | None = None
        self._cancelled = threading.Event()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, spec: ModelSpec) -> bool:
        if self.busy:
            return False
        self._cancelled.clear()
        self._thread = threading.Thread(target=self._work, args=(spec,), name="model-loader", daemon=True)
        self._thread.start()
        return True

    def cancel(self) -> None:
        self._cancelled.set()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- worker thread ----

    def _work(self, spec: ModelSpec) -> None:
        def progress(*args) -> bool:
            # llama.cpp model loading calls progress(fraction); writing a synthetic model file
            # calls progress(done, total).
            if self._cancelled.is_set():
                return False  # llama.cpp aborts the load
            fraction = args[0] / args[1] if len(args) >= 2 and args[1] else args[0]
            self.progress.emit(float(fraction))
            return True

        try:
            engine = self._load_fn(spec, progress)
        except BaseException as e:  # noqa: BLE001  (every failure becomes a message in the window)
            if not self._cancelled.is_set():
                log.info("loading %s failed: %s", spec.describe(), e)
                self.failed.emit(_message(e), spec)
            return
        if self._cancelled.is_set():
            engine.close()
            return
        self.loaded.emit(engine, spec)


def _message(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, (ImportError, ModuleNotFoundError)):
        return f"{text} (a component this model needs is not installed)"
    return text
