"""Every way a request can fail, as the HTTP status and the OpenAI error body the server answers it with.

The body is always `{"error": {"message", "type", "param", "code"}}`. Schema errors (a missing or wrong-typed
field, an unknown field, a value out of range) answer 400 with the field named in `param`, as OpenAI does; an
unknown model answers 404 `model_not_found`, as OpenAI does.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import ValidationError

from llmeasyquant.errors import LLMEasyQuantError
from llmeasyquant.runtime.requests import EngineStopped, QueueFull, RequestError

INVALID_REQUEST = "invalid_request_error"


class ApiError(LLMEasyQuantError):
    """A request the server refuses itself (auth, an unknown model, an unsupported field), with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def api_error(exc: BaseException) -> ApiError:
    """The ApiError that answers `exc`; an exception nobody expected is a 500 (its type named, for the log)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, QueueFull):
        # Retry-After takes whole seconds; rounding up keeps a client from coming back before the queue moved.
        retry = max(1, math.ceil(exc.retry_after_s))
        return ApiError(429, str(exc), "rate_limit_error", exc.param, exc.code or "queue_full",
                        {"Retry-After": str(retry)})
    if isinstance(exc, EngineStopped):
        return ApiError(503, str(exc), "server_error", exc.param, exc.code or "engine_stopped")
    if isinstance(exc, RequestError):
        return ApiError(exc.status, str(exc), INVALID_REQUEST, exc.param, exc.code)
    if isinstance(exc, ValidationError):
        return validation_error(exc)
    if isinstance(exc, json.JSONDecodeError):
        return ApiError(400, f"the body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): "
                        "send a JSON object", code="invalid_json")
    return ApiError(500, f"internal error ({type(exc).__name__}); the server logged it", "server_error",
                    code="internal_error")


def validation_error(exc: ValidationError) -> ApiError:
    """The first schema error of a request body as a 400 naming its field (e.g. `messages.0.role`)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    field = ".".join(str(part) for part in first["loc"]) or None
    kind = first["type"]
    if field is None:
        message = "the request body must be a JSON object"
    elif kind == "missing":
        message = f"the request needs the field '{field}'"
    elif kind == "extra_forbidden":
        message = (f"unrecognized request argument supplied: {field} (llmeasyquant serve does not support it; "
                   "drop it)")
    else:
        # A validator's ValueError arrives as "Value error, <our message>": our message names the field already.
        text = first["msg"].removeprefix("Value error, ")
        message = text if kind == "value_error" else f"{field}: {text} (got {_short(first.get('input'))})"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''} in the request)"
    code = "unsupported" if "not supported" in message else "invalid_value" if kind == "value_error" else kind
    return ApiError(400, message, INVALID_REQUEST, field, code)


def _short(value: object, limit: int = 60) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool | type(None)) else type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
