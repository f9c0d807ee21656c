"""`tandem calibrate`: measure each backend's rates and store them for `Engine.load`.

Prints a table, then one JSON line (the last line of stdout) with every measurement.
`--list` prints what the store holds instead. The engine is built as every command builds it
(`args.load_engine`, the app's `engine_from_args`, which `tandem calibrate` sets).
"""

from __future__ import annotations

import json
import sys

from engine.core.errors import InvalidRequest
from engine.rates.measure import (
    CALIBRATION_GEN,
    CALIBRATION_PROMPT,
    CONTEXT_PROMPT,
    calibrate_backend,
    calibration_steps,
)
from engine.rates.store import RateStore, file_fingerprint, save_calibration

from .progress import Progress

HELP = "measure each backend's rates and store them for this model"


def add_arguments(p) -> None:
    p.add_argument("--prompt-tokens", type=int, default=CALIBRATION_PROMPT,
                   help="prefill prompt length, also the shared context of decode steps (default: %(default)s)")
    p.add_argument("--gen-tokens", type=int, default=CALIBRATION_GEN,
                   help="tokens each decode-measuring request generates (default: %(default)s)")
    p.add_argument("--batches", default=None, metavar="B,B,...",
                   help="batch sizes to time (default: 1..16, then a few up to each backend's cap)")
    p.add_argument("--context-tokens", type=int, default=CONTEXT_PROMPT,
                   help="also time batch 1 and min(cap, 8) over a context this long, for the step's context "
                        "term, the host cost per request there, and min(cap, 8) sequences with prefixes of "
                        "this length that they do not share, for the masked scan (what `tandem simulate` "
                        "uses); 0: skip (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="prefill measurements, median kept (default: %(default)s)")
    p.add_argument("--only", default=None, metavar="NAME,...", help="calibrate only these backends")
    p.add_argument("--no-save", action="store_true", help="measure and print, do not store")
    p.add_argument("--list", action="store_true", help="print the stored calibrations and exit")


def run_calibrate(args) -> int:
    store = RateStore()
    if args.list:
        return _list(store)
    batches = _int_list(args.batches, "--batches") if args.batches else None
    with args.load_engine(args, progress=False, calibrate=False) as eng:
        names = list(eng.backends)
        if args.only:
            wanted = [n.strip() for n in args.only.split(",") if n.strip()]
            unknown = [n for n in wanted if n not in eng.backends]
            if unknown:
                raise InvalidRequest(f"--only: unknown backend(s) {', '.join(unknown)}; have {', '.join(names)}")
            names = wanted
        model = eng.model
        if model.synthetic:
            print("(synthetic model: random weights; its timing is the real shape's)", file=sys.stderr)
        twins = _one_per_config(eng, names)
        measured = list(twins)
        steps = {n: calibration_steps(eng.backends[n], batches, args.repeats, args.context_tokens) for n in measured}
        results = []
        with Progress(sum(steps.values()), "calibrating") as bar:
            offset = 0
            for n in measured:
                def tick(done, _total, what, base=offset):
                    bar.set(base + done, what)

                cal = calibrate_backend(eng.backends[n], prompt_tokens=args.prompt_tokens,
                                        gen_tokens=args.gen_tokens, batches=batches,
                                        repeats=args.repeats, progress=tick,
                                        context_tokens=args.context_tokens)
                offset += steps[n]
                bar.set(offset)
                key = None if args.no_save else save_calibration(store, model.path, cal, model.info.name)
                results.append((cal, key, twins[n]))
        print(format_table(model.info.name, results))
        print(json.dumps({
            "model": model.info.name,
            "model_path": str(model.path),
            "fingerprint": file_fingerprint(model.path),
            "synthetic": model.synthetic,
            "store": None if args.no_save else str(store.path),
            "backends": [{**cal.to_dict(), "stored_as": key, "also_for": also} for cal, key, also in results],
        }))
    return 0


def recalibrate(eng, progress) -> None:
    """The desktop app's Recalibrate: measure every backend (they should be idle), apply and
    store the rates; `progress(text)` hears each step. Blocking."""
    store = RateStore()
    for name, backend in eng.backends.items():
        cal = calibrate_backend(backend, progress=lambda done, total, what: progress(f"calibrating {what} ({done}/{total})"))
        backend.set_rates(cal.rates())
        save_calibration(store, eng.model.path, cal, eng.model.info.name)
        progress(f"{name}: prefill {cal.prefill_tok_s:.0f} tok/s, decode {cal.decode_tok_s:.1f} tok/s at cap {cal.cap}")


def _one_per_config(eng, names: list[str]) -> dict[str, list[str]]:
    """Backends with the same speed-relevant config share one stored entry, so only the first
    is measured: {measured backend: the others that share its entry}."""
    first_of: dict[str, str] = {}
    twins: dict[str, list[str]] = {}
    for n in names:
        key = eng.info(n).rates_key
        if key in first_of:
            twins[first_of[key]].append(n)
        else:
            first_of[key] = n
            twins[n] = []
    return twins


def format_table(model_name: str, results) -> str:
    lines = [f"calibration of {model_name}",
             "| backend | device | threads | cap | prefill tok/s | step ms at b=1..cap | α ms | β ms | decode tok/s at cap "
             "| short context: step ms | γ µs per row per cell | unshared: step ms | δ µs per row per pool cell "
             "| host ms per request |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cal, _, _ in results:
        steps = " / ".join(f"{cal.step_s[b] * 1e3:.2f}" for b in sorted(cal.step_s))
        short = (f"{cal.context_tokens} tokens: " + " / ".join(f"b={b} {t * 1e3:.2f}" for b, t in
                                                              sorted(cal.context_step_s.items()))
                 if cal.context_step_s else "not measured")
        scan = (f"b={cal.scan_batch} {cal.scan_step_s * 1e3:.2f} over {cal.scan_kv:.0f} cells "
                f"(shared: {cal.context_kv.get(cal.scan_batch, 0):.0f})" if cal.scan_batch else "not measured")
        lines.append(f"| {cal.backend} | {cal.device} | {cal.threads} | {cal.cap} | {cal.prefill_tok_s:,.0f} | "
                     f"{steps} | {cal.step_alpha_s * 1e3:.2f} | {cal.step_beta_s * 1e3:.2f} | {cal.decode_tok_s:,.1f} | "
                     f"{short} | {cal.step_gamma_s * 1e6:.3f} | {scan} | {cal.step_delta_s * 1e6:.3f} | "
                     f"{cal.admit_s * 1e3:.1f} |" if cal.context_step_s else
                     f"| {cal.backend} | {cal.device} | {cal.threads} | {cal.cap} | {cal.prefill_tok_s:,.0f} | "
                     f"{steps} | {cal.step_alpha_s * 1e3:.2f} | {cal.step_beta_s * 1e3:.2f} | {cal.decode_tok_s:,.1f} | "
                     f"{short} | – | – | – | – |")
    notes = [f"{cal.backend}: {n}" for cal, _, _ in results for n in cal.notes]
    notes += [f"{', '.join(also)}: same speed-relevant config as {cal.backend}, so the same entry (measured once)"
              for cal, _, also in results if also]
    stored = [k for _, k, _ in results if k]
    if stored:
        notes.append(f"stored in {RateStore().path}; `Engine.load` uses them for this model file and these configs")
    return "\n".join(lines + [f"note: {n}" for n in notes])


def _list(store: RateStore) -> int:
    entries = store.entries()
    print(f"{len(entries)} calibration(s) in {store.path}")
    for _key, e in sorted(entries.items()):
        r = e.get("rates", {})
        print(f"- {e.get('model', '?')} [{e.get('fingerprint')}] {e.get('config')}: prefill "
              f"{r.get('prefill_tok_s', 0):,.0f} tok/s, decode {r.get('decode_tok_s', 0):,.1f} tok/s, "
              f"step {r.get('step_alpha_s', 0) * 1e3:.2f} + {r.get('step_beta_s', 0) * 1e3:.2f}·b ms"
              + (f", context term {r['step_gamma_s'] * 1e6:.2f} µs per row per cell" if r.get("step_gamma_s") else "")
              + (f", masked scan {r['step_delta_s'] * 1e6:.3f} µs per row per pool cell" if r.get("step_delta_s") else "")
              + (f", host {e['admit_s'] * 1e3:.1f} ms per request" if e.get("admit_s") else "")
              + f" ({e.get('measured_at', '?')})")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidRequest(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise InvalidRequest(f"{flag} must list integers >= 1, got {text!r}")
    return values
