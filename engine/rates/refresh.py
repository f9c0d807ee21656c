"""Online refresh: `OnlineRefresh` keeps a running engine's rates current from the steps its
backends report (EWMA), leaving overridden rates alone."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from engine.core.events import EventBus, StepDone
from engine.core.snapshot import Rates


class _Rated(Protocol):
    @property
    def rates(self) -> Rates: ...


class RatedEngine(Protocol):
    """What the refresh needs of an engine (`engine.engine.Engine`, which sits above this layer)."""

    @property
    def bus(self) -> EventBus: ...
    @property
    def backends(self) -> Mapping[str, _Rated]: ...

    def set_rates(self, name: str, rates: Rates) -> None: ...

# ---- online refresh ----


@dataclass
class _Track:
    base: Rates
    set_last: Rates | None = None
    factor: float = 1.0  # observed / predicted decode step time, EWMA
    prefill: float = 0.0  # observed prefill tok/s, EWMA (0: none seen yet)
    last: StepDone | None = None
    seen: int = 0


class OnlineRefresh:
    """Keeps an engine's rates current from the steps its backends report (EWMA).

    Decode: each decode-only step's cycle time (since the backend's previous step ended, as in
    calibration) over the step time the base rates predict for that batch gives a correction
    factor; its EWMA scales α, β and the decode rate. Prefill: prompt-only steps of at least
    `min_prefill` tokens update an EWMA of prefill tok/s. Every `every` steps the backend gets
    `Rates(..., source="online")`. A backend whose rates someone else set takes them as its
    new base; rates with `source="override"` are never touched.

    Thread contract: `_on_step` runs on each backend's worker thread and touches only that
    backend's `_Track`, so no lock is needed; `attach`/`detach`/`reset` from any thread
    between runs.
    """

    def __init__(self, engine: RatedEngine, weight: float = 0.1, every: int = 8, min_prefill: int = 32) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.engine = engine
        self.weight = weight
        self.every = max(1, every)
        self.min_prefill = min_prefill
        self._tracks: dict[str, _Track] = {}
        self._unsubscribe: Callable[[], None] | None = None

    def attach(self) -> OnlineRefresh:
        self.reset()
        if self._unsubscribe is None:
            self._unsubscribe = self.engine.bus.subscribe(self._on_step, (StepDone,))
        return self

    def detach(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    @property
    def attached(self) -> bool:
        """Whether it follows the engine's steps now (between `attach` and `detach`)."""
        return self._unsubscribe is not None

    def reset(self, rates: dict[str, Rates] | None = None) -> None:
        """Start over from `rates` (default: each backend's current rates), applied now."""
        for name, b in self.engine.backends.items():
            base = (rates or {}).get(name) or b.rates
            if rates and name in rates:
                self.engine.set_rates(name, base)
            self._tracks[name] = _Track(base=base, set_last=b.rates)

    def _on_step(self, ev: StepDone) -> None:
        track = self._tracks.get(ev.backend)
        backend = self.engine.backends.get(ev.backend)
        if track is None or backend is None:
            return
        prev, track.last = track.last, ev
        current = backend.rates
        if current.source == "override":
            return
        if current is not track.set_last:  # set from elsewhere: a new base
            track.base, track.set_last, track.factor, track.prefill = current, current, 1.0, 0.0
        w = self.weight
        if ev.n_decode and not ev.n_prefill and prev is not None:
            predicted = track.base.step_s(ev.n_decode)
            cycle = ev.time - prev.time
            if predicted > 0 and math.isfinite(predicted) and cycle > 0:
                track.factor += w * (cycle / predicted - track.factor)
        elif not ev.n_decode and ev.n_prefill >= self.min_prefill and ev.seconds > 0:
            observed = ev.n_prefill / ev.seconds
            track.prefill = observed if not track.prefill else track.prefill + w * (observed - track.prefill)
        track.seen += 1
        if track.seen % self.every == 0:
            track.set_last = self.rates_of(track)
            self.engine.set_rates(ev.backend, track.set_last)

    @staticmethod
    def rates_of(track: _Track) -> Rates:
        f = track.factor
        b = track.base
        alpha, beta, table = b.scaled(f)
        return replace(b, prefill_tok_s=track.prefill or b.prefill_tok_s, decode_tok_s=b.decode_tok_s / f,
                       step_alpha_s=alpha, step_beta_s=beta, step_table=table, source="online")
