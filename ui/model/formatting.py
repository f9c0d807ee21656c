"""How figures and names are written for people: seconds, token rates, where a backend's rates
came from, a model's title, a token's probability. Qt-free, so they test without a screen; pure
functions, any thread.
"""

from __future__ import annotations

import math
import re
from pathlib import Path


def fmt_seconds(s: float | None) -> str:
    """0.0123 -> '12.3 ms', 3.2 -> '3.20 s'; None/NaN -> '–'."""
    if s is None or not math.isfinite(s):
        return "–"
    if s < 1.0:
        return f"{s * 1000:.1f} ms"
    return f"{s:.2f} s"


def fmt_seconds_short(s: float) -> str:
    """0.02 -> '20 ms', 0.0005 -> '0.5 ms', 2 -> '2 s', 120 -> '120 s'."""
    if s < 1e-3:
        return f"{s * 1000:g} ms"
    if s < 1.0:
        return f"{s * 1000:.0f} ms"
    return f"{s:g} s"

def fmt_rate(tok_s: float | None) -> str:
    """76.2413 -> '76.2 tok/s', 2551.0 -> '2,551 tok/s', 0/None/NaN -> '–'."""
    if tok_s is None or not math.isfinite(tok_s) or tok_s <= 0:
        return "–"
    return f"{tok_s:,.0f} tok/s" if tok_s >= 100 else f"{tok_s:.1f} tok/s"


RATE_SOURCES = {
    "measured": "measured at load: a short calibration when the model first loaded, stored for the next start",
    "cached": "cached: measured on this machine by an earlier start or `tandem calibrate` (the date says when)",
    "calibrated": "calibrated: measured on this machine by `tandem calibrate`",
    "online": "online: measured from the requests this backend has served",
    "override": "override: set by hand (--rates or the Controls panel)",
    "default": "placeholder: a guess, not measured (measuring at load failed or was skipped); the "
               "router's scores are rough until this backend has served requests or is calibrated",
    "article": "article: the study's rates (Apple M2, Qwen2.5-0.5B)",
}


def rates_source_text(source: str) -> str:
    """What a `Rates.source` means, in a sentence."""
    return RATE_SOURCES.get(source, source)


def model_title(info) -> str:
    """The name to show for a model: its file name (what the user picked, e.g.
    'SmolLM2-135M-Instruct.Q4_1'), since GGUF `general.name` is often a training-run label
    ('Smollm2 135M 8k Lc100K Mix1 Ep2'); `general.name` when the file name says nothing."""
    stem = Path(info.path).stem if info.path else ""
    if not stem or stem.lower() in ("model", "ggml-model", "ggml-model-f16", "ggml-model-q4_0"):
        return info.name
    return stem



# The one way the app names a backend's concurrency cap: the user's *ceiling* (the cap box) and
# the *live cap* the engine admits at now (an adaptive cap moves between 1 and the ceiling).
CAP_HELP = ("Ceiling: the most requests you allow at once on this backend (the cap box). Live cap: how "
            "many the engine admits now; an adaptive cap starts low and moves up to the ceiling while "
            "requests wait, and down when a larger batch decodes slower or the KV cache is full.")


def live_cap_text(snap) -> str:
    """'live cap 4 of ceiling 16: more requests were waiting, so it tries more at once' / 'live cap
    8, fixed (ceiling 8)', from a `BackendSnapshot`: plain words (`cap_reason_text`); the engine's
    figures are `cap_reason_detail`."""
    ceiling = snap.cap_ceiling or snap.cap
    if not snap.cap_adaptive:
        return f"live cap {snap.cap}, fixed (ceiling {ceiling})"
    why = cap_reason_text(snap.cap_reason)
    return f"live cap {snap.cap} of ceiling {ceiling}" + (f": {why}" if why else "")


# The adaptive cap's reasons (engine/sched/limiter.py) by their shape, in plain words: what a
# class can follow. The engine's own sentence, with its tok/s figures, stays one hover away.
_CAP_REASONS = (
    (re.compile(r"^start$"), "where an adaptive cap starts"),
    (re.compile(r"^fixed$"), "fixed"),
    (re.compile(r"^set by the user$"), "set by the user"),
    (re.compile(r"waiting, but KV room for no more"), "requests wait, but the memory holds no more"),
    (re.compile(r"waiting at \d+ .*trying \d+"), "requests were waiting, so it tries more at once"),
    (re.compile(r"below .*checking again"), "the larger batch looked slower: checking again"),
    (re.compile(r"^decode fell to"), "the larger batch was slower, so it went back down"),
    (re.compile(r"up from"), "the larger batch was faster, so it stays"),
    (re.compile(r"^KV full"), "the memory was full, so it runs fewer at once"),
    (re.compile(r"^the load ran at most"), "fewer requests came, so it went back down"),
)


def cap_reason_text(reason: str) -> str:
    """Why the live cap last moved, in plain words ('decode 17 tok/s at batch 8, up from 0 at 4'
    reads 'the larger batch was faster, so it stays'); a reason of another shape as it is."""
    reason = (reason or "").strip()
    for shape, words in _CAP_REASONS:
        if shape.search(reason):
            return words
    return reason


def cap_reason_detail(snap) -> str:
    """The engine's own words for the live cap's last move, with its figures (a tooltip's)."""
    reason = (snap.cap_reason or "").strip()
    if not snap.cap_adaptive or reason in ("", "start", "fixed", "set by the user"):
        return CAP_HELP
    return f"The engine's reason: {reason}.\n\n{CAP_HELP}"


# Each policy in one sentence a class can follow; the engine's own description
# (`engine.routing.HELP`) is the detail one click away.
POLICY_SENTENCES = {
    "finish-first:pack": "Each request goes to the backend where it will finish first.",
    "finish-first": "Each request goes to the backend where it will finish first.",
    "seed-score": "Each request goes to the backend with the least queued work, priced at that backend's speed.",
    "predicted-finish": "Each request goes where a simulation of each queue says it finishes first.",
    "least-work": "Each request goes to the backend with the fewest tokens still to compute.",
    "round-robin": "The backends take turns: one request each.",
    "cache-aware": "Requests that start alike stay together on the backend that has their start cached.",
    "gpu-only": "Every request goes to the GPU.",
    "cpu-only": "Every request goes to the CPU.",
}


def policy_sentence(policy: str, backends: int, default: bool = False) -> str:
    """One sentence for `policy` on `backends` backends ("(the default)" added when it is)."""
    if backends <= 1 and not policy.startswith("only:"):
        text = "With one backend, every request goes to it."
    elif policy.startswith("only:"):
        text = f"Every request goes to {policy[len('only:'):]}."
    else:
        name = policy  # a policy with parameters ('cache-aware:cache_threshold=0.3') reads as its kind
        while name and name not in POLICY_SENTENCES:
            name = name.rpartition(":")[0]
        text = POLICY_SENTENCES.get(name, f"The {policy} policy.")
    return text[:-1] + " (the default)." if default else text


def token_tip(tokens: list, k: int) -> str:
    """Token `k` of a reply's stored token probabilities (`[text, logprob, [[alternative,
    logprob], ...]]` each) in words: its probability, then each alternative's; empty if none."""
    if not 0 <= k < len(tokens):
        return ""
    text, lp, top = tokens[k]
    lines = [f"{text!r}  p = {math.exp(lp):.3f}  (logprob {lp:.3f})"]
    lines += [f"   {alt!r}  {math.exp(alt_lp):.3f}" for alt, alt_lp in top]
    return "\n".join(lines)


def warm_eta(prefix_tokens: int, prefill_rates: list[float]) -> float:
    """Seconds warming `prefix_tokens` should take: every backend warms at once, the slowest last."""
    rates = [r for r in prefill_rates if r > 0]
    return prefix_tokens / min(rates) if rates and prefix_tokens else 0.0


def warm_left_text(eta_s: float, elapsed_s: float) -> str:
    """How long is left of a wait expected to take `eta_s` (0: unknown), `elapsed_s` into it."""
    if eta_s <= 0:
        return f"{elapsed_s:.0f} s so far"
    if elapsed_s < eta_s:
        return f"about {max(1, round(eta_s - elapsed_s))} s left"
    return f"{elapsed_s:.0f} s so far, {eta_s:.0f} s expected: the machine is busy"
