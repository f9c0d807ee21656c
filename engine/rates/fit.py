"""The pure side of calibration: what one measurement holds (`Calibration`) and the fits that
turn measured step times into the router's and the simulator's step model
(`step(b) = α + β·b (+ γ·b·c + δ·b·n_kv)`, and the step table). No clock, no backend.
How each term is measured and why: docs/design/rates.md."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

from engine.core.snapshot import Rates

OWN_TOKENS = 4  # tokens of its own each decode-measuring request adds to the shared prompt

@dataclass(frozen=True)
class Calibration:
    """One backend's measured speeds (see the module docstring for how)."""

    backend: str
    device: str
    config_key: str
    cap: int
    threads: int
    prompt_tokens: int
    gen_tokens: int
    prefill_tok_s: float
    prefill_runs: tuple[float, ...]
    step_s: dict[int, float]  # batch -> median step cycle, seconds
    decode_only_s: dict[int, float]  # batch -> median llama_decode time alone, seconds
    step_alpha_s: float
    step_beta_s: float
    decode_tok_s: float
    seconds: float  # how long calibrating took
    notes: tuple[str, ...] = ()
    # The context term (0 / empty: not measured): the KV cells each step at `step_s` held; the
    # short context's steps and their cells; the fit over both (see the module docstring).
    step_cells: dict[int, float] = field(default_factory=dict)
    context_tokens: int = 0
    context_step_s: dict[int, float] = field(default_factory=dict)
    context_cells: dict[int, float] = field(default_factory=dict)
    context_alpha_s: float = 0.0
    context_beta_s: float = 0.0
    step_gamma_s: float = 0.0
    admit_s: float = 0.0  # host cost per request (0: not measured)
    admit_runs: tuple[float, ...] = ()
    # The masked scan (0 / empty: not measured): the pool's cells in use at each timed step
    # (median over the steps), the unshared pass (its batch, step and pool) and δ.
    step_kv: dict[int, float] = field(default_factory=dict)
    context_kv: dict[int, float] = field(default_factory=dict)
    scan_batch: int = 0
    scan_step_s: float = 0.0
    scan_kv: float = 0.0
    step_delta_s: float = 0.0
    measured_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    def rates(self) -> Rates:
        cells = step_table(self.step_cells) if self.step_gamma_s else ()
        kv = step_table(self.step_kv) if self.step_delta_s else ()
        return Rates(prefill_tok_s=self.prefill_tok_s, decode_tok_s=self.decode_tok_s,
                     step_alpha_s=self.step_alpha_s, step_beta_s=self.step_beta_s,
                     step_table=step_table(self.step_s), source="calibrated", measured_at=self.measured_at,
                     step_gamma_s=self.step_gamma_s, step_cells=cells, step_delta_s=self.step_delta_s,
                     step_kv=kv)

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("step_s", "decode_only_s", "step_cells", "context_step_s", "context_cells", "step_kv",
                  "context_kv"):
            d[k] = {str(b): s for b, s in getattr(self, k).items()}
        d["rates"] = {k: v for k, v in asdict(self.rates()).items() if k not in ("source", "measured_at")}
        return d



def step_table(step_s: dict[int, float]) -> tuple[float, ...]:
    """Measured step times at batch 1..max as a table; batches not measured are interpolated
    linearly between their measured neighbours. Empty without a measurement at batch 1."""
    if 1 not in step_s:
        return ()
    points = sorted(step_s.items())
    table = []
    for b in range(1, points[-1][0] + 1):
        lo = max((p for p in points if p[0] <= b), key=lambda p: p[0])
        hi = min((p for p in points if p[0] >= b), key=lambda p: p[0])
        t = lo[1] if hi[0] == lo[0] else lo[1] + (hi[1] - lo[1]) * (b - lo[0]) / (hi[0] - lo[0])
        table.append(t)
    return tuple(table)


def fit_step_model(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares `step(b) = alpha + beta*b`, both kept >= 0. One point: alpha 0, beta = t/b."""
    if not points:
        raise ValueError("no step times to fit")
    bs = sorted(points)
    if len(bs) == 1:
        return 0.0, points[bs[0]] / bs[0]
    n = len(bs)
    mb = sum(bs) / n
    mt = sum(points[b] for b in bs) / n
    sbb = sum((b - mb) ** 2 for b in bs)
    beta = sum((b - mb) * (points[b] - mt) for b in bs) / sbb
    alpha = mt - beta * mb
    if beta < 0:  # noise on a flat curve: a constant step time
        return mt, 0.0
    if alpha < 0:  # through the origin instead
        return 0.0, sum(b * points[b] for b in bs) / sum(b * b for b in bs)
    return alpha, beta


def fit_context_model(points: Sequence[tuple[int, float, float]]) -> tuple[float, float, float]:
    """Least-squares `step(b, cells) = alpha + beta*b + gamma*b*cells` over (b, cells, seconds)
    points. gamma is kept >= 0 (noise that makes a longer context faster is no context term:
    then `fit_step_model` over the points, gamma 0); a negative alpha or beta is refitted at 0."""
    import numpy as np

    if len(points) < 3:
        raise ValueError("the context model needs at least 3 steps")
    a = np.array([[1.0, b, b * c] for b, c, _ in points])
    t = np.array([s for _, _, s in points])
    if np.linalg.matrix_rank(a) == 3:
        (alpha, beta, gamma), *_ = np.linalg.lstsq(a, t, rcond=None)
        if gamma > 0 and (alpha < 0 or beta < 0):  # refit with the negative one at 0
            keep = [1, 2] if alpha < 0 else [0, 2]
            sub, *_ = np.linalg.lstsq(a[:, keep], t, rcond=None)
            full = dict(zip(keep, (float(v) for v in sub)))
            alpha, beta, gamma = full.get(0, 0.0), full.get(1, 0.0), full[2]
        if gamma > 0 and alpha >= 0 and beta >= 0:
            return float(alpha), float(beta), float(gamma)
    by_b: dict[int, list[float]] = {}
    for b, _, s in points:
        by_b.setdefault(b, []).append(s)
    alpha, beta = fit_step_model({b: statistics.fmean(v) for b, v in by_b.items()})
    return alpha, beta, 0.0


def fit_scan_term(pairs: Sequence[tuple[int, float, float, float, float]]) -> float:
    """δ of the masked scan from steps of b rows whose own cells are equal, in two pools:
    `(b, kv_shared, step_shared, kv_unshared, step_unshared)` each. The step difference is
    δ·b·(kv_unshared − kv_shared); least squares through the origin over the pairs (one pair:
    the ratio). Kept >= 0: noise that makes the larger pool faster is no scan cost (0)."""
    xs = [b * (ku - ks) for b, ks, _, ku, _ in pairs]
    ys = [tu - ts for _, _, ts, _, tu in pairs]
    sxx = sum(x * x for x in xs)
    if not pairs or sxx <= 0:
        raise ValueError("the masked scan needs a pair of steps in pools of different sizes")
    return max(sum(x * y for x, y in zip(xs, ys)) / sxx, 0.0)


def fit_step_terms(points: Sequence[tuple[int, float, float, float]],
                   pairs: Sequence[tuple[int, float, float, float, float]] = (),
                   pool_attention: bool = False) -> tuple[float, float, float, float]:
    """`step(b, cells, kv) = alpha + beta*b + gamma*b*cells + delta*b*kv`: delta from the
    unshared `pairs` (`fit_scan_term`; none: 0), then alpha, beta, gamma by `fit_context_model`
    over the (b, cells, kv, seconds) `points` less delta*b*kv.

    `pool_attention` (a backend without flash attention): attention is a matrix product over
    every cell of the pool, masked or not, so a row's own cells cost nothing apart: gamma is 0
    and alpha, beta, delta are fitted together over every step, the unshared ones included."""
    if pool_attention:
        steps = [(b, kv, t) for b, _, kv, t in points]
        steps += [(b, kv, t) for b, ks, ts, ku, tu in pairs for kv, t in ((ks, ts), (ku, tu))]
        alpha, beta, delta = fit_context_model(steps)  # the same form, the pool for the cells
        return alpha, beta, 0.0, delta
    delta = fit_scan_term(pairs) if pairs else 0.0
    alpha, beta, gamma = fit_context_model([(b, c, t - delta * b * kv) for b, c, kv, t in points])
    return alpha, beta, gamma, delta


def calibration_cells(prompt: int, gen_tokens: int) -> float:
    """The cells each row of a median calibration step sees: the shared prompt, the sequence's
    own tokens and half of what it generates (steps run from 1 to `gen_tokens` - 1)."""
    return prompt + OWN_TOKENS + gen_tokens / 2
