"""Conveyor's exception tree. Each class knows its HTTP status and OpenAI error type.

ConveyorError
├── InvalidRequest (400, invalid_request_error)      the client must change the request
│   └── ContextLengthExceeded (400)                   prompt + max_tokens > context window
├── IdempotencyConflict (409)                         same Idempotency-Key still running
├── ModelNotFound (404, model_not_found)
├── Overloaded (429, rate_limit_exceeded)             recoverable: retry after `retry_after_s`
├── NoLiveWorker (503, service_unavailable)           recoverable: retry after `retry_after_s`
├── GatewayDraining (503)                             recoverable: another gateway / later
├── DeadlineExceeded (504, timeout)                   the server-side deadline passed
├── EngineError (500, server_error)                   one request failed inside the engine
│   └── EngineDead (500)                              the engine is gone; the worker must exit
└── BackendUnavailable (503)                          Redis could not be reached
"""

from __future__ import annotations


class ConveyorError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_openai(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(ConveyorError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class WrongModelKind(InvalidRequest):
    """An embedding model asked to generate, or a generation model asked to embed."""

    code = "model_not_supported"


class IdempotencyConflict(ConveyorError):
    status = 409
    type = "invalid_request_error"
    code = "idempotency_key_in_use"


class ModelNotFound(ConveyorError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class RetryableError(ConveyorError):
    """The request may succeed later; responses carry ``Retry-After``."""

    def __init__(self, message: str, *, retry_after_s: int = 1, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = max(1, retry_after_s)


class Overloaded(RetryableError):
    status = 429
    type = "rate_limit_exceeded"
    code = "queue_full"


class NoLiveWorker(RetryableError):
    status = 503
    type = "service_unavailable"
    code = "no_live_worker"


class GatewayDraining(RetryableError):
    status = 503
    type = "service_unavailable"
    code = "shutting_down"


class BackendUnavailable(RetryableError):
    status = 503
    type = "service_unavailable"
    code = "backend_unavailable"


class DeadlineExceeded(ConveyorError):
    status = 504
    type = "timeout"
    code = "deadline_exceeded"


class EngineError(ConveyorError):
    status = 500
    type = "server_error"
    code = "engine_error"


class EngineDead(EngineError):
    code = "engine_dead"
