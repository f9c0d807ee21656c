"""`tandem bench ui`: what the desktop app's UI thread costs the backends.

The backends decode in their own threads, but every step must win Python's GIL back after
`llama_decode` returns, and the UI thread runs Python too (snapshot polling at 15 Hz, the
routing table, plots). This decodes the same batch with the real main window shown and live
on the same engine, and with no UI running at all (the main thread blocked on the results),
in alternation (A B A B ...), and prints the ratio of the medians. It needs a screen (or
xvfb / QT_QPA_PLATFORM=offscreen). The last line of stdout is one JSON object.

The GIL switch interval is the app's (`args.switch_interval_s`, which `tandem bench ui` sets
from `app.runtime`): this package sits below the app and does not import it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from engine.backends.config import default_specs, parse_backend_specs
from engine.core.errors import InvalidRequest
from engine.core.request import Request, SamplingParams
from engine.engine import Engine

from .common import decode_rate, filler_prompt

HELP = "what the live desktop app costs the backends' decode (needs a screen)"


def add_arguments(p) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--backend", action="append", default=None, metavar="SPEC",
                   help="backend specs as for `serve` (default: this machine's defaults)")
    p.add_argument("--batch", type=int, default=4, help="requests decoding together (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--panel", default="routing",
                   help="the bottom panel in front while measuring (default: %(default)s)")


def run_ui_bench(args) -> int:
    from PySide6.QtCore import QCoreApplication, QEvent, QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from ui.main_window import MainWindow
    from ui.theme import style_sheet

    previous = sys.getswitchinterval()
    sys.setswitchinterval(args.switch_interval_s)  # as `tandem gui` runs (the app passes its value)
    app = QApplication.instance() or QApplication(sys.argv[:1])
    eng = Engine.load(args.model, parse_backend_specs(args.backend or default_specs(gpu=False)))
    model = eng.model
    if model is None:
        eng.close()
        raise InvalidRequest("bench ui measures a local model: give --model", param="model")
    window = MainWindow(eng, owns_engine=False)
    window.setStyleSheet(style_sheet())
    window.resize(1600, 1000)
    window.show()
    window.show_panel(args.panel)
    prompt = filler_prompt(model, args.prompt_tokens)
    sp = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)

    def batch(live_ui: bool) -> float:
        handles = [eng.submit(Request(tuple(prompt), sp, source="bench")) for _ in range(args.batch)]
        if live_ui:  # the app's own loop runs until the batch is done
            loop = QEventLoop()

            def quit_when_done() -> None:
                if all(h.done for h in handles):
                    loop.quit()

            check = QTimer()
            check.setInterval(20)
            check.timeout.connect(quit_when_done)
            check.start()
            loop.exec()
            check.stop()
        records = [h.result(600) for h in handles]
        for r in records:
            if r.error:
                raise RuntimeError(r.error)
        return decode_rate(records)

    results: dict[str, list[float]] = {"no_ui": [], "ui": []}
    try:
        app.processEvents()
        batch(True)  # unmeasured: warms the caches, the allocator and every panel
        for rnd in range(1, args.repeats + 1):
            results["no_ui"].append(batch(False))
            results["ui"].append(batch(True))
            print(f"round {rnd}/{args.repeats}: no UI {results['no_ui'][-1]:.1f}  "
                  f"live UI {results['ui'][-1]:.1f} tok/s", file=sys.stderr)
        time.sleep(0.1)
    finally:
        window.shutdown()
        window.deleteLater()
        QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)  # the window goes now
        eng.close()
        sys.setswitchinterval(previous)
    out: dict[str, Any] = {f"{k}_tok_s": round(statistics.median(v), 2) for k, v in results.items()}
    out["ui_ratio"] = round(out["ui_tok_s"] / out["no_ui_tok_s"], 3)
    out["samples"] = {k: [round(x, 2) for x in v] for k, v in results.items()}
    out.update(model=model.path.name, backends=[b for b in eng.backends], batch=args.batch,
               gen_tokens=args.gen_tokens, panel=args.panel, switch_interval_ms=args.switch_interval_s * 1000)
    print(json.dumps(out))
    return 0
