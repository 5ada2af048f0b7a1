"""The HTTP routes' error: a status, a message, a stable machine-readable tag and the parameter at fault (OpenAI's
error object: ``responses.error_response``)."""

from __future__ import annotations

from collections.abc import Mapping

from llm_serving.core.sequence import InvalidParameter


class ApiError(Exception):
    """A request the server answers with an HTTP error; ``error_type`` is a stable machine-readable tag."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.close_connection = False  # the answer closes the connection (its request left it unusable)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request", param)


def unsupported(message: str, param: str | None = None) -> ApiError:
    """A parameter value the OpenAI routes do not serve: 400, as OpenAI and vLLM answer an invalid parameter (their
    clients raise ``BadRequestError`` for it; a 422 would raise another exception type)."""
    return ApiError(400, message, "unsupported", param)


def parameter_error(exc: InvalidParameter, field_names: Mapping[str, str]) -> ApiError:
    """An engine parameter error as a 400 naming the field as the dialect calls it (``field_names``)."""
    name = field_names.get(exc.field, exc.field)
    return ApiError(400, exc.message_for(name), exc.error_type, name)
