"""`tandem` command line. Headless commands never import Qt; the GUI is imported lazily."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import engine.llama  # noqa: F401  (loads llama.cpp before numpy; see engine/llama.py)
from engine.errors import EngineError

DEFAULT_SYSTEM = "You are a helpful assistant."


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="default | PATH.gguf | synthetic:SHAPE[:QUANT] (default: %(default)s)")
    p.add_argument("--backend", action="append", default=None, metavar="SPEC",
                   help="DEVICE[:cap=N,threads=N,ctx=N,name=X] (repeatable; default: GPU+CPU, "
                        "or two CPU backends splitting the cores)")
    p.add_argument("--policy", default="seed-score", help="routing policy (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command")

    gui = sub.add_parser("gui", help="the desktop app (the default command)")
    _add_model_args(gui)
    from app.gui import add_gui_arguments  # argparse only: Qt is imported when the app runs

    add_gui_arguments(gui)

    gen = sub.add_parser("generate", help="stream one chat reply to stdout")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--system", default=DEFAULT_SYSTEM, help="system prompt ('' for none)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stats", action="store_true", help="print the finish record to stderr")

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with Prometheus /metrics")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    serve.add_argument("--port", type=int, default=8080, help="port (default: %(default)s)")
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on /v1/* (default: $TANDEM_API_KEY, else none)")
    from app.http_guard import GuardSettings  # aiohttp only: no engine import

    g = GuardSettings()
    serve.add_argument("--max-connections", type=int, default=g.max_connections,
                       help="open connections at most; above, a connection still sending its headers is "
                            "dropped, else the new one gets 503 (default: %(default)s)")
    serve.add_argument("--header-timeout", type=float, default=g.header_timeout, metavar="S",
                       help="seconds a new connection has to send its request headers (default: %(default)s)")
    serve.add_argument("--body-timeout", type=float, default=g.body_timeout, metavar="S",
                       help="seconds a request has to send its body (default: %(default)s)")
    serve.add_argument("--keepalive-timeout", type=float, default=g.keepalive_timeout, metavar="S",
                       help="seconds an idle kept-alive connection stays open (default: %(default)s)")
    serve.add_argument("--max-body-bytes", type=int, default=g.max_body_bytes, metavar="N",
                       help="largest request body, refused before it is read (default: %(default)s)")
    serve.add_argument("--allowed-hosts", action="append", default=None, metavar="NAME[,NAME...]",
                       help="Host names to accept besides loopback and the address connected to "
                            "(behind a proxy: its public name; '*' for any)")
    serve.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN[,ORIGIN...]",
                       help="browser origins allowed to call the API, with CORS (e.g. http://localhost:3000; "
                            "default: none, cross-origin requests get 403)")

    be = sub.add_parser("backend", help="act on a backend of a running server")
    besub = be.add_subparsers(dest="backend_command", required=True)
    rs = besub.add_parser("restart", help="give a (failed) backend a fresh context")
    rs.add_argument("name")
    rs.add_argument("--url", default="http://127.0.0.1:8080", help="the server (default: %(default)s)")
    rs.add_argument("--api-key", default=None, help="its API key (default: $TANDEM_API_KEY)")

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    ov = bsub.add_parser("overhead", help="engine decode tok/s vs llama-cpp-python's Llama, same run")
    ov.add_argument("--model", default="default")
    ov.add_argument("--threads", type=int, default=0, help="0: all cores")
    ov.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ov.add_argument("--batches", default="1,4", help="parallel sequences to measure (default: %(default)s)")
    ov.add_argument("--prompt-tokens", type=int, default=516)
    ov.add_argument("--gen-tokens", type=int, default=128)
    ov.add_argument("--repeats", type=int, default=3)
    ov.add_argument("--no-llama", action="store_true", help="skip the high-level Llama baseline")
    ov.add_argument("--batched-bench", metavar="BIN", default=None,
                    help="also run llama.cpp's llama-batched-bench (path) with the same shape")
    ov.add_argument("--host-sampling", action="store_true", help="sample on the host, not in the graph")
    ov.add_argument("--no-fused-greedy", action="store_true",
                    help="llama.cpp's greedy sampler per sequence (and its logit bias for ignore_eos) "
                         "instead of one argmax for all sequences of a step")
    ov.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"])
    ov.add_argument("--n-seq-max", type=int, default=0, help="context sequence slots (0: cap + 8, at least 32)")
    ov.add_argument("--busy-thread", action="store_true",
                    help="also decode beside a pure-Python thread that wants the GIL all the time "
                         "(the worst a UI or HTTP thread could do): reports busy_bB and gil_ratio_bB")
    ov.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval for the run (Python's default: 5 ms)")
    ov.add_argument("--kv", default="unified", choices=["unified", "split"],
                    help="KV layout: one buffer with the prompt aliased, or one stream per sequence "
                         "with the prompt copied (llama-batched-bench then runs without -kvu)")

    ca = bsub.add_parser("cache", help="TTFT with a warm cached prefix vs cold")
    ca.add_argument("--model", default="default")
    ca.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ca.add_argument("--threads", type=int, default=0, help="0: all cores")
    ca.add_argument("--prefix-tokens", type=int, default=496)
    ca.add_argument("--suffix-tokens", type=int, default=20)
    ca.add_argument("--repeats", type=int, default=5)

    pf = bsub.add_parser("prefill", help="prefill speed and decode stalls for n_batch/n_ubatch pairs")
    pf.add_argument("--model", default="default")
    pf.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    pf.add_argument("--threads", type=int, default=0, help="0: all cores")
    pf.add_argument("--sizes", default="512/512,2048/512,2048/2048",
                    help="comma-separated N_BATCH/N_UBATCH pairs (default: %(default)s)")
    pf.add_argument("--prompt-tokens", type=int, default=2048)
    pf.add_argument("--decoders", type=int, default=8, help="sequences decoding when the prompt arrives")
    pf.add_argument("--decode-tokens", type=int, default=1024, help="their length (they are cancelled after)")
    pf.add_argument("--repeats", type=int, default=3)

    tg = bsub.add_parser("together", help="GPU and CPU backends decoding at once vs each alone")
    tg.add_argument("--model", default="default")
    tg.add_argument("--gpu-batch", type=int, default=16)
    tg.add_argument("--cpu-batch", type=int, default=4)
    tg.add_argument("--gpu-threads", type=int, default=1, help="host threads of the GPU context")
    tg.add_argument("--gpu-device", default="gpu", choices=["gpu", "cpu"],
                    help="device of the first backend (cpu: a smoke run on a machine without a GPU)")
    tg.add_argument("--cpu-threads", type=int, default=0, help="0: all cores but one")
    tg.add_argument("--prompt-tokens", type=int, default=516)
    tg.add_argument("--gen-tokens", type=int, default=128)
    tg.add_argument("--repeats", type=int, default=3)

    from app import bench as _bench, bench_soak as _soak, bench_ui as _bench_ui, calibrate_cmd as _calibrate

    ui = bsub.add_parser("ui", help="what the live desktop app costs the backends' decode (needs a screen)")
    _bench_ui.add_arguments(ui)

    seed = bsub.add_parser("seed", help="the seed study's experiment, several policies interleaved")
    _bench.add_seed_arguments(seed)
    grid = bsub.add_parser("grid", help="the study's missing baselines: caps, prefix share, outputs, arrivals, KV")
    _bench.add_grid_arguments(grid)
    from app import bench_fleet as _fleet

    _fleet.add_arguments(bsub.add_parser("fleet", help="engines behind routers (Tandem, sglang-router), tenant workload"))
    soak = bsub.add_parser("soak", help="leak and hang hunt: mixed chat/API traffic with cancellations for N minutes")
    _soak.add_arguments(soak)

    cal = sub.add_parser("calibrate", help="measure each backend's rates and store them for this model")
    _add_model_args(cal)
    _calibrate.add_arguments(cal)
    return parser


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
    if args.command in ("gui", "serve") or getattr(args, "bench", None) == "soak":
        from app.runtime import settle_for_serving

        settle_for_serving()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = args.command
    try:
        if command == "gui":
            from app.gui import run_gui

            return run_gui(args)
        if command == "generate":
            from app.generate import run_generate

            return run_generate(args)
        if command == "serve":
            from app.server import run_serve

            return run_serve(args)
        if command == "backend":
            from app.backend_cmd import run_backend

            return run_backend(args)
        if command == "bench" and args.bench == "cache":
            from app.bench_cache import run_cache

            return run_cache(args)
        if command == "bench" and args.bench == "prefill":
            from app.bench_prefill import run_prefill

            return run_prefill(args)
        if command == "bench" and args.bench == "together":
            from app.bench_together import run_together

            if not args.cpu_threads:
                args.cpu_threads = max((os.cpu_count() or 2) - 1, 1)
            return run_together(args)
        if command == "bench" and args.bench == "overhead":
            from app.bench_overhead import run_overhead

            return run_overhead(args)
        if command == "bench" and args.bench in ("seed", "grid"):
            from app.bench import run_grid, run_seed

            return (run_seed if args.bench == "seed" else run_grid)(args)
        if command == "bench" and args.bench == "fleet":
            from app.bench_fleet import run_fleet

            return run_fleet(args)
        if command == "bench" and args.bench == "ui":
            from app.bench_ui import run_ui_bench

            return run_ui_bench(args)
        if command == "bench" and args.bench == "soak":
            from app.bench_soak import run_soak

            return run_soak(args)
        if command == "calibrate":
            from app.calibrate_cmd import run_calibrate

            return run_calibrate(args)
    except EngineError as e:
        print(f"tandem: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    raise AssertionError(command)


if __name__ == "__main__":
    raise SystemExit(main())
