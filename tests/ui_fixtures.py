"""Fixtures for the GUI tests (import with `from ui_fixtures import *` in a tests/test_ui_*.py).

- Qt runs offscreen (`QT_QPA_PLATFORM=offscreen`, set before any QApplication exists), so the
  tests need no display server; pytest-qt's `qapp`/`qtbot` drive a real Qt event loop.
- `ui_engine`: one real engine per session — the tiny synthetic model on two 1-thread CPU
  backends (`TANDEM_UI_MODEL=default` runs the same tests on SmolLM2-135M).
- `qasync_loop`: an asyncio loop bound to the Qt loop pytest-qt runs, so chat streaming goes
  through qasync exactly as in the app; the current (and running) loop only during a test that
  asks for it, so other files' tests in the same process see none.
- `make_window`: a factory that builds hidden `MainWindow`s on `ui_engine` (or on `engine=`), with
  their chats and QSettings under the test's tmp_path (never the user's), and at
  teardown shuts them down, checks no bridge is left subscribed to the engine (a leak), waits
  until the engine is idle, that no `ui.worker.Worker` thread is left running, and restores its
  caps, rates, policy (UI_POLICY, which it also sets first) and caches for the next test.
- `spare_engine`: a second engine like `ui_engine`, for a test that breaks a backend and restarts
  it. A restart starts a new `backend-*` worker thread, which conftest's `no_thread_leak` wants
  gone by the end of the test; closing this engine at teardown ends it, and the shared engine is
  never broken.
- `free_port()`: a TCP port nothing listens on (bound to port 0, then released).
- `StepGate`: holds one backend's worker thread inside its `StepDone` publication so a test can
  act while a reply is mid-stream (through the engine's public event bus, no mocks).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest

import engine.llama  # noqa: F401  (llama.cpp before numpy)
from engine.backends.config import parse_backend_specs
from engine.core.events import StepDone
from engine.engine import Engine

UI_MODEL = os.environ.get("TANDEM_UI_MODEL", "synthetic:tiny")
UI_SPECS = ["cpu:threads=1,cap=4,ctx=1024", "cpu:threads=1,cap=4,ctx=1024"]
UI_POLICY = "seed-score"  # the policy each window test starts from (the Teaching view explains it)
WAIT_MS = 60_000  # the bound on any single wait in a GUI test


@pytest.fixture(scope="session")
def ui_engine():
    eng = Engine.load(UI_MODEL, parse_backend_specs(UI_SPECS))
    yield eng
    eng.close()


@pytest.fixture
def qasync_loop(qasync_session_loop):
    """The session's qasync loop (conftest.py), made the thread's current and running loop for
    this test only: a test of another file that runs in the same process (pytest-xdist mixes
    files) may call `asyncio.run`, which refuses to start inside a running loop and leaves no
    current loop behind."""
    asyncio.set_event_loop(qasync_session_loop)
    asyncio.events._set_running_loop(qasync_session_loop)
    yield qasync_session_loop
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop(None)


@pytest.fixture
def spare_engine():
    """Request it before `make_window`, so it is closed after the windows on it."""
    eng = Engine.load(UI_MODEL, parse_backend_specs(UI_SPECS))
    yield eng
    eng.close()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_idle(eng) -> bool:
    return all(not s.items for s in eng.snapshot())


ONE_CPU = ("cpu:threads=1,cap=2,ctx=512",)  # a small engine a test loads in place of the shared one


def load_and_wait(qtbot, window, backends: tuple[str, ...] = ONE_CPU):
    """Load `UI_MODEL` on `backends` in `window` and wait until the window has it; the engine."""
    from ui.loader import ModelSpec

    loaded: list = []
    window.engine_loaded.connect(loaded.append)
    window.load_model(ModelSpec(UI_MODEL, backends))
    qtbot.waitUntil(lambda: bool(loaded), timeout=WAIT_MS)
    return loaded[0]


@pytest.fixture
def make_window(qtbot, qasync_loop, ui_engine, tmp_path):
    from PySide6.QtCore import QSettings

    from ui.main_window import MainWindow
    from ui.model.history import ChatStore
    from ui.theme import style_sheet
    from ui.worker import Worker

    qtbot_app = qasync_loop  # noqa: F841  (the loop must exist before any panel streams)
    subs_before = ui_engine.bus.n_subscribers
    initial = {n: (b.cap, b.rates) for n, b in ui_engine.backends.items()}
    ui_engine.router.set_policy(UI_POLICY)  # every test starts from the same policy, first or not
    made: list[MainWindow] = []

    def make(**kw) -> MainWindow:
        kw.setdefault("store", ChatStore(tmp_path / "chats"))
        kw.setdefault("settings", QSettings(str(tmp_path / "settings.ini"), QSettings.IniFormat))  # not the user's
        kw.setdefault("owns_engine", False)
        w = MainWindow(kw.pop("engine", ui_engine), **kw)
        w.setStyleSheet(style_sheet())
        made.append(w)  # never shown: widgets, timers and signals all work hidden
        return w

    yield make

    for w in made:
        w.shutdown()
        w.deleteLater()
    leaked = ui_engine.bus.n_subscribers - subs_before
    workers_left = Worker.join_all(WAIT_MS / 1000)
    deadline = time.monotonic() + WAIT_MS / 1000
    while not engine_idle(ui_engine) and time.monotonic() < deadline:
        time.sleep(0.02)
    for name, (cap, rates) in initial.items():
        b = ui_engine.backend(name)
        b.set_cap(cap)
        b.set_rates(rates)
    ui_engine.router.set_policy(UI_POLICY)
    ui_engine.router.set_budget("raw")
    ui_engine.router.clear()
    ui_engine.flush(timeout=30)
    assert leaked == 0, f"{leaked} engine-bus subscription(s) outlived their window"
    assert engine_idle(ui_engine), "the engine was still busy after the test"
    assert not workers_left, f"worker threads left running: {workers_left}"


class StepGate:
    """Block `backend`'s worker after its `after`-th step until `release()` (or 30 s)."""

    def __init__(self, bus, backend: str, after: int = 2):
        self.backend = backend
        self.after = after
        self.count = 0
        self.reached = threading.Event()
        self._released = threading.Event()
        self._unsubscribe = bus.subscribe(self._on_step, (StepDone,))

    def _on_step(self, event) -> None:  # the backend's worker thread
        if event.backend != self.backend or self._released.is_set():
            return
        self.count += 1
        if self.count >= self.after:
            self.reached.set()
            self._released.wait(30)

    def release(self) -> None:
        self._released.set()
        self._unsubscribe()
