"""Typed errors a user can cause. The server maps each to one HTTP status (server/errors.py)."""


class LLMServeError(Exception):
    """Base class for errors with a message meant for the user."""

    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(LLMServeError):
    """A parameter is out of range or of the wrong type."""

    status_code = 400
    error_type = "invalid_request_error"


class PromptTooLongError(InvalidRequestError):
    """prompt (+ max_tokens) exceeds the model's context length."""


class ModelLoadError(LLMServeError):
    """A checkpoint could not be read: names the file and the problem."""

    error_type = "model_load_error"


class EngineOverloadedError(LLMServeError):
    """The waiting queue is full; retry later."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message, code="overloaded")
        self.retry_after_s = retry_after_s


class StoreUnavailableError(LLMServeError):
    """A shared store (Redis) that must answer could not: the breaker is open, or the call failed."""

    status_code = 503
    error_type = "service_unavailable"


class EngineDeadError(LLMServeError):
    status_code = 503
    error_type = "service_unavailable"
