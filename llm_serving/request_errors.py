"""Why a request is refused: every exception that describes a bad or refused request, whichever layer finds it
(the sampling parameters, the scheduler, admission, the queue, the chat messages and template, an HTTP route).

A leaf module that imports nothing, so each layer raises these without importing another's, and each front end
(the HTTP routes, the offline ``LLM``, the CLI) catches them from one place. Failures of the server itself (an
agent died, a tokenizer file did not load) are not here.
"""

from __future__ import annotations


class InvalidParameter(ValueError):
    """A request parameter the engine cannot take; the message names the field.

    ``template`` holds the message with ``{field}`` where the field's name goes, so each front end can show
    it under its own name (``message_for``): the OpenAI route's ``max_tokens``, the CLI's
    ``--max-new-tokens``. ``error_type`` is the HTTP API's tag for it.
    """

    error_type = "invalid_request"

    def __init__(self, field: str, template: str) -> None:
        super().__init__(template.replace("{field}", field, 1))
        self.field = field
        self.template = template

    def message_for(self, name: str) -> str:
        """The message with the field called ``name``."""
        return self.template.replace("{field}", name, 1)


class RequestRejected(ValueError):
    """A request that can never be served with this configuration (rejected at admission)."""


class AdmissionError(RequestRejected, InvalidParameter):
    """A request the served configuration cannot run; ``field`` is "prompt" or "max_new_tokens"."""

    def __init__(self, field: str, template: str, error_type: str = "invalid_request") -> None:
        super().__init__(field, template)
        self.error_type = error_type


class QueueFull(RuntimeError):
    """The queue holds no more: more requests are waiting than ``serving_config.max_queue_size``, or a new one would
    wait longer than ``serving_config.max_queue_wait_s``; retry after ``retry_after`` seconds (HTTP 503)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class MessageError(ValueError):
    """Messages that are not a conversation; ``unsupported`` marks valid OpenAI features not served here."""

    def __init__(self, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.unsupported = unsupported


class ChatTemplateError(ValueError):
    """The template refused the messages (``raise_exception``) or failed while rendering them."""


class ApiError(Exception):
    """A request the server answers with an HTTP error; ``error_type`` is a stable machine-readable tag."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.retry_after = 1  # a 503's Retry-After, in seconds
        self.close_connection = False  # the answer closes the connection (its request left it unusable)


class ModelNotFound(RequestRejected):
    """A request names a model (or LoRA adapter) this server does not serve (HTTP 404)."""
