"""Loading a model without freezing the window.

`ModelLoader` runs a load function (`fn(spec, progress, status, measure) -> Engine`, supplied by
the app) on a `ui.worker.Worker`. A load goes through phases (`PHASES`): writing a synthetic
model's file (`progress(done, total)`), loading the weights (llama.cpp's `progress(fraction)`),
on a first start measuring each backend's speed (`status(text)` names the backend,
`measure(done, total, what)` counts the measurement's steps), and for a lesson
(`ModelSpec.lesson`) warming its shared prefix on every backend, so the lesson's first arrival
finds it cached. The loader emits `phase` when one starts and `progress` with the fraction of the
phase done, so the window can say what is going on with a bar that fills. If the loader is cancelled (the window closed) the engine it produced is
closed off the main thread instead of being handed over.

Thread contract: `start`, `cancel`, `busy` and `wait` on the main thread; `cancel` is also read by
the worker thread (a `threading.Event`). Signals fire on the main thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, Signal

from engine.lesson import LessonMix

from .model.formatting import warm_eta
from .worker import Worker

if TYPE_CHECKING:
    from engine.engine import Engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """What to load: a model spec (`default`, a path, `synthetic:SHAPE`), backends, policy."""

    model: str = "default"
    backends: tuple[str, ...] = field(default_factory=tuple)  # empty: the engine's defaults
    policy: str = "default"
    lesson: bool = False  # warm the lesson's shared prefix before handing the engine over

    def describe(self) -> str:
        return self.model + (f" on {', '.join(self.backends)}" if self.backends else "")


# Each phase of a load: its key and what the window calls it. Some loads skip some: writing a
# file (only a synthetic model's first load), warming (only a lesson's).
PHASES = {"unpacking": "Write the model file", "loading": "Load the weights", "measuring": "Measure the speed",
          "warming": "Warm the lesson's prefix"}
OPTIONAL_PHASES = ("unpacking", "warming")
WARM_POLL_S = 0.1  # how often the warming's bar moves

class ModelLoader(QObject):
    progress = Signal(float)  # 0..1 of the phase in progress
    phase = Signal(str)  # a key of PHASES: the load moved on to it
    status = Signal(str)  # what the load is doing now, in words
    step = Signal(int, int, str)  # the speed measurement: steps done, steps in all, what was measured
    loaded = Signal(object, object)  # Engine, ModelSpec
    failed = Signal(str, object)  # message, ModelSpec

    def __init__(self, load_fn, parent: QObject | None = None):
        super().__init__(parent)
        self._load_fn = load_fn
        self._worker: Worker | None = None
        self._cancelled = threading.Event()
        self.current_phase = ""

    @property
    def busy(self) -> bool:
        return self._worker is not None and self._worker.running

    def start(self, spec: ModelSpec) -> bool:
        if self.busy:
            return False
        self._cancelled.clear()
        self.current_phase = ""
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
            if len(args) >= 2:
                report(("phase", "unpacking"))
                fraction = args[0] / args[1] if args[1] else 0.0
            else:
                report(("phase", "loading"))
                fraction = args[0]
            report(float(fraction))
            return True

        def status(text: str) -> None:
            report(("phase", "measuring"))
            report(text)

        def measure(done: int, total: int, what: str) -> None:
            report(("step", done, total, what))

        engine = self._load_fn(spec, progress, status, measure)
        if spec.lesson and not self._cancelled.is_set():
            try:
                self._warm_lesson(engine, report)
            except BaseException:
                engine.close()
                raise
        if self._cancelled.is_set():
            engine.close()
            return None
        return engine

    def _warm_lesson(self, engine: Engine, report: Callable[[object], None]) -> None:  # worker thread
        """Fill every backend's prefix cache with the lesson's shared prefix, the bar filling at
        the pace the backends' measured prefill rates predict (it stops short of full until done)."""
        prefix = LessonMix.for_engine(engine).prefix()
        names = engine.backend_names
        report(("phase", "warming"))
        report(f"warming the lesson's {len(prefix)}-token shared prefix on {' and '.join(names)}")
        eta = warm_eta(len(prefix), [engine.rates(n).prefill_tok_s for n in names])
        handles = engine.warm(prefix, wait=False)
        t0 = time.monotonic()
        while not all(h.done for h in handles):
            if self._cancelled.is_set():
                return
            report(min(0.95, (time.monotonic() - t0) / eta) if eta > 0 else 0.0)
            time.sleep(WARM_POLL_S)
        errors = [h.result(0).error for h in handles if h.result(0).error]
        if errors:
            raise RuntimeError(f"warming the lesson's prefix failed: {errors[0]}")
        report(1.0)

    # ---- main thread ----

    def _on_report(self, value) -> None:
        if isinstance(value, str):
            self.status.emit(value)
        elif isinstance(value, tuple) and value[0] == "phase":
            if value[1] != self.current_phase:
                self.current_phase = value[1]
                self.phase.emit(value[1])
        elif isinstance(value, tuple):
            _, done, total, what = value
            self.progress.emit(done / total if total else 0.0)
            self.step.emit(done, total, what)
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
