"""Shared fixtures: real models (the tiny synthetic one and the default SmolLM2) and a
backend factory that owns teardown. Every wait in the tests is bounded."""

from __future__ import annotations

import threading

import pytest

import engine.llama  # noqa: F401  (llama.cpp before numpy: see engine/llama/__init__.py)
from engine.backends.config import BackendConfig
from engine.backends.local import Backend
from engine.llama.model import Model, resolve_model

# The longest files first (seconds of setup and calls on a 2-core machine, `pytest -n 2
# --durations=0`). With `--no-loadscope-reorder` (pyproject.toml) `--dist loadfile`
# hands files out in collection order; by default it orders them by their number of tests, and a
# long file of few tests (the fleet's, the soak, the attack bench) ran alone at the end.
LONGEST_FIRST = ("test_ui_first_start.py", "test_ui_app.py", "test_fleet.py", "test_server.py",
                 "test_bench_fleet.py", "test_security.py", "test_ui_chat.py", "test_api_clients.py",
                 "test_api_tools.py", "test_fused_dist.py", "test_ui_panels.py", "test_ui_live_run.py",
                 "test_bench_attack.py", "test_bench_chat.py", "test_api_responses.py", "test_soak.py")


def pytest_collection_modifyitems(items):
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory):
    """Synthetic models and stored calibrations go to a fresh directory, never the user's."""
    import os

    old = os.environ.get("TANDEM_CACHE_DIR")
    os.environ["TANDEM_CACHE_DIR"] = str(tmp_path_factory.mktemp("tandem-cache"))
    yield
    if old is None:
        os.environ.pop("TANDEM_CACHE_DIR", None)
    else:
        os.environ["TANDEM_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def tiny_path():
    return resolve_model("synthetic:tiny")


@pytest.fixture(scope="session")
def default_path():
    return resolve_model("default")


@pytest.fixture(scope="session")
def tiny_model(tiny_path):
    m = Model(tiny_path, "cpu")
    yield m
    m.close()


@pytest.fixture(scope="session")
def default_model(default_path):
    m = Model(default_path, "cpu")
    yield m
    m.close()


@pytest.fixture(scope="session")
def qasync_session_loop(qapp):
    """One qasync loop for the session, as in the app (a second QEventLoop on the same
    QApplication after closing the first stops delivering callbacks); closed at the end, so its
    executor's threads are gone before Qt is. GUI tests ask for it through `ui_fixtures.qasync_loop`."""
    import asyncio

    import qasync

    loop = qasync.QEventLoop(qapp, already_running=True)
    asyncio.events._set_running_loop(None)  # running only inside a test that asks (qasync_loop)
    yield loop
    asyncio.set_event_loop(loop)
    asyncio.events._set_running_loop(loop)
    loop.stop()
    loop.close()
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop(None)


@pytest.fixture
def make_backend():
    """`make_backend(model, **config)` → a started Backend, stopped at teardown."""
    made: list[Backend] = []

    def make(model, **kw):
        kw.setdefault("threads", 1)
        kw.setdefault("n_ctx", 1024)
        b = Backend(BackendConfig(**kw), model).start()
        made.append(b)
        return b

    yield make
    for b in made:
        b.stop()


@pytest.fixture(autouse=True)
def no_thread_leak(request):
    """Every test must leave no worker thread behind. Threads are compared as objects: a thread
    that ends gives its ident to the next one. A test that restarts a backend of a module's
    engine (`restarts_module_backend`) leaves that backend's new worker to the engine's owner."""
    before = set(threading.enumerate())
    yield
    if request.node.get_closest_marker("restarts_module_backend"):
        return
    leaked = [t for t in threading.enumerate() if t not in before and t.name.startswith("backend-")]
    for t in leaked:
        t.join(5)
    assert not [t for t in leaked if t.is_alive()], f"threads left running: {leaked}"


# ---- the OpenAI API tests' server: `tandem serve` on the default model, with the test module's
# backend spec (`SPEC`) and per-request bound (`TIMEOUT`), and the official client in front. It
# starts uncalibrated: one backend has nothing to route between, and measuring at start (tested in
# test_calibrate.py) would cost each module's first start several seconds ----


@pytest.fixture(scope="module")
def server(request):
    from servers import Server

    srv = Server("--model", "default", "--backend", request.module.SPEC, "--no-calibrate").wait_healthy()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(request, server):
    import openai

    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=request.module.TIMEOUT, max_retries=0)
    yield c
    c.close()
