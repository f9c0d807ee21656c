"""Tandem's desktop UI (PySide6 + pyqtgraph).

Views take their model (the `Engine`, a `ChatStore`, ...) in the constructor and read engine
state from one snapshot timer (`ui.bridge.EngineBridge.tick`); engine events reach them through
queued Qt signals. Nothing here imports llama_cpp, and no worker thread touches a widget.
"""
