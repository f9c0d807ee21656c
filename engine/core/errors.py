"""Typed errors the engine raises; the HTTP layer maps each `kind` to a status code.

Every error a caller can cause is an `EngineError` with a message that says what was
wrong and what is allowed, so that the CLI, the GUI and the server can show it as is.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine reports to a caller."""

    kind = "server_error"
    param: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        if param is not None:
            self.param = param

    @property
    def message(self) -> str:
        return str(self.args[0])


class InvalidRequest(EngineError):
    """The request itself is malformed: bad sampling values, empty prompt, unknown backend."""

    kind = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """The prompt (plus at least one generated token) does not fit the backend's context."""

    kind = "exceed_context_size_error"

    def __init__(self, n_prompt_tokens: int, n_ctx: int, param: str = "prompt", at_least: bool = False):
        super().__init__(
            f"the prompt has {'at least ' if at_least else ''}{n_prompt_tokens} tokens but the context "
            f"holds {n_ctx} "
            f"(at most {n_ctx - 1} prompt tokens leave room for one generated token)",
            param=param,
        )
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx


class ModelLoadError(EngineError):
    """A model spec or file that cannot be used: missing, not GGUF, or refused by llama.cpp."""

    kind = "model_load_error"


class BackendUnavailable(EngineError):
    """The backend is shut down or unhealthy and accepts no work."""

    kind = "unavailable_error"


class RestartInProgress(EngineError):
    """A restart of this backend is already running; this one was not started."""

    kind = "conflict_error"


class QueueFull(EngineError):
    """The backend's waiting queue is at its limit; try again later (`retry_after_s`: about
    when, the router's estimate of the queue's wait; None where it has none)."""

    kind = "queue_full_error"
    retry_after_s: float | None = None


class RequestFailed(EngineError):
    """The backend failed while running the request (e.g. a decode error)."""

    kind = "server_error"
