"""Tandem's composition root: CLI, HTTP server, GUI launcher. Every `tandem` and `python -m app...`
command starts here, so llama.cpp's libraries load here, before anything imports numpy
(engine/llama/__init__.py says why; tests/test_import_order.py checks it)."""

import engine.llama  # noqa: F401  (first: llama.cpp before numpy)
