import engine.llama  # noqa: F401  (first: llama.cpp before numpy; see engine/llama/__init__.py)
from app.cli import main

raise SystemExit(main())
