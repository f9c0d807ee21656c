"""The native boundary's self-check (engine/llama/_abi.py): it passes on the installed
llama-cpp-python, names both versions when another one is installed, names the field when the
ggml_tensor mirror is out of place, and nothing outside _abi.py touches the private parts."""

from __future__ import annotations

import ast
import ctypes
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.core.errors import ModelLoadError
from engine.llama import _abi

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds; each interpreter starts in a few


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)


def test_the_installed_llama_cpp_python_passes():
    report = _abi.check()
    assert report.version in _abi.SUPPORTED == ("0.3.36",)
    assert Path(report.library).is_file()
    assert report.sampled_token_method, "this build of libllama exports llama_context::get_sampled_token_ith"
    assert report.sampled_tokens_method, "and llama_context::get_sampled_tokens"


_UNKNOWN_VERSION = """
import json, sys
import llama_cpp
llama_cpp.__version__ = "0.3.99"  # what another install would report
from engine.core.errors import ModelLoadError
try:
    import engine.llama
except Exception as e:
    print(json.dumps({"type": type(e).__name__, "model_load_error": isinstance(e, ModelLoadError),
                      "import_error": isinstance(e, ImportError), "message": str(e),
                      "loaded": "engine.llama" in sys.modules}))
"""


def test_an_unknown_version_stops_the_import_naming_both_versions():
    p = _python("-c", _UNKNOWN_VERSION)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["type"] == "NativeABIError" and out["model_load_error"] and out["import_error"], out
    assert "llama-cpp-python 0.3.99 is installed" in out["message"], out
    assert "supports llama-cpp-python 0.3.36 only" in out["message"], out
    assert not out["loaded"], "a failed check leaves no half-loaded engine.llama behind"


def test_an_unknown_version_stops_the_app_with_the_message_not_a_crash():
    code = ("import sys, runpy, llama_cpp\nllama_cpp.__version__ = '0.3.99'\nsys.argv = ['app', '--help']\n"
            "runpy.run_module('app', run_name='__main__', alter_sys=True)")
    p = _python("-c", code)
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    assert "NativeABIError: llama-cpp-python 0.3.99 is installed" in p.stderr, p.stderr[-2000:]


class _NarrowNe(ctypes.Structure):
    """The real mirror with `ne` declared as 32-bit: every field from `ne` on is out of place."""

    _fields_ = [(name, ctypes.c_int32 * 4 if name == "ne" else kind)
                for name, kind in _abi.GgmlTensor._fields_]


def test_a_mirror_out_of_place_is_refused_naming_the_field():
    with pytest.raises(ModelLoadError, match=r"its `ne` reads \(1000, 0, 7, 0\) where ggml has \(1000, 7, 1, 1\)"):
        _abi.check_tensor_layout(_NarrowNe)


def test_the_real_mirror_matches_ggml():
    _abi.check_tensor_layout(_abi.GgmlTensor)  # raises on any difference


# ---- nothing but _abi.py reaches llama-cpp-python's private parts ----

PRODUCT = ["engine", "app", "ui", "bench", "scripts"]
ABI = ROOT / "engine" / "llama" / "_abi.py"


def _private_uses(path: Path) -> list[str]:
    """Lines of `path` that touch a private part: llama_cpp's `_lib` or `_internals`, a
    `llama_cpp._...` module or `_name` imported from llama_cpp, a mangled C++ symbol, or a
    ctypes struct read in place (`from_address`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        what = None
        if isinstance(node, ast.Attribute) and node.attr in ("_lib", "_internals", "from_address"):
            what = node.attr
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llama_cpp"):
            if "._" in node.module or any(a.name.startswith("_") for a in node.names):
                what = f"from {node.module} import {', '.join(a.name for a in node.names)}"
        elif isinstance(node, ast.Import) and any(a.name.startswith("llama_cpp._") for a in node.names):
            what = "import " + ", ".join(a.name for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_ZN"):
            what = node.value
        if what is not None:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {what}")
    return found


def test_private_parts_are_touched_in_abi_only():
    files = [p for d in PRODUCT for p in sorted((ROOT / d).rglob("*.py")) if p != ABI]
    assert len(files) > 50
    assert [u for f in files for u in _private_uses(f)] == []
    assert len(_private_uses(ABI)) >= 3, "the scan sees what _abi.py itself does"


@pytest.mark.parametrize(("leak", "contract"), [
    ("import llama_cpp  # noqa: F401\n", "llama.cpp is reached through engine.llama only"),
    ("from .llama import _abi  # noqa: F401\n", "llama-cpp-python's private parts stay in engine.llama._abi"),
], ids=["llama_cpp", "_abi"])
def test_reaching_past_engine_llama_breaks_a_contract(tmp_path, leak, contract):
    """import-linter's contracts (pyproject.toml) on a copy of the tree with one engine module
    that imports llama_cpp, or engine.llama._abi, itself."""
    exe = Path(sys.executable).parent / "lint-imports"
    if not exe.exists():
        pytest.fail(f"lint-imports is not installed next to {sys.executable}: run scripts/setup.sh (test extra)")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("app", "bench", "ui", "engine"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "engine" / "native_leak.py").write_text(leak)

    p = subprocess.run([str(exe), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300)

    assert p.returncode != 0, p.stdout[-4000:]
    assert f"{contract} BROKEN" in p.stdout, p.stdout[-4000:]
    assert "engine.native_leak" in p.stdout, p.stdout[-4000:]
