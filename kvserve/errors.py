"""Typed errors. Every error a user can cause is one of these, with a message that names the cause.

The server maps each class to an HTTP status (see ``http_status``); nothing here imports anything.
"""

from __future__ import annotations


class KVServeError(Exception):
    """Base class of every error kvserve raises on purpose."""

    http_status: int = 500
    code: str | None = None
    error_type: str = "internal_error"


class InvalidRequest(KVServeError):
    """The request is malformed or asks for something impossible. ``param`` names the offending field."""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class ConfigError(KVServeError):
    """A configuration value is out of range, inconsistent or unknown (a CLI flag, an ``LLM(...)`` keyword or a
    config field). ``param`` names the field."""

    error_type = "config_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidSamplingParams(InvalidRequest):
    """A sampling parameter is out of range (negative temperature, top_p outside (0, 1], ...)."""


class EmptyPrompt(InvalidRequest):
    def __init__(self, message: str = "the prompt is empty: at least one token is required") -> None:
        super().__init__(message, param="prompt")


class ContextLengthExceeded(InvalidRequest):
    """Prompt (plus the requested output) does not fit in the model's context."""

    code = "context_length_exceeded"

    def __init__(self, message: str, param: str | None = "prompt") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class RequestTooLarge(InvalidRequest):
    """The request body is larger than the server accepts (--max-request-body-bytes)."""

    http_status = 413
    code = "request_too_large"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_too_large")


class CapacityError(KVServeError):
    """The engine cannot take the request now (queue full); the client may retry."""

    http_status = 429
    error_type = "rate_limit_error"
    code = "too_many_requests"


class EngineDeadError(KVServeError):
    """The background engine loop has died; no request can be served."""

    http_status = 503
    error_type = "service_unavailable"
    code = "engine_dead"


class Unauthorized(KVServeError):
    """A server with an API key got a request without it, or with another one."""

    http_status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class ServerShuttingDown(KVServeError):
    """The server is draining after SIGTERM and takes no new requests."""

    http_status = 503
    error_type = "service_unavailable"
    code = "server_shutting_down"


class NoHealthyReplica(KVServeError):
    """The gateway has no healthy replica for the request's model; the client may retry later."""

    http_status = 503
    error_type = "service_unavailable"
    code = "no_healthy_replica"


class UpstreamTimeout(KVServeError):
    """A replica took longer than the gateway's request timeout to answer: slow, not down (it is not taken out,
    and the request is not sent again elsewhere, where it would run twice)."""

    http_status = 504
    error_type = "gateway_timeout"
    code = "upstream_timeout"


class BadUpstreamResponse(KVServeError):
    """A replica answered the gateway with something that is not an OpenAI answer."""

    http_status = 502
    error_type = "bad_gateway"
    code = "bad_upstream_response"


class ModelNotFound(KVServeError):
    """The model path or served model name does not exist."""

    http_status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class PreviousResponseNotFound(InvalidRequest):
    """A Responses API request continues a response that is not stored (as OpenAI answers it: a 400)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Previous response with id '{response_id}' not found.", param="previous_response_id",
                         code="previous_response_not_found")


class ResponseNotFound(KVServeError):
    """No stored response has the id a ``/v1/responses/{id}`` route names (never stored, dropped, or deleted)."""

    http_status = 404
    error_type = "invalid_request_error"
    code = "response_not_found"
    param = "response_id"


class ModelLoadError(KVServeError):
    """A model file exists but cannot be loaded (truncated GGUF, missing tensor, unsupported type)."""

    error_type = "model_load_error"


class UnsupportedModel(ModelLoadError):
    """The architecture or tensor type is one kvserve does not implement."""


class ModelPullError(KVServeError):
    """Downloading or assembling a known model failed (pip failed, a part is missing, the hash differs)."""

    error_type = "model_pull_error"


class StorageError(KVServeError):
    """A KV storage tier failed (connection lost, corrupt entry). Callers degrade to a cache miss."""

    error_type = "storage_error"
