"""Loading a model without freezing the window.

`ModelLoader` runs a load function (`fn(spec, progress, status) -> Engine`, supplied by the app)
on a `ui.worker.Worker`. llama.cpp reports progress on that thread, and the engine says in words
what it does after the weights are in (`status(text)`: measuring a backend's speed, a few seconds
on a first start); the worker delivers both, and the outcome, on the main thread, where the loader
re-emits them. If the loader is cancelled (the
window closed) the engine it produced is closed off the main thread instead of being handed over.

Thread contract: `start`, `cancel`, `busy` and `wait` on the main thread; `cancel` is also read by
the worker thread (a `threading.Event`). Signals fire on the main thread.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, Signal

from .worker import Worker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """What to load: a model spec (`default`, a path, `synthetic:SHAPE`), backends, policy."""

    model: str = "default"
    backends: tuple[str, ...] = field(default_factory=tuple)  # empty: the engine's defaults
    policy: str = "default"

    def describe(self) -> str:
        return self.model + (f" on {', '.join(self.backends)}" if self.backends else "")


class ModelLoader(QObject):
    progress = Signal(float)  # 0..1
    status = Signal(str)  # what the load is doing now, in words
    loaded = Signal(object, object)  # Engine, ModelSpec
    failed = Signal(str, object)  # message, ModelSpec

    def __init__(self, load_fn, parent: QObject | None = None):
        super().__init__(parent)
        self._load_fn = load_fn
        self._worker: Worker | None = None
        self._cancelled = threading.Event()

    @property
    def busy(self) -> bool:
        return self._worker is not None and self._worker.running

    def start(self, spec: ModelSpec) -> bool:
        if self.busy:
            return False
        self._cancelled.clear()
        worker = Worker(lambda: self._load(spec, worker.report), name="model-loader", owner=self)
        worker.progress.connect(self._on_report)
        worker.returned.connect(lambda engine: self._on_loaded(engine, spec))
        worker.errored.connect(lambda e: self._on_failed(e, spec))
        self._worker = worker.start()
        return True

    def cancel(self) -> None:
        self._cancelled.set()

    def wait(self, timeout: float | None = None) -> None:
        if self._worker is not None:
            self._worker.join(timeout)

    def _load(self, spec: ModelSpec, report):  # worker thread
        def progress(*args) -> bool:
            # llama.cpp model loading calls progress(fraction); writing a synthetic model file
            # calls progress(done, total).
            if self._cancelled.is_set():
                return False  # llama.cpp aborts the load
            fraction = args[0] / args[1] if len(args) >= 2 and args[1] else args[0]
            report(float(fraction))
            return True

        engine = self._load_fn(spec, progress, report)  # report(str): a status line
        if self._cancelled.is_set():
            engine.close()
            return None
        return engine

    # ---- main thread ----

    def _on_report(self, value) -> None:
        if isinstance(value, str):
            self.status.emit(value)
        else:
            self.progress.emit(value)

    def _on_loaded(self, engine, spec: ModelSpec) -> None:
        if engine is None:
            return  # cancelled: already closed on the worker thread
        if self._cancelled.is_set():  # cancelled after the load returned: nobody will take it
            Worker(engine.close, name="engine-close").start()
            return
        self.loaded.emit(engine, spec)

    def _on_failed(self, e: BaseException, spec: ModelSpec) -> None:
        if not self._cancelled.is_set():
            log.info("loading %s failed: %s", spec.describe(), e)
            self.failed.emit(_message(e), spec)


def _message(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, (ImportError, ModuleNotFoundError)):
        return f"{text} (a component this model needs is not installed)"
    return text
