"""Tandem's benchmarks: `tandem bench NAME` runs `bench/NAME.py` (`seed` and `grid` are both
in `study.py`), each declaring its own arguments (`add_arguments`) and a `run_*(args)`;
`app/cli.py` wires them in. `common.py` holds what several share, `report.py` writes and plots
result directories, `target.py` drives HTTP peers, `progress.py` is the terminal progress bar.

Layering: above the engine and the UI, below the app (import-linter checks it). Three benches
take what they need from the app through their arguments, set by `tandem bench`: the GIL
switch interval (`ui`), the HTTP server (`soak`, `chat`) and `tandem serve`'s engine (`chat`). Processes that load models start through
`app` (or tests/conftest.py), which load llama.cpp before numpy (engine/llama/__init__.py).
"""
