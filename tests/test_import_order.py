"""Import order, checked in fresh interpreters: the pure engine loads no native code, and every
entry point that can load a model loads llama.cpp before numpy (engine/llama/__init__.py says why),
and OpenMP reads the spin count set before llama.cpp loads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds; each interpreter starts in a few

# What the pure engine is made of: import-linter's "pure engine" contract in pyproject.toml names
# it (checked statically there); here every module under those names is imported, to check what
# actually loads.
with open(ROOT / "pyproject.toml", "rb") as f:
    _CONTRACTS = tomllib.load(f)["tool"]["importlinter"]["contracts"]
_PURE = next(c for c in _CONTRACTS if c["name"] == "The pure engine loads no native code")
PURE = _PURE["source_modules"]
# a module the contract lets import all of a native package (the local backend) is not pure
NATIVE = [i.split(" -> ")[0] for i in _PURE.get("ignore_imports", []) if i.endswith("*")]

# Records the order in which top-level packages are first imported, then runs a module as
# `python -m MODULE ARGS...` would (argparse's --help ends it with SystemExit).
_ORDER_PROBE = """
import json, runpy, sys
order = []
class Probe:
    def find_spec(self, name, path=None, target=None):
        if "." not in name and name not in order:
            order.append(name)
        return None
sys.meta_path.insert(0, Probe())
module, *args = sys.argv[1:]
sys.argv = [module, *args]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print(json.dumps(order), file=sys.__stderr__)
"""


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)


def test_pure_engine_loads_no_native_code():
    code = (f"import importlib, pkgutil, sys\n"
            f"for m in {PURE!r}:\n"
            "    p = importlib.import_module(m)\n"
            "    for sub in pkgutil.walk_packages(getattr(p, '__path__', []), m + '.'):\n"
            f"        if sub.name not in {NATIVE!r}:\n"
            "            importlib.import_module(sub.name)\n"
            "print(sorted(m for m in ('llama_cpp', 'engine.llama', 'numpy') if m in sys.modules))")
    p = _python("-c", code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout


def test_a_remote_backend_loads_no_llama_cpp():
    """A router-only fleet imports the remote backend and its config; neither needs llama.cpp."""
    p = _python("-c", "import sys, engine.backends.remote.backend, engine.backends.config\n"
                      "print(sorted(m for m in ('llama_cpp', 'engine.llama', 'engine.backends.local') if m in sys.modules))")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]", p.stdout


@pytest.mark.parametrize("entry", [["app", "--help"], ["app", "bench", "seed", "--help"], ["app.gui", "--help"]],
                         ids=" ".join)
def test_entry_point_loads_llama_cpp_before_numpy(entry):
    p = _python("-c", _ORDER_PROBE, *entry)
    assert p.returncode == 0, p.stderr
    order = json.loads(p.stderr.strip().splitlines()[-1])
    assert "llama_cpp" in order and "numpy" in order, order
    assert order.index("llama_cpp") < order.index("numpy"), order


_SPIN_PROBE = """
import ctypes
import engine.llama
ctypes.CDLL("libgomp.so.1").omp_display_env(1)  # OpenMP's settings as libgomp read them, on stderr
"""


def _omp_setting(name: str, env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    p = subprocess.run([sys.executable, "-c", _SPIN_PROBE], cwd=ROOT, capture_output=True, text=True,
                       timeout=TIMEOUT, env={**clean, **env})
    assert p.returncode == 0, p.stderr
    line = next((ln for ln in p.stderr.splitlines() if ln.strip().startswith(f"{name} =")), None)
    assert line is not None, p.stderr
    return line.split("=", 1)[1].strip().strip("'")


def test_openmp_threads_spin_briefly_before_they_sleep():
    from engine.llama import SPIN_COUNT

    assert _omp_setting("GOMP_SPINCOUNT", {}) == SPIN_COUNT  # libgomp's own default is 300000


@pytest.mark.parametrize(("env", "spins"), [({"GOMP_SPINCOUNT": "12345"}, "12345"),
                                           ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000")],
                         ids=["GOMP_SPINCOUNT", "OMP_WAIT_POLICY"])
def test_a_users_openmp_wait_setting_is_kept(env, spins):
    assert _omp_setting("GOMP_SPINCOUNT", env) == spins


@pytest.mark.parametrize(("env", "child"), [({}, None), ({"GOMP_SPINCOUNT": "12345"}, "12345")],
                         ids=["set-here", "the-users"])
def test_processes_started_for_other_engines_get_the_users_openmp_setting(env, child):
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = "import json, engine.llama as L; print(json.dumps(L.child_env().get('GOMP_SPINCOUNT')))"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
                       env={**clean, **env})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == child
