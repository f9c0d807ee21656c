"""`ui.worker.Worker`: the callable runs off the main thread, and what it returns, raises or
reports arrives on the main thread; its thread ends and the worker lets go of itself."""

from __future__ import annotations

import gc
import os
import threading
import weakref

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import shiboken6
from PySide6.QtCore import QObject

from ui.worker import Worker

WAIT_MS = 10_000
JOIN_S = 10.0


def on_thread(seen: list):
    """A slot that records the thread it ran on, then the value."""
    return lambda value: seen.append((threading.current_thread(), value))


def test_the_callable_runs_off_the_main_thread(qtbot):
    ran_on = []
    worker = Worker(lambda: ran_on.append(threading.current_thread()), name="test-worker")
    with qtbot.waitSignal(worker.finished, timeout=WAIT_MS):
        worker.start()
    assert ran_on and ran_on[0] is not threading.main_thread()
    assert ran_on[0].name == "test-worker"


def test_the_result_is_delivered_on_the_main_thread(qtbot):
    seen: list = []
    worker = Worker(lambda a, b=0: a + b, 2, b=3, name="test-worker")
    worker.returned.connect(on_thread(seen))
    with qtbot.waitSignal(worker.finished, timeout=WAIT_MS):
        worker.start()
    assert seen == [(threading.main_thread(), 5)]


def test_an_exception_is_delivered_on_the_main_thread(qtbot):
    seen: list = []
    returned: list = []

    def boom():
        raise ValueError("no model here")

    worker = Worker(boom, name="test-worker")
    worker.errored.connect(on_thread(seen))
    worker.returned.connect(returned.append)
    with qtbot.waitSignal(worker.finished, timeout=WAIT_MS):
        worker.start()
    assert [t for t, _ in seen] == [threading.main_thread()]
    assert isinstance(seen[0][1], ValueError) and str(seen[0][1]) == "no model here"
    assert returned == []


def test_reports_arrive_on_the_main_thread_in_order_before_the_result(qtbot):
    order: list = []

    def count():
        for i in range(5):
            worker.report(i)
        return "done"

    worker = Worker(count, name="test-worker")
    worker.progress.connect(lambda v: order.append((threading.current_thread() is threading.main_thread(), v)))
    worker.returned.connect(lambda v: order.append((threading.current_thread() is threading.main_thread(), v)))
    with qtbot.waitSignal(worker.finished, timeout=WAIT_MS):
        worker.start()
    assert order == [(True, 0), (True, 1), (True, 2), (True, 3), (True, 4), (True, "done")]


def test_running_lasts_until_the_outcome_is_delivered(qtbot):
    gate = threading.Event()
    worker = Worker(lambda: gate.wait(JOIN_S), name="test-worker")
    assert not worker.running
    worker.start()
    assert worker.running
    gate.set()
    assert worker.join(JOIN_S)
    assert worker.running  # the thread is over, but the main thread has not been told yet
    qtbot.waitUntil(lambda: not worker.running, timeout=WAIT_MS)


def test_a_finished_worker_leaves_nothing_behind(qtbot):
    before = set(threading.enumerate())
    worker = Worker(lambda: None, name="test-worker")
    with qtbot.waitSignal(worker.finished, timeout=WAIT_MS):
        worker.start()
    assert worker.join(JOIN_S)
    assert [t for t in threading.enumerate() if t not in before] == []
    ref = weakref.ref(worker)
    del worker
    gc.collect()
    assert ref() is None  # delivered: the worker no longer keeps itself alive


def test_join_all_names_the_threads_still_running(qtbot):
    gate = threading.Event()
    worker = Worker(lambda: gate.wait(JOIN_S), name="test-held")
    worker.start()
    assert Worker.join_all(0.05) == ["test-held"]
    gate.set()
    assert Worker.join_all(JOIN_S) == []
    qtbot.waitUntil(lambda: not worker.running, timeout=WAIT_MS)


def test_an_unreferenced_worker_still_delivers(qtbot):
    seen: list = []
    Worker(lambda: 7, name="test-worker").start().returned.connect(seen.append)
    qtbot.waitUntil(lambda: seen == [7], timeout=WAIT_MS)


def test_nothing_is_delivered_once_the_owner_is_gone(qtbot):
    gate = threading.Event()
    owner = QObject()
    seen: list = []
    worker = Worker(lambda: gate.wait(JOIN_S), name="test-worker", owner=owner)
    worker.returned.connect(seen.append)
    worker.finished.connect(lambda: seen.append("finished"))
    worker.start()
    owner.deleteLater()
    qtbot.waitUntil(lambda: not shiboken6.isValid(owner), timeout=WAIT_MS)
    gate.set()
    qtbot.waitUntil(lambda: not worker.running, timeout=WAIT_MS)
    assert worker.join(JOIN_S)
    assert seen == []
