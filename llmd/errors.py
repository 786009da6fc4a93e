"""Typed errors that tell the user what to do.

    LlmdError                 base; .status is the HTTP status, .code a stable machine name
    ├── BadRequest            400: a field is wrong (names the field in .param)
    │   ├── ContextOverflow   400: prompt (+ max_tokens) does not fit the context; gives both numbers
    │   └── GrammarError      400: response_format could not be turned into a grammar
    ├── ContextGrow           (never answered) the worker asks the scheduler for a larger context
    ├── Unauthorized          401: a control route without the daemon's token
    ├── Forbidden             403: Host or Origin not allowed (DNS rebinding guard)
    ├── ModelNotFound         404: no registered model by that name
    ├── RouteNotFound         404: no such route (answered in the caller's API shape)
    ├── NotFound              404: a stored response asked for by id is not there
    ├── PayloadTooLarge       413: request body over the bound
    ├── Overloaded            503: queue full; .retry_after seconds
    ├── ModelUnavailable      503: the model's worker kept crashing; not started until asked for
    ├── ClientGone            499: the client hung up before a non-streamed reply was done
    ├── EngineCrashed         500: the worker process died during the request
    └── EngineError           500: the engine failed for another reason

The HTTP layer maps them to each API's error shape; the CLI to a one-line message and exit 1.
Errors cross the worker pipe as (code, message, param) and are rebuilt with `from_wire`.
"""

from __future__ import annotations


class LlmdError(Exception):
    status = 500
    code = "internal_error"
    type = "server_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_wire(self) -> tuple[str, str, str | None]:
        return (self.code, self.message, self.param)


class BadRequest(LlmdError):
    status = 400
    code = "invalid_request"
    type = "invalid_request_error"


class ContextOverflow(BadRequest):
    code = "context_length_exceeded"


class ContextGrow(LlmdError):
    """Inside llmd only (worker to scheduler): the prompt needs a larger context than the slot's, which
    the model may grow to (memory.starting_ctx); the scheduler loads it again and resubmits, or
    resubmits with growth refused, when the request then fails or fits as before."""

    code = "context_grow"

    def __init__(self, message: str, param: str | None = None, needed: int = 0) -> None:
        super().__init__(message, param)
        self.needed = needed

    def to_wire(self) -> tuple[str, str, str | None]:
        return (self.code, self.message, str(self.needed))  # the param field carries the tokens needed


class GrammarError(BadRequest):
    code = "invalid_response_format"


class Unauthorized(LlmdError):
    status = 401
    code = "unauthorized"
    type = "authentication_error"


class Forbidden(LlmdError):
    status = 403
    code = "forbidden"
    type = "permission_error"


class ModelNotFound(LlmdError):
    status = 404
    code = "model_not_found"
    type = "invalid_request_error"


class RouteNotFound(LlmdError):
    status = 404
    code = "not_found"
    type = "invalid_request_error"


class NotFound(LlmdError):
    """A stored thing asked for by id (a stored response) is not there."""

    status = 404
    code = "not_found"
    type = "invalid_request_error"


class PayloadTooLarge(LlmdError):
    status = 413
    code = "payload_too_large"
    type = "invalid_request_error"


class InsufficientStorage(LlmdError):
    status = 507
    code = "insufficient_storage"
    type = "server_error"


class UpstreamError(LlmdError):
    """A server llmd relies on (the Hugging Face Hub, a remote engine) failed or refused."""

    status = 502
    code = "upstream_error"
    type = "server_error"


class Overloaded(LlmdError):
    status = 503
    code = "overloaded"
    type = "server_error"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ModelUnavailable(LlmdError):
    status = 503
    code = "model_unavailable"
    type = "server_error"


class ClientGone(LlmdError):
    status = 499  # nginx's "client closed request": nobody reads it
    code = "client_closed_request"
    type = "invalid_request_error"


class EngineCrashed(LlmdError):
    code = "engine_crashed"
    signal = 0  # the signal that killed the worker, when one did


class EngineError(LlmdError):
    code = "engine_error"


_BY_CODE: dict[str, type[LlmdError]] = {
    cls.code: cls
    for cls in (BadRequest, ContextOverflow, GrammarError, ModelNotFound, ModelUnavailable, EngineCrashed,
                EngineError, UpstreamError)
}


def from_wire(wire: tuple[str, str, str | None]) -> LlmdError:
    code, message, param = wire
    if code == ContextGrow.code:
        return ContextGrow(message, None, int(param or 0))
    return _BY_CODE.get(code, EngineError)(message, param)
