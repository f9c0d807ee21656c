"""Tandem's composition root: CLI, HTTP server, benchmarks, GUI launcher.

Every `tandem` and `python -m app...` command passes through here first, so this is where
llama.cpp's libraries are loaded, before anything imports numpy (engine/llama.py says why;
tests/test_import_order.py checks it).
"""

import engine.llama  # noqa: F401  (first: llama.cpp before numpy)
