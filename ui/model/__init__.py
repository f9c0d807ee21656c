"""What the views show, with no Qt: pure functions and plain data that test without a screen.

Nothing here imports PySide6, pyqtgraph or qasync, or any view of `ui` (an import contract in
pyproject.toml). Each module states its thread rules; most are pure and run on any thread.
"""
