"""The GUI's control of the OpenAI-compatible server inside the window's process, on the same
asyncio loop (qasync): its start/stop state machine and the dialog that picks its address.

`ServerControl` starts and stops the app the window is given (`serve_fn(engine, host, port,
api_key) -> (runner, url)`, a coroutine; the app passes one built on `app.server.create_app`
and `start_server`). Requests it receives go to the window's engine, so external traffic shows
up in the routing and latency views as it happens. Starts, stops and restarts (a new model)
run one after another as tasks on the running loop; the state is published as the status
bar's text through `state_changed`. GUI thread only.

A server on an address other than loopback needs an API key: anyone who can reach the port
could use the model otherwise (`tandem serve` only warns; the GUI refuses).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from dataclasses import dataclass

from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from .theme import FAILED, wrap_label

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


@dataclass(frozen=True)
class ServerOptions:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None

    def refusal(self) -> str | None:
        """Why these options must not be served, or None."""
        if not self.host.strip():
            return "no host given"
        if not self.api_key and not is_loopback(self.host):
            return (f"{self.host} is reachable from other machines: set an API key to serve there "
                    f"(or use {DEFAULT_HOST})")
        return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ServerControl(QObject):
    """Start/stop the in-process server. States: off, starting, on, stopping, failed."""

    state_changed = Signal(str)  # the status bar's text (`text()`)

    def __init__(self, serve_fn, parent: QObject | None = None):
        super().__init__(parent)
        self._serve_fn = serve_fn
        self._runner = None
        self._op: asyncio.Task | None = None
        self.options: ServerOptions | None = None
        self.state = "off"
        self.url: str | None = None
        self.error: str | None = None  # why it is not serving, in full
        self._brief: str | None = None  # the same in a few words, for the status bar

    @property
    def running(self) -> bool:
        return self._runner is not None

    @property
    def busy(self) -> bool:
        """A start or stop is still under way."""
        return self._op is not None and not self._op.done()

    def text(self) -> str:
        """The status bar's short form."""
        if self.state == "on":
            return f"server: {self.url}"
        if self.state == "failed":
            return f"server: {self._brief}"
        if self.state in ("starting", "stopping"):
            return f"server: {self.state}…"
        return "server: off"

    def detail(self) -> str:
        """The whole story (the status bar's tooltip, the terminal)."""
        if self.state == "on":
            key = ", with an API key" if self.options is not None and self.options.api_key else ""
            return f"serving an OpenAI-compatible API at {self.url}/v1{key}"
        if self.state == "failed":
            return self.error or "the server failed"
        return self.text().removeprefix("server: ")

    def start(self, engine, options: ServerOptions) -> asyncio.Task | None:
        """Serve `engine` with `options` (after any start or stop under way). None if refused."""
        why = options.refusal()
        if why is not None:
            brief = f"{options.host} needs an API key" if options.host.strip() else "no host"
            self._set("failed", error=f"not started: {why}", brief=f"not started ({brief})")
            return None
        self.options = options
        return self._schedule(lambda: self._start(engine, options))

    def stop(self) -> asyncio.Task | None:
        """Stop serving (open streams get the server's shutdown timeout). None if already off."""
        if not self.running and not self.busy:
            return None
        return self._schedule(self._stop)

    async def aclose(self) -> None:
        """Stop and wait until stopped (the app's last step before its loop closes)."""
        task = self.stop()
        if task is not None:
            await task

    def restart(self, engine) -> asyncio.Task | None:
        """Serve another engine on the same address (the window loaded a new model)."""
        if not (self.running or self.busy) or self.options is None:
            return None
        options = self.options
        self._schedule(self._stop)
        return self._schedule(lambda: self._start(engine, options))

    # ---- on the loop ----

    def _schedule(self, step) -> asyncio.Task:
        previous = self._op

        async def run():
            if previous is not None and not previous.done():
                await asyncio.wait([previous])
            await step()

        self._op = asyncio.get_event_loop().create_task(run())
        return self._op

    async def _start(self, engine, options: ServerOptions) -> None:
        if self._runner is not None:
            return
        self._set("starting")
        where = f"{options.host}:{options.port}"
        try:
            self._runner, url = await self._serve_fn(engine, options.host, options.port, options.api_key)
        except OSError as e:  # the port is taken, or the address is not this machine's
            why = os.strerror(e.errno) if e.errno else str(e)  # asyncio's own text repeats the address
            self._set("failed", error=f"cannot listen on {where}: {why}", brief=f"{why.lower()} ({where})")
            return
        except Exception as e:  # shown in the status bar; the window goes on
            log.exception("the server did not start")
            self._set("failed", error=f"cannot serve on {where}: {e}", brief=f"failed to start on {where}")
            return
        self._set("on", url=url)

    async def _stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._set("stopping")
        try:
            await runner.cleanup()
        except Exception:
            log.exception("stopping the server failed")
        self._set("off")

    def _set(self, state: str, url: str | None = None, error: str | None = None, brief: str | None = None) -> None:
        self.state, self.url, self.error, self._brief = state, url, error, brief
        self.state_changed.emit(self.text())


class ServerDialog(QDialog):
    """Host, port and API key for the in-process server; refuses an open address without a key."""

    def __init__(self, options: ServerOptions | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Start the server")
        self.setMinimumWidth(460)
        options = options or ServerOptions()
        self.host_edit = QLineEdit(options.host)
        self.port_spin = QSpinBox(minimum=1, maximum=65535, value=options.port or DEFAULT_PORT)
        self.key_edit = QLineEdit(options.api_key or "")
        self.key_edit.setEchoMode(QLineEdit.EchoMode.PasswordEchoOnEdit)
        self.key_edit.setPlaceholderText("none (loopback only)")
        self.key_edit.setToolTip("Clients then send `Authorization: Bearer KEY` on /v1/*")
        form = QFormLayout()
        form.addRow("Host", self.host_edit)
        form.addRow("Port", self.port_spin)
        form.addRow("API key", self.key_edit)
        note = wrap_label(QLabel("An OpenAI-compatible API (/v1/chat/completions, /v1/completions, /metrics) "
                                 "on this window's engine: its requests show up in the routing and latency "
                                 "views. Any address other than loopback needs an API key."))
        note.setObjectName("muted")
        self.error_label = wrap_label(QLabel())
        self.error_label.setStyleSheet(f"color:{FAILED}")
        self.error_label.setVisible(False)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Start")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(note)
        lay.addWidget(self.error_label)
        lay.addWidget(buttons)

    def options(self) -> ServerOptions:
        return ServerOptions(self.host_edit.text().strip(), self.port_spin.value(),
                              self.key_edit.text().strip() or None)

    def accept(self) -> None:
        why = self.options().refusal()
        if why is not None:
            self.error_label.setText(why[0].upper() + why[1:] + ".")
            self.error_label.setVisible(True)
            return
        super().accept()
