"""Conveyor's exception tree. Each class knows its HTTP status and OpenAI error type.

ConveyorError
├── InvalidRequest (400, invalid_request_error)      the client must change the request
│   ├── ContextLengthExceeded (400)                   prompt + max_tokens > context window
│   ├── UnsupportedParameter (400)                    a known OpenAI field this server cannot honour
│   ├── RequestTooLarge (413)                         the request body is over the size limit
│   ├── BodyReadTimeout (408)                         the request body took too long to arrive
│   ├── ChatTemplateError (400)                       the model's chat template refuses the messages
│   ├── ImageFetchError (400, invalid_image_url)      an image URL not allowed or not fetchable
│   ├── InvalidImage (400, invalid_image)             bytes that are not an image Conveyor takes
│   └── LoraLoadFailed (400, adapter_load_failed)  every worker refused a LoRA adapter (why)
├── InvalidApiKey (401, invalid_api_key)              no, malformed, unknown, revoked or expired key
├── PermissionDenied (403)                            the key lacks the scope the endpoint needs
│   └── HostNotAllowed (403)                          auth off and a Host that is not loopback
├── IdempotencyConflict (409)                         same Idempotency-Key still running
├── ApiKeyRevoked (409)                               an admin change to a key that is revoked
├── LoraConflict (409)                             a LoRA name registered with another spec
├── ModelNotFound (404, model_not_found)
├── ApiKeyNotFound (404)                              /admin/keys/{id} names no key
├── LoraNotFound (404)                             no LoRA adapter is registered by that name
├── WorkerNotFound (404)                              /admin/workers/{id} names no live worker
├── Overloaded (429, rate_limit_exceeded)             recoverable: retry after `retry_after_s`
├── KeyRateLimited (429, rate_limit_exceeded)         the key's RPM/TPM/concurrency: retry later
├── QuotaExceeded (429, insufficient_quota)           the key's budget for the period is spent
├── NoLiveWorker (503, service_unavailable)           recoverable: retry after `retry_after_s`
├── LoraLoadTimeout (503)                          no worker finished loading an adapter in time
├── GatewayDraining (503)                             recoverable: another gateway / later
├── ImageStoreFull (503)                              the stored images' byte budget is spent
├── DeadlineExceeded (504, timeout)                   the server-side deadline passed
│   └── WorkerCommandTimeout (504)                    a worker did not answer an admin command
├── NotSupportedByEngine (501)                        the worker's engine cannot do that (why)
├── WorkerCommandFailed (500)                         a worker tried an admin command and gave up
├── EngineError (500, server_error)                   one request failed inside the engine
│   ├── EngineDead (500)                              the engine is gone; the worker must exit
│   ├── PoisonJob (500)                               failed on max_deliveries runs: dead-lettered
│   └── MigrationRefused (500)                        a job that stopped mid-stream cannot resume
├── MediaMissing (500)                                a job's stored image or embedding expired
├── RemoteError (any)                                 an error a worker reported for one sequence
├── BackendUnavailable (503)                          Redis could not be reached
└── DatabaseUnavailable (503)                         the SQL database could not be reached

Not a ConveyorError (never shown to a client as such):
ProtocolError (ValueError)                            a message that cannot be decoded
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.protocol import ErrorEvent


class ConveyorError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers: dict[str, str] = {}
        """Extra response headers (a limited key's ``x-ratelimit-*``)."""

    def to_openai(self) -> dict[str, dict[str, str | None]]:
        return openai_error(self.message, self.type, self.param, self.code)


def openai_error(
    message: str, type_: str, param: str | None, code: str | None
) -> dict[str, dict[str, str | None]]:
    """OpenAI's error envelope, the one builder of it: HTTP error answers (the gateway's
    funnel) and errors inside a stream (SSE ``data:``) alike."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class InvalidRequest(ConveyorError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class UnsupportedParameter(InvalidRequest):
    """An OpenAI field (e.g. ``tools``) whose meaning this server cannot honour: refused, not
    ignored, so a client never mistakes a plain answer for the feature it asked for."""

    code = "unsupported_parameter"


class RequestTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"


class BodyReadTimeout(InvalidRequest):
    status = 408
    code = "request_timeout"


class WrongModelKind(InvalidRequest):
    """An embedding model asked to generate, or a generation model asked to embed."""

    code = "model_not_supported"


class ChatTemplateError(InvalidRequest):
    """The messages cannot be rendered by this model's chat template."""


class ImageFetchError(InvalidRequest):
    """The URL is not allowed or its bytes could not be fetched."""

    code = "invalid_image_url"


class InvalidImage(InvalidRequest):
    """The bytes are not an image Conveyor accepts."""

    code = "invalid_image"


class InvalidApiKey(ConveyorError):
    """Authentication failed. The message shows a masked key only, never the secret."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(ConveyorError):
    status = 403
    type = "invalid_request_error"
    code = "insufficient_permissions"


class HostNotAllowed(PermissionDenied):
    code = "host_not_allowed"


class ApiKeyNotFound(ConveyorError):
    status = 404
    type = "invalid_request_error"
    code = "api_key_not_found"


class ApiKeyRevoked(ConveyorError):
    status = 409
    type = "invalid_request_error"
    code = "api_key_revoked"


class LoraLoadFailed(InvalidRequest):
    """Every live worker of the base model refused the adapter (bad path, rank, base...):
    the message carries their reasons; nothing stays registered."""

    code = "adapter_load_failed"


class LoraConflict(ConveyorError):
    status = 409
    type = "invalid_request_error"
    code = "adapter_conflict"


class LoraNotFound(ConveyorError):
    status = 404
    type = "invalid_request_error"
    code = "adapter_not_found"


class WorkerNotFound(ConveyorError):
    status = 404
    type = "invalid_request_error"
    code = "worker_not_found"


class NotSupportedByEngine(ConveyorError):
    """An admin command the worker's engine cannot carry out (never faked)."""

    status = 501
    type = "server_error"
    code = "not_supported"


class WorkerCommandFailed(ConveyorError):
    status = 500
    type = "server_error"
    code = "worker_command_failed"


class IdempotencyConflict(ConveyorError):
    status = 409
    type = "invalid_request_error"
    code = "idempotency_key_in_use"


class ModelNotFound(ConveyorError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class ResponseNotFound(ConveyorError):
    """A stored response that does not exist, or belongs to another key."""

    status = 404
    type = "invalid_request_error"


class RequestNotFound(ConveyorError):
    status = 404
    type = "invalid_request_error"
    code = "request_not_found"


class RequestCancelled(ConveyorError):
    """``POST /v1/requests/{id}/cancel`` ended the request (its stream gets this last)."""

    status = 409
    type = "invalid_request_error"
    code = "request_cancelled"


class StreamNotFound(ConveyorError):
    """No resumable stream with this id (never one, another key's, or its log expired)."""

    status = 404
    type = "invalid_request_error"
    code = "stream_not_found"


class RetryableError(ConveyorError):
    """The request may succeed later; responses carry ``Retry-After``."""

    def __init__(self, message: str, *, retry_after_s: int = 1, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after_s = max(1, retry_after_s)


class Overloaded(RetryableError):
    status = 429
    type = "rate_limit_exceeded"
    code = "queue_full"


class KeyRateLimited(RetryableError):
    """Over the API key's requests/tokens per minute or concurrency (OpenAI's shape: the
    type names what ran out, the code is ``rate_limit_exceeded``)."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(
        self,
        message: str,
        *,
        limit: str = "requests",
        retry_after_s: int = 1,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s, param=param)
        self.type = limit
        self.headers = dict(headers or {})


class QuotaExceeded(RetryableError):
    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: int = 1,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s, param=param)
        self.headers = dict(headers or {})


class NoLiveWorker(RetryableError):
    status = 503
    type = "service_unavailable"
    code = "no_live_worker"


class LoraLoadTimeout(RetryableError):
    """No live worker reported an adapter loaded (or failed) in time: it was rolled back."""

    status = 503
    type = "service_unavailable"
    code = "adapter_load_timeout"


class GatewayDraining(RetryableError):
    status = 503
    type = "service_unavailable"
    code = "shutting_down"


class ImageStoreFull(RetryableError):
    """Storing a request's images would pass ``CONVEYOR_IMAGE_STORE_MAX_BYTES``."""

    status = 503
    type = "service_unavailable"
    code = "image_store_full"


class BackendUnavailable(RetryableError):
    status = 503
    type = "service_unavailable"
    code = "backend_unavailable"


class RepliesLost(BackendUnavailable):
    """Redis lost reply writes it had acknowledged, as a fail-over to a replica that lagged
    can: events of a sequence never reached the gateway (a seq gap), or a new run resumed
    before events the client already has. The text so far has a hole or cannot be
    continued, so the request ends with this error rather than passing it on."""

    code = "replies_lost"


class DatabaseUnavailable(RetryableError):
    status = 503
    type = "service_unavailable"
    code = "database_unavailable"


class DeadlineExceeded(ConveyorError):
    status = 504
    type = "timeout"
    code = "deadline_exceeded"


class WorkerCommandTimeout(DeadlineExceeded):
    code = "worker_command_timeout"


class EngineError(ConveyorError):
    status = 500
    type = "server_error"
    code = "engine_error"


class EngineDead(EngineError):
    code = "engine_dead"


class PoisonJob(EngineError):
    """The job was started ``max_deliveries`` times and went to the dead-letter stream."""

    code = "job_failed_repeatedly"


class MigrationRefused(EngineError):
    """The job's worker stopped mid-stream and the job may not continue elsewhere."""

    code = "migration_failed"


class MediaMissing(ConveyorError):
    """An image or embedding a job refers to is gone (expired or never stored)."""

    status = 500
    type = "server_error"


class RemoteError(ConveyorError):
    """An error a worker reported for one sequence: status, type and code as it sent them."""

    def __init__(self, event: ErrorEvent) -> None:
        super().__init__(event.message, param=event.param)
        self.status = event.status
        self.type = event.type
        self.code = event.code


class ProtocolError(ValueError):
    """A message could not be decoded (wrong version or malformed payload)."""
