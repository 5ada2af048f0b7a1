"""The HTTP routes' errors made: ``ApiError`` (``llm_serving.request_errors``: a status, a message, a stable
machine-readable tag and the parameter at fault; OpenAI's error object: ``responses.error_response``) for an
invalid or unsupported value, or for an engine parameter error under the dialect's field name."""

from __future__ import annotations

from collections.abc import Mapping

from llm_serving.request_errors import ApiError, InvalidParameter


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
