"""A remote engine's rates refined online from the requests it finishes (EWMA).

Calibration (engine/rates/measure.py `calibrate_remote`) or a default gives the base rates;
each finished request's ITL, against the step time the base rates predict at the batch it ran
in, scales them (`source="online"`); its prefill speed counts when it ran alone. Rates set as
`source="override"` are left alone. The engine's steps are not visible, so nothing finer can be.

Thread contract: the loop thread observes; `rates` and the observed speeds are read from any
thread (single assignments).
"""

from __future__ import annotations

from dataclasses import replace

from engine.core.request import FinishRecord
from engine.core.snapshot import Rates

WEIGHT = 0.2
MIN_PREFILL_TOKENS = 32  # fewer new prompt tokens say more about latency than about prefill speed


class OnlineRates:
    """The rates the router prices the engine with, and the speeds observed there."""

    def __init__(self, base: Rates) -> None:
        self.rates = self._base = base
        self._factor = 1.0  # observed / predicted step time
        self.prefill_tok_s = self.decode_tok_s = 0.0  # observed, recent

    def set(self, rates: Rates) -> None:
        """New base rates (calibration, an override): the online refinement starts over."""
        self.rates = self._base = rates
        self._factor = 1.0

    def reset_observed(self) -> None:
        self.prefill_tok_s = self.decode_tok_s = 0.0

    def observe(self, record: FinishRecord, batch: int) -> None:
        """One finished request that ran among `batch` requests at the engine."""
        if record.itl_s:
            self.decode_tok_s = _ewma(self.decode_tok_s, batch / record.itl_s)
        new_prompt = record.prompt_tokens - record.cached_tokens
        if record.ttft_s and new_prompt >= MIN_PREFILL_TOKENS and batch == 1:
            self.prefill_tok_s = _ewma(self.prefill_tok_s, new_prompt / max(record.ttft_s - record.queue_s, 1e-6))
        if self.rates.source == "override" or not record.itl_s:
            return
        base = self._base
        predicted = base.step_s(batch)
        if predicted > 0:
            self._factor += WEIGHT * (record.itl_s / predicted - self._factor)
            alpha, beta, table = base.scaled(self._factor)
            self.rates = replace(base, prefill_tok_s=self.prefill_tok_s or base.prefill_tok_s,
                                 decode_tok_s=base.decode_tok_s / self._factor, step_alpha_s=alpha,
                                 step_beta_s=beta, step_table=table, source="online")


def _ewma(old: float, new: float) -> float:
    return new if not old else old + WEIGHT * (new - old)
