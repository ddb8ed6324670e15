"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import math

from pydantic import ValidationError
from starlette.responses import JSONResponse


class APIError(Exception):
    """An error answered to the client with an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as a server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def from_value_error(exc: ValueError) -> APIError:
    """SamplingParams and the engine name the bad field first: 'top_p must be ...'."""
    message = str(exc)
    first = message.split(maxsplit=1)[0].rstrip(":") if message else ""
    param = first if first.replace("_", "").replace(".", "").replace("[", "").replace(
        "]", "").isalnum() else None  # a field or a path to one: messages[0].role
    return bad_request(message, param)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first bad field, with its location as the OpenAI `param` ("messages[0].role")."""
    errors = exc.errors(include_url=False)
    path = _param_path(errors[0]["loc"])
    if errors[0]["type"] == "missing":
        return bad_request(f"you must provide a '{path}' parameter", path)
    field_name = path.split("[")[0]
    reasons: list[str] = []
    for err in errors:
        msg = err["msg"].removeprefix("Value error, ")
        if _param_path(err["loc"]).split("[")[0] == field_name and msg not in reasons:
            reasons.append(msg)
    return bad_request(f"{path}: {' or '.join(reasons)}" if path else reasons[0], path or None)


_TYPE_TAGS = ("str", "int", "float", "bool", "dict", "list", "none")


def _param_path(loc: tuple[int | str, ...]) -> str:
    """Pydantic's location without the union-member tags it adds ('str', 'list[int]')."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _TYPE_TAGS or part[:1].isupper():
            continue
        else:
            out += f".{part}" if out else part
    return out


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model '{model}' does not exist", "invalid_request_error", "model",
                    "model_not_found")


def rate_limited(message: str, retry_after_s: float, code: str = "rate_limit_exceeded"
                 ) -> APIError:
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(429, message, "rate_limit_error", None, code,
                    headers={"retry-after": str(seconds)})


def engine_unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", None, "engine_unavailable")
