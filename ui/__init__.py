"""Tandem's desktop UI (PySide6 + pyqtgraph).

- `ui.model`: what the views show, Qt-free (chats and their versions, the Hub client, live
  statistics, how figures are written, plot axes, Markdown, errors as advice); tests need no screen.
- `ui.chat`: the chat, the window's central widget.
- `ui.panels`: the Monitor drawer's panels (Backends, Controls, Routing, Latency, Teaching,
  Experiments), the loading screen and the presenter view; `ui.plots`: the parts their plots share.
- `ui.dialogs`: File ▸ Load model and Get model.
- At the top: the window (`main_window`) and what it runs on: the bridge from the engine's
  threads (`bridge`), blocking work off the GUI thread (`worker`), model loading (`loader`),
  live runs (`live_run`), the in-process server (`server_control`), the theme, the event-loop probe.

Views take their model (the `Engine`, a `ChatStore`, ...) in the constructor and read engine
state from one snapshot timer (`ui.bridge.EngineBridge.tick`); engine events reach them through
queued Qt signals. Nothing here imports llama_cpp, and no worker thread touches a widget;
`ui.model` imports no Qt and no view (pyproject.toml's import contracts).
"""
