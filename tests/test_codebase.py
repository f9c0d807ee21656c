"""The layout's rules as facts: import-linter's contracts, ruff and mypy (their settings are in
pyproject.toml) pass on the tree, and a contract really fails when the engine imports Qt."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TIMEOUT = 300  # seconds; mypy's first run over the four packages takes ~40 s on one core


def _run(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    exe = BIN / args[0]
    if not exe.exists():
        pytest.fail(f"{args[0]} is not installed next to {sys.executable}: run scripts/setup.sh (test extra)")
    return subprocess.run([str(exe), *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)


def _report(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-3000:]}"


def test_import_contracts_are_kept():
    p = _run(["lint-imports"])
    assert p.returncode == 0, _report(p)


def test_ruff_finds_nothing():
    p = _run(["ruff", "check", "--no-cache", "."])
    assert p.returncode == 0, _report(p)


def test_mypy_passes_as_configured():
    """mypy as pyproject.toml configures it: its `files`, strict optional checks, no codes off."""
    p = _run(["mypy"])
    assert p.returncode == 0, _report(p)


def test_mypy_checks_every_package_strictly():
    """What the passing run above covers: the four packages, Optional checked, no error code
    switched off, and a missing-imports pass only for named libraries that ship no types."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert sorted(config["files"]) == ["app", "bench", "engine", "ui"]
    assert config.get("strict_optional", True) is True
    assert "disable_error_code" not in config
    assert not config.get("ignore_missing_imports", False)
    for override in config.get("overrides", []):
        assert set(override) == {"module", "ignore_missing_imports"}, override
        assert not any(m.split(".")[0] in ("engine", "bench", "ui", "app") for m in override["module"]), override


def _copy_tree(tmp_path) -> None:
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("app", "bench", "ui", "engine"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")


def test_engine_importing_qt_breaks_a_contract(tmp_path):
    """The same contracts on a copy of the tree whose engine imports PySide6."""
    _copy_tree(tmp_path)
    (tmp_path / "engine" / "qt_leak.py").write_text("from PySide6 import QtCore  # noqa: F401\n")

    p = _run(["lint-imports", "--no-cache"], cwd=tmp_path)

    assert p.returncode != 0, _report(p)
    assert "The engine is Qt-free and knows nothing above it BROKEN" in p.stdout, _report(p)
    assert "engine.qt_leak -> PySide6" in p.stdout, _report(p)


@pytest.mark.parametrize("leak, chain", [
    ("from ui.chat import transcript", "ui.model.history -> ui.chat.transcript"),
    ("import pyqtgraph", "ui.model.history -> pyqtgraph"),
])
def test_a_ui_model_importing_a_view_or_qt_breaks_a_contract(tmp_path, leak, chain):
    """The same contracts on a copy of the tree whose chat history imports a view, or Qt."""
    _copy_tree(tmp_path)
    with (tmp_path / "ui" / "model" / "history.py").open("a") as f:
        f.write(f"{leak}  # noqa: E402, F401\n")

    p = _run(["lint-imports", "--no-cache"], cwd=tmp_path)

    assert p.returncode != 0, _report(p)
    assert "The UI's models are Qt-free and know no view BROKEN" in p.stdout, _report(p)
    assert chain in p.stdout, _report(p)


def test_an_import_cycle_breaks_a_contract(tmp_path):
    """The same contracts on a copy of the tree whose Responses routes import the server back."""
    _copy_tree(tmp_path)
    with (tmp_path / "app" / "responses.py").open("a") as f:
        f.write("from . import server  # noqa: E402, F401\n")

    p = _run(["lint-imports", "--no-cache"], cwd=tmp_path)

    assert p.returncode != 0, _report(p)
    assert "No import cycles among the modules of app, bench, engine and ui BROKEN" in p.stdout, _report(p)
    assert ".server -> .responses" in p.stdout or ".responses -> .server" in p.stdout, _report(p)


def test_no_test_name_joins_two_behaviours():
    """One behaviour per test: a name with `_and_` is two tests (split it) or one behaviour
    named twice (rename it)."""
    joined = re.compile(r"def (test_[a-z0-9_]*_and_[a-z0-9_]*)")
    offenders = [f"{path.name}: {m.group(1)}" for path in sorted((ROOT / "tests").glob("*.py"))
                 for m in joined.finditer(path.read_text())]
    assert not offenders, "\n".join(offenders)
