"""`FinishRules`: what a sampled token does to its request, and the text it streams.

The rules of docs/design/sched.md's step 5: end of generation (unless `ignore_eos`), a stop
string, `stop_after`, `max_tokens` (clamped to the context) and the context's end. The
scheduler (engine/sched/scheduler.py) asks `on_token` and finishes the sequence with the status
it answers; this object never touches KV or the queues. Text comes from an injected
`piece(token)`, so the rules run without a model.

Thread contract: none; the scheduler's owner calls it from one thread, except `emit_pending`,
which the owner may call while the device runs a step (the same thread, between two calls)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.core.request import RequestStatus, TokenLogprob
from engine.sched.sequence import SeqState


class FinishRules:
    """Finish rules and text delivery of running sequences (scheduler's thread)."""

    def __init__(self, piece: Callable[[int], bytes], is_eog: Callable[[int], bool], n_ctx_seq: int,
                 overlap: bool) -> None:
        self.piece = piece
        self.is_eog = is_eog
        self.n_ctx_seq = n_ctx_seq
        self.overlap = overlap  # text of requests without stop strings waits for `emit_pending`
        # (sequence, token) whose text is not sent yet; mutated in place only (the scheduler
        # shows the same list as `Scheduler.pending_text`).
        self.pending_text: list[tuple[SeqState, int]] = []

    def on_token(self, s: SeqState, tok: int, now: float) -> RequestStatus | None:
        """Append `tok` to `s`, stream its text; the status `s` ends with, or None if it goes on."""
        s.tokens.append(tok)
        s.generated += 1
        if s.generated == 1:
            s.t_first = now
        else:
            s.itl_sum += now - s.t_last
        s.t_last = now
        if (not s.sp.ignore_eos and self.is_eog(tok)) or s.generated == s.req.stop_after:
            return RequestStatus.FINISHED_STOPPED
        if self.overlap and not s.sp.stop:  # no stop string can end it: its text can wait
            self.pending_text.append((s, tok))
        elif self.emit(s, tok):
            return RequestStatus.FINISHED_STOPPED
        if s.generated >= s.max_new or s.n_past + 1 >= self.n_ctx_seq:
            return RequestStatus.FINISHED_LENGTH
        return None

    def emit(self, s: SeqState, tok: int) -> bool:
        """Push a token's text to the request's stream; True if a stop string ended it."""
        delta = s.stream.push(self.piece(tok))
        if delta and s.handle is not None:
            s.handle._deliver_text(delta)
        return s.stream.stopped

    def emit_pending(self) -> None:
        """Text for the tokens `on_token` left pending (overlap mode)."""
        pending = self.pending_text[:]
        self.pending_text.clear()
        for s, tok in pending:
            if s.status == RequestStatus.RUNNING:
                self.emit(s, tok)

    def flush(self, s: SeqState, status: RequestStatus) -> None:
        """`s` ends with `status`: send its pending text, and what its stream held back (a
        partial stop string, a split character) when it ended without a stop string."""
        if self.pending_text:
            mine = [p for p in self.pending_text if p[0] is s]
            if mine:
                self.pending_text[:] = [p for p in self.pending_text if p[0] is not s]
                for _, tok in mine:
                    self.emit(s, tok)
        if status == RequestStatus.FINISHED_LENGTH or (status == RequestStatus.FINISHED_STOPPED
                                                       and not s.stream.stopped):
            rest = s.stream.flush()
            if rest and s.handle is not None:
                s.handle._deliver_text(rest)

    def record_logprobs(self, rows: Sequence[SeqState], sampled: Sequence[int | None],
                        logprobs: dict[int, TokenLogprob]) -> None:
        """Keep each row's logprob with its sequence, once its token was applied; an end
        token that ended the request has no text and gets none (OpenAI lists none)."""
        for i, lp in logprobs.items():
            s, tok = rows[i], sampled[i]
            if tok is None or s.logprobs is None or len(s.logprobs) >= s.generated:
                continue
            if not s.sp.ignore_eos and self.is_eog(tok):
                continue
            s.logprobs.append(lp)
