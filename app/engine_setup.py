"""Building an Engine from command-line arguments (shared by every command)."""

from __future__ import annotations

import logging
import sys

from bench.progress import loading_bar
from engine import llama
from engine.backends.config import default_specs, parse_backend_specs
from engine.engine import Engine

log = logging.getLogger("tandem")


def engine_from_args(args, *, progress: bool = True, calibrate: bool = True) -> Engine:
    """The engine a command asked for. With `calibrate`, backends this machine has no stored
    rates for are measured before it returns (a few seconds, once per model and config;
    `Engine.load`), so nothing is routed on placeholder rates."""
    gpu = llama.gpu_offload_supported()
    log.info("llama.cpp GPU offload: %s", "yes" if gpu else "no (CPU build)")
    specs = args.backend or default_specs(gpu=gpu)
    configs = parse_backend_specs(specs)
    bar = loading_bar("loading model") if progress and sys.stderr.isatty() else None
    try:
        return Engine.load(args.model, configs, policy=getattr(args, "policy", "default"),
                           progress=bar, online_rates=True,
                           calibrate=calibrate and not getattr(args, "no_calibrate", False), status=_say)
    finally:
        if bar is not None:
            bar(1.0)


def _say(text: str) -> None:
    print(f"tandem: {text}", file=sys.stderr, flush=True)
