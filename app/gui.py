"""`tandem gui`: the desktop app, started with a qasync event loop.

The window appears at once; the model loads on a worker thread with its progress shown, and a
failure is shown in the window (the app keeps running so another model can be picked).

Also runnable as `python -m app.gui` with extra options for docs and checks:

    --screenshot PATH   save the main window to PATH once the model is loaded (and the demo has
                        run for --delay seconds), then exit
    --demo N            send N of the study's requests (516-token prompts sharing a warmed
                        496-token prefix, 128 tokens each, 50 ms apart) once loaded
    --panel NAME        bring a panel to the front: routing, latency, teaching, experiments, controls
    --presenter         open in the presenter view (View > Presenter view, F11)
    --responsiveness    print the event loop's lateness (p50/p95/max) over the demo run (--demo N,
                        48 requests by default) and exit
    --tour DIR          run the scripted tour (`ui.tour`) and save its screenshots in DIR
    --theme NAME        system, dark or light (the View > Theme choice; kept for the next start
                        unless the run is a screenshot or the tour)
    --lesson            start a lesson once loaded (requests that keep arriving until Stop; two
                        backends unless --backend names them; the lesson's prefix warmed while the
                        model loads) and print `lesson: first arrival X.XX s after start`

Screenshots and the tour use a scratch chat store and settings, never the user's (whose saved
window size, layout and theme would change the picture).

`--serve [HOST:]PORT` (also for `tandem gui`) starts the OpenAI-compatible server inside the
app once the model is loaded, on the app's own event loop (Server menu: start/stop it later).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import engine.llama  # noqa: F401  (loads llama.cpp before numpy; see engine/llama/__init__.py)
from bench.calibrate import recalibrate
from engine import llama
from engine.backends.config import default_specs, parse_backend_specs
from engine.engine import Engine
from engine.experiment import experiment_runner
from engine.lesson import lesson_specs

log = logging.getLogger(__name__)


def load_engine(spec, progress=None, status=None, measure=None) -> Engine:
    """Build an engine for a `ui.loader.ModelSpec` (same defaults as `engine_from_args`);
    `status(text)` hears the backends' speed being measured on a first start, `measure(done,
    total, what)` each step of that measurement."""
    specs = list(spec.backends) or default_specs(gpu=llama.gpu_offload_supported())
    return Engine.load(spec.model, parse_backend_specs(specs), policy=spec.policy, progress=progress,
                       online_rates=True, calibrate=True, status=status, calibration_progress=measure)


async def serve(eng: Engine, host: str, port: int, api_key: str | None):
    """The window's server: `tandem serve`'s app on the running (qasync) loop -> (runner, url)."""
    from .server import create_app, start_server

    return await start_server(create_app(eng, api_key), host, port)


def serve_address(text: str) -> tuple[str, int]:
    """`--serve`'s `[HOST:]PORT` (an IPv6 host in brackets: `[::1]:8080`)."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected [HOST:]PORT, got {text!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"expected [HOST:]PORT with a port in 0-65535, got {text!r}")
    return host, number


def run_gui(args) -> int:
    import qasync

    gpu = llama.gpu_offload_supported()
    print(f"tandem: llama_supports_gpu_offload() = {gpu}", file=sys.stderr)
    app = _application()
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    window = _window(args, gpu)
    window.show()
    if getattr(args, "tour", None):
        return _run_tour(window, loop, args)
    launch = _Launch(args, app, window)
    launch.load(gpu)
    closed = asyncio.Event()
    app.aboutToQuit.connect(closed.set)
    with loop:
        loop.run_until_complete(closed.wait())
        loop.run_until_complete(launch.server.aclose())  # if the app quit without closing the window
    window.shutdown()
    return launch.rc


def _application():
    """The running QApplication, or a new one, styled."""
    from PySide6.QtWidgets import QApplication

    from ui.theme import style_sheet

    running = QApplication.instance()
    app = running if isinstance(running, QApplication) else QApplication(sys.argv[:1])
    app.setApplicationName("Tandem")
    app.setOrganizationName("tandem")
    app.setStyleSheet(style_sheet())
    return app


def _window(args, gpu: bool):
    """The main window; for tours and screenshots, without the user's own chats, window size,
    layout or settings."""
    from ui.main_window import MainWindow

    store = settings = None
    if getattr(args, "tour", None) or getattr(args, "screenshot", None):
        import tempfile

        from PySide6.QtCore import QSettings

        from ui.model.history import ChatStore

        scratch = tempfile.mkdtemp(prefix="tandem-tour-")
        store = ChatStore(os.path.join(scratch, "chats"))
        settings = QSettings(os.path.join(scratch, "settings.ini"), QSettings.Format.IniFormat)
    window = MainWindow(load_fn=load_engine, gpu_offload=gpu, recalibrate=recalibrate,
                        bench_runner_factory=experiment_runner, serve_fn=serve, store=store, settings=settings)
    theme = getattr(args, "theme", None)
    if theme:
        window.set_theme(theme)
    return window


def _run_tour(window, loop, args) -> int:
    """`--tour DIR` (`--tour-only PART`): retake the screenshots, then quit."""
    from pathlib import Path

    from ui.tour import chat_tour, first_start, lesson_tour, tour, whatif

    only = getattr(args, "tour_only", None)
    part = {"whatif": whatif, "chat": chat_tour, "first-start": first_start, "lesson": lesson_tour}.get(only or "", tour)
    with loop:
        try:
            loop.run_until_complete(part(window, Path(args.tour), args))
        finally:
            window.shutdown()
    return 0


class _Launch:
    """What the command line asked of the window once its model loads: a server, the presenter
    view, a panel, a demo or a lesson, a screenshot after a delay, the responsiveness probe."""

    def __init__(self, args, app, window) -> None:
        self.args, self.app, self.window = args, app, window
        self.rc = 0
        self.screenshot = getattr(args, "screenshot", None)
        self.demo = getattr(args, "demo", None) or 0
        self.responsiveness = getattr(args, "responsiveness", False)
        if self.responsiveness and not self.demo:
            self.demo = 48  # the lateness is measured over a demo run: without one it would never end
        self.lesson = bool(getattr(args, "lesson", False))
        self.address: tuple[str, int] | None = getattr(args, "serve", None)
        server = window.server
        if server is None:
            raise RuntimeError("the window was made without a server control (serve_fn)")
        self.server = server
        if self.address is not None:  # what the server does, on the terminal that asked for it
            server.state_changed.connect(lambda _text: print(f"tandem: server: {server.detail()}", file=sys.stderr))

    def load(self, gpu: bool) -> None:
        from ui.loader import ModelSpec

        args, window = self.args, self.window
        window.engine_loaded.connect(self.on_loaded)
        window.load_failed.connect(self.on_failed)
        backends = tuple(args.backend or (lesson_specs(gpu) if self.lesson else ()))
        if self.lesson:
            window.lessons.started.connect(lambda run: run.first_arrival.connect(
                lambda s: print(f"lesson: first arrival {s:.2f} s after start", flush=True)))
        window.load_model(ModelSpec(args.model, backends, getattr(args, "policy", "default"), lesson=self.lesson))

    def finish(self, rc: int = 0) -> None:
        if self.screenshot:
            path = self.window.save_screenshot(self.screenshot)
            print(f"tandem: screenshot saved to {path}", file=sys.stderr)
        self.rc = rc
        self.window.close()
        self.app.quit()

    def on_loaded(self, _engine) -> None:
        from PySide6.QtCore import QTimer

        from ui.live_run import seed_workload
        from ui.server_control import ServerOptions

        window, args = self.window, self.args
        if self.address is not None and not self.server.running:
            api_key = getattr(args, "api_key", None) or os.environ.get("TANDEM_API_KEY") or None
            window.start_server(ServerOptions(*self.address, api_key))
        if getattr(args, "presenter", False):
            window.set_presenter(True)
        if getattr(args, "panel", None):
            window.show_panel(args.panel)
        run = window.start_demo(seed_workload(self.demo)) if self.demo else None
        if self.responsiveness and run is not None:
            run.phase.connect(lambda ph: window.probe.reset(keep_all=True) if ph == "running" else None)
            run.done.connect(self.report)
        elif self.responsiveness:
            print("tandem: --responsiveness: the demo run could not start", file=sys.stderr)
            self.finish(1)
        elif self.screenshot:
            delay = getattr(args, "delay", None)
            QTimer.singleShot(int((delay if delay is not None else (8.0 if self.demo or self.lesson else 1.5)) * 1000),
                              self.finish)

    def report(self, result) -> None:
        """`--responsiveness`: the event loop's lateness over the demo run; exit 1 past 50 ms p95."""
        p = self.window.probe
        print(f"event-loop lateness during a {result.spec.n_requests}-request run "
              f"({result.summary().metrics.makespan_s:.1f} s, {len(p.samples)} samples of a "
              f"{p.interval_s * 1000:.0f} ms schedule, {p.missed} missed ticks): "
              f"p50 {p.percentile(50) * 1000:.1f} ms, p95 {p.percentile(95) * 1000:.1f} ms, "
              f"max {max(p.samples, default=0) * 1000:.1f} ms")
        self.finish(0 if p.percentile(95) <= 0.050 else 1)

    def on_failed(self, message: str) -> None:
        from PySide6.QtCore import QTimer

        print(f"tandem: could not load the model: {message}", file=sys.stderr)
        if self.screenshot or self.responsiveness:
            QTimer.singleShot(500, lambda: self.finish(1))


def add_gui_arguments(p: argparse.ArgumentParser) -> None:
    """The GUI's own options (for `tandem gui` next to the model arguments). No Qt imported."""
    p.add_argument("--screenshot", metavar="PATH", help="save the main window to PATH once loaded, then exit")
    p.add_argument("--demo", type=int, default=0, metavar="N", help="send N of the study's requests once loaded")
    p.add_argument("--panel", choices=["routing", "latency", "teaching", "experiments", "controls", "backends"],
                   help="bring this panel to the front")
    p.add_argument("--presenter", action="store_true", help="open in the presenter view (F11)")
    p.add_argument("--delay", type=float, default=None, help="seconds to wait before the screenshot")
    p.add_argument("--responsiveness", action="store_true",
                   help="print the event loop's lateness over the --demo run (48 requests unless --demo N; "
                        "p95 must be <= 50 ms), then exit")
    p.add_argument("--tour", metavar="DIR", help="run the screenshot tour, saving into DIR")
    p.add_argument("--tour-only", choices=["whatif", "chat", "first-start", "lesson"], default=None,
                   help="with --tour: only this part of it (whatif: the Teaching panel's What if tab; "
                        "chat: a 6-turn chat, then the Monitor open mid-demo; "
                        "first-start: the loading screen, a demo warming up, the presenter view; "
                        "lesson: docs/teaching.md's lesson, step by step)")
    p.add_argument("--theme", choices=["system", "dark", "light"], default=None,
                   help="the window's theme (kept for the next start, like View > Theme)")
    p.add_argument("--lesson", action="store_true",
                   help="start a lesson once loaded: requests that keep arriving until Stop, on two backends "
                        "(two CPU contexts on a CPU-only machine) unless --backend names them; prints "
                        "`lesson: first arrival X.XX s after start`")
    p.add_argument("--serve", type=serve_address, metavar="[HOST:]PORT",
                   help="start the OpenAI-compatible server in the app once the model is loaded "
                        "(HOST defaults to 127.0.0.1; others need an API key)")
    p.add_argument("--api-key", default=None,
                   help="the in-app server's key: `Authorization: Bearer KEY` on /v1/* "
                        "(default: $TANDEM_API_KEY, else none)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app.gui", description="Tandem desktop app")
    p.add_argument("--model", default="default")
    p.add_argument("--backend", action="append", default=None, metavar="SPEC")
    p.add_argument("--policy", default="default")
    add_gui_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_gui(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
