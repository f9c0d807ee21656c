"""The command line: parsing and the headless commands' clear errors."""

from __future__ import annotations

import subprocess
import sys

from app.cli import main, parse_args


def test_plain_tandem_means_the_app_with_its_defaults():
    args = parse_args([])
    assert args.command == "gui" and args.model == "default" and args.backend is None
    assert parse_args(["-v"]).verbose and parse_args(["-v"]).command == "gui"
    assert parse_args(["generate", "--prompt", "hi"]).command == "generate"


def test_headless_commands_never_import_qt():
    """The GPU machine has no Qt: the CLI, engine, server and benchmarks must import without it."""
    code = ("import sys; from app.cli import parse_args; import app.server, bench.study, bench.soak; "
            "parse_args([]); parse_args(['serve']); "
            "bad = [m for m in sys.modules if m.startswith(('PySide6', 'pyqtgraph', 'qasync'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_bad_model_is_a_clear_error_not_a_traceback(capsys, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_text("nope")
    assert main(["generate", "--model", str(junk), "--prompt", "hi"]) == 2
    assert "not a GGUF file" in capsys.readouterr().err


def test_a_bad_policy_is_refused_before_the_model_loads(capsys, tmp_path):
    """The model named does not exist: the policy's error comes first, so nothing was loaded."""
    assert main(["serve", "--model", str(tmp_path / "absent.gguf"), "--policy", "finish-first:pack:fill=x"]) == 2
    err = capsys.readouterr().err
    assert "policy 'finish-first:pack:fill=x': fill must be a whole number" in err and "absent" not in err


def test_generate_streams_a_reply(capsys):
    assert main(["generate", "--model", "synthetic:tiny", "--backend", "cpu:threads=1,ctx=512",
                 "--prompt", "hello", "--max-tokens", "8", "--stats"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() and '"output_tokens": 8' in out.err
