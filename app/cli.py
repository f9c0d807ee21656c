"""`tandem` command line. Headless commands never import Qt; the GUI is imported lazily.

Each command's parser names its function (`set_defaults(func=...)`); benchmarks and calibration
declare their own arguments in bench/."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

import engine.llama  # noqa: F401  (loads llama.cpp before numpy; see engine/llama/__init__.py)
from engine.core.errors import EngineError

DEFAULT_SYSTEM = "You are a helpful assistant."


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="default | PATH.gguf | synthetic:SHAPE[:QUANT] (default: %(default)s)")
    p.add_argument("--backend", action="append", default=None, metavar="SPEC",
                   help="DEVICE[:cap=N,threads=N,ctx=N,name=X] (repeatable; default: GPU+CPU, "
                        "or one CPU backend with every core)")
    p.add_argument("--policy", default="default",
                   help="routing policy; default: the default policy, finish-first:pack (engine/routing/default.py)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command")
    _add_gui(sub)
    _add_generate(sub)
    _add_serve(sub)
    _add_backend(sub)
    _add_benches(sub)
    _add_simulate_and_calibrate(sub)
    return parser


def _add_gui(sub) -> None:
    gui = sub.add_parser("gui", help="the desktop app (the default command)")
    _add_model_args(gui)
    from app.gui import add_gui_arguments  # argparse only: Qt is imported when the app runs

    add_gui_arguments(gui)
    gui.set_defaults(func=_lazy("app.gui", "run_gui"))


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="stream one chat reply to stdout")
    _add_model_args(gen)
    gen.set_defaults(func=_lazy("app.generate", "run_generate"))
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--system", default=DEFAULT_SYSTEM, help="system prompt ('' for none)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stats", action="store_true", help="print the finish record to stderr")


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with Prometheus /metrics")
    _add_model_args(serve)
    serve.set_defaults(func=_lazy("app.server", "run_serve"))
    serve.add_argument("--no-calibrate", action="store_true",
                       help="do not measure backends without stored rates at start (they are priced by "
                            "placeholder rates until served steps refine them)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    serve.add_argument("--port", type=int, default=8080, help="port (default: %(default)s)")
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on /v1/* (visible in `ps` to every local "
                            "user: prefer --api-key-file or $TANDEM_API_KEY)")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read the API key from the first line of PATH (default: $TANDEM_API_KEY, else none)")
    _add_guard_args(serve)


def _add_guard_args(serve: argparse.ArgumentParser) -> None:
    """`tandem serve`'s connection and browser limits (docs/security.md), defaults from `GuardSettings`."""
    from app.http_guard import GuardSettings  # aiohttp only: no engine import

    g = GuardSettings()
    serve.add_argument("--max-connections", type=int, default=g.max_connections,
                       help="open connections at most; above, the longest-idle connection (headers, body "
                            "or keep-alive) is dropped, else the new one gets 503 (default: %(default)s)")
    serve.add_argument("--max-client-connections", type=int, default=g.max_client_connections, metavar="N",
                       help="open connections per client address; above, a new one from that address gets 429 "
                            "(default: %(default)s)")
    serve.add_argument("--max-client-sequences", type=int, default=g.max_client_sequences, metavar="N",
                       help="sequences (a request's n choices each) one client address may have generating or "
                            "queued; above, its next request gets 429 (default: %(default)s)")
    serve.add_argument("--refuse-hold", type=float, default=g.refuse_hold_s, metavar="S",
                       help="seconds (1-2x) a connection over its address's cap, or of an address in debt, waits "
                            "unread before its 429, so a client that reconnects at once cannot keep the server "
                            "busy (default: %(default)s)")
    serve.add_argument("--refused-cpu-share", type=float, default=g.refused_cpu_share, metavar="F",
                       help="share of a core that parsing an address's refused (4xx) requests may take; past "
                            "its burst, that address waits before its next request is read (default: %(default)s)")
    serve.add_argument("--refused-cpu-burst", type=float, default=g.refused_cpu_burst_s, metavar="S",
                       help="CPU seconds of refused requests an address may spend at once (default: %(default)s)")
    serve.add_argument("--header-timeout", type=float, default=g.header_timeout, metavar="S",
                       help="seconds a new connection has to send its request headers (default: %(default)s)")
    serve.add_argument("--body-timeout", type=float, default=g.body_timeout, metavar="S",
                       help="seconds a request has to send its whole body (default: %(default)s)")
    serve.add_argument("--body-idle-timeout", type=float, default=g.body_idle_timeout, metavar="S",
                       help="seconds a body may pause between bytes, at least (up to twice that, drawn per "
                            "wait, so bodies stalled together time out apart; default: %(default)s)")
    serve.add_argument("--keepalive-timeout", type=float, default=g.keepalive_timeout, metavar="S",
                       help="seconds an idle kept-alive connection stays open (default: %(default)s)")
    serve.add_argument("--send-timeout", type=float, default=g.send_timeout, metavar="S",
                       help="seconds a reply may make no progress into a client that does not read it before "
                            "the connection is dropped (default: %(default)s)")
    serve.add_argument("--max-head-bytes", type=int, default=g.max_head_bytes, metavar="N",
                       help="largest request head (request line and headers); above, 431 (default: %(default)s)")
    serve.add_argument("--trusted-proxy", action="append", default=None, metavar="ADDR[,ADDR...]",
                       help="reverse proxies (addresses or networks) whose X-Forwarded-For names the client: "
                            "per-address limits then apply to each client behind them, not to the proxy "
                            "(default: none, X-Forwarded-For is ignored)")
    serve.add_argument("--max-body-bytes", type=int, default=g.max_body_bytes, metavar="N",
                       help="largest request body, refused before it is read (default: %(default)s)")
    serve.add_argument("--allowed-hosts", action="append", default=None, metavar="NAME[,NAME...]",
                       help="Host names to accept besides loopback and the address connected to "
                            "(behind a proxy: its public name; '*' for any)")
    serve.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN[,ORIGIN...]",
                       help="browser origins allowed to call the API, with CORS (e.g. http://localhost:3000; "
                            "default: none, cross-origin requests get 403)")


def _add_backend(sub) -> None:
    be = sub.add_parser("backend", help="act on a backend of a running server")
    be.set_defaults(func=_lazy("app.backend_cmd", "run_backend"))
    besub = be.add_subparsers(dest="backend_command", required=True)
    rs = besub.add_parser("restart", help="give a (failed) backend a fresh context")
    rs.add_argument("name")
    rs.add_argument("--url", default="http://127.0.0.1:8080", help="the server (default: %(default)s)")
    rs.add_argument("--api-key", default=None, help="its API key (default: $TANDEM_API_KEY)")


def _add_simulate_and_calibrate(sub) -> None:
    from bench import simulate

    sim = sub.add_parser("simulate", help=simulate.HELP)
    simulate.add_arguments(sim)
    sim.set_defaults(func=simulate.run_simulate)

    from app.engine_setup import engine_from_args
    from bench import calibrate

    cal = sub.add_parser("calibrate", help=calibrate.HELP)
    _add_model_args(cal)
    calibrate.add_arguments(cal)
    cal.set_defaults(func=calibrate.run_calibrate, load_engine=engine_from_args)


def _add_benches(sub) -> None:
    """`tandem bench NAME`: each bench (bench/*.py) declares its own arguments."""
    from app.engine_setup import engine_from_args
    from app.runtime import SWITCH_INTERVAL_S
    from bench import attack, cache, chat, constrained, fleet, history, laptop, overhead, prefill, soak, study, together
    from bench import ui as ui_cost

    bsub = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for name, help_, add_arguments, run in (
            ("overhead", overhead.HELP, overhead.add_arguments, overhead.run_overhead),
            ("cache", cache.HELP, cache.add_arguments, cache.run_cache),
            ("prefill", prefill.HELP, prefill.add_arguments, prefill.run_prefill),
            ("together", together.HELP, together.add_arguments, together.run_together),
            ("ui", ui_cost.HELP, ui_cost.add_arguments, ui_cost.run_ui_bench),
            ("seed", study.SEED_HELP, study.add_seed_arguments, study.run_seed),
            ("grid", study.GRID_HELP, study.add_grid_arguments, study.run_grid),
            ("fleet", fleet.HELP, fleet.add_arguments, fleet.run_fleet),
            ("chat", chat.HELP, chat.add_arguments, chat.run_chat),
            ("history", history.HELP, history.add_arguments, history.run_history),
            ("soak", soak.HELP, soak.add_arguments, soak.run_soak),
            ("attack", attack.HELP, attack.add_arguments, attack.run_attack),
            ("constrained", constrained.HELP, constrained.add_arguments, constrained.run_constrained),
            ("laptop", laptop.HELP, laptop.add_arguments, laptop.run_laptop)):
        p = bsub.add_parser(name, help=help_)
        add_arguments(p)
        p.set_defaults(func=run)
    # What three benches take from the app, which they sit below: the GIL switch interval the app
    # runs with, the HTTP server the soak and the in-process chat send their API traffic to, and
    # the engine `tandem serve` would load.
    bsub.choices["ui"].set_defaults(switch_interval_s=SWITCH_INTERVAL_S)
    bsub.choices["soak"].set_defaults(start_api=_start_api)
    bsub.choices["chat"].set_defaults(start_api=_start_api, load_engine=engine_from_args)


async def _start_api(engine):
    """The OpenAI-compatible server on a free loopback port: (aiohttp runner, base URL)."""
    from app.server import create_app, start_server

    return await start_server(create_app(engine), "127.0.0.1", 0)


def _lazy(module: str, name: str):
    """A command's function, imported when the command runs (the GUI's Qt, the server's aiohttp)."""
    def run(args):
        return getattr(importlib.import_module(module), name)(args)

    return run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line; `tandem [gui] [--model M ...]`: without a command it is the app, so
    `tandem`, `tandem -v` and `tandem --model M --demo 8` all mean `tandem gui ...`."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    lead = 0
    while lead < len(argv) and argv[lead] in ("-v", "--verbose"):
        lead += 1
    if lead == len(argv) or (argv[lead].startswith("-") and argv[lead] not in ("-h", "--help")):
        argv.insert(lead, "gui")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command in ("gui", "serve") or getattr(args, "bench", None) in ("soak", "chat"):
        from app.runtime import settle_for_serving

        settle_for_serving()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except EngineError as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
