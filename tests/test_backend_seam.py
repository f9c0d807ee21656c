"""The backend seam holds: nothing outside engine/backends/ asks which kind a backend is or
probes it for members the protocol does not declare, and the remote kind stays in small objects.

Read from the source (`ast`), so a new call site fails here before review: the fix is a method
of `BackendProtocol` (with its default on `BackendBase`) or a fact of `BackendInfo`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from engine.backends.protocol import BackendBase, BackendProtocol

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "bench", "engine", "ui")
KIND_CHECK = re.compile(r"""device\s*[!=]=\s*["']remote["']|["']remote["']\s+(not\s+)?in\s+[\w.]*devices""")
BACKENDISH = re.compile(r"(^|\.)(b|be|backend|backends\[.*\]|backend\(.*\))$|backends\b")
HOLDS_BACKEND = re.compile(r"^(?!\s*(from|import)\s).*\b(engine|eng|_engine)\.backends\b")
MAX_REMOTE_BACKEND_LINES = 350
MAX_METHODS = 35


def _sources(outside_backends: bool = True) -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    backends = ROOT / "engine" / "backends"
    return [p for p in files if not (outside_backends and backends in p.parents)]


def test_no_caller_asks_whether_a_backend_is_remote():
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _sources()
             for i, line in enumerate(p.read_text().splitlines(), 1) if KIND_CHECK.search(line)]
    assert not found, "ask the protocol (BackendProtocol, BackendInfo), not the device:\n" + "\n".join(found)


def test_no_caller_probes_a_backend_with_hasattr_or_getattr():
    found = []
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and node.args
                    and BACKENDISH.search(ast.unparse(node.args[0]))):
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "a member every backend has belongs on BackendProtocol:\n" + "\n".join(found)


def test_neither_app_nor_ui_holds_a_backend():
    """`app/` and `ui/` name backends and go through `Engine`'s controls, never its table of them."""
    above = [p for p in _sources() if p.relative_to(ROOT).parts[0] in ("app", "ui")]
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in above
             for i, line in enumerate(p.read_text().splitlines(), 1) if HOLDS_BACKEND.search(line)]
    assert not found, "\n".join(found)


def test_the_grep_finds_what_it_looks_for():
    """The two patterns above catch the forms they were written for (so a pass means something)."""
    assert KIND_CHECK.search('if b.device != "remote":')
    assert KIND_CHECK.search("'remote' not in engine.devices.values()")
    assert BACKENDISH.search("b") and BACKENDISH.search("eng.backends[n]") and BACKENDISH.search("self.backend(name)")
    assert not BACKENDISH.search("body") and not BACKENDISH.search("os")
    assert HOLDS_BACKEND.search("up = [b.healthy for b in engine.backends.values()]")
    assert not HOLDS_BACKEND.search("from engine.backends.config import x")
    assert not HOLDS_BACKEND.search("engine.backend_names")


def test_the_remote_backend_module_stays_small():
    lines = len((ROOT / "engine/backends/remote/backend.py").read_text().splitlines())
    assert lines <= MAX_REMOTE_BACKEND_LINES, f"engine/backends/remote/backend.py has {lines} lines"


def test_no_class_of_the_remote_kind_has_more_than_35_methods():
    big = []
    for p in sorted((ROOT / "engine/backends/remote").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef) for m in node.body)
                if n > MAX_METHODS:
                    big.append(f"{p.name}: {node.name} has {n} methods")
    assert not big, "\n".join(big)


def test_every_optional_capability_has_a_default_on_the_base():
    """What a kind may leave out has its default on `BackendBase`."""
    optional = ("prompt_limit", "cap_state", "reset_stats", "calibrate", "info", "kv_state_bytes", "enqueue_group")
    assert all(callable(getattr(BackendBase, name, None)) for name in optional)


def test_every_protocol_method_states_its_contract():
    undocumented = [name for name, member in vars(BackendProtocol).items()
                    if callable(member) and not name.startswith("_") and not (member.__doc__ or "").strip()]
    assert not undocumented, undocumented
