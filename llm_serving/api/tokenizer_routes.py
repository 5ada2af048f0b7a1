"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

Clients that count tokens on the server use them: lm-evaluation-harness' ``tokenizer_backend=remote`` reads
``/tokenizer_info`` (the special tokens and the chat template), then encodes and decodes through the other two.
The bodies and answers are vLLM's: ``/tokenize`` takes a ``prompt`` (``add_special_tokens``, default true) or chat
``messages`` (rendered by the served chat template with the request's ``tools``, ``add_generation_prompt`` default
true) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``.
These requests do not reach the engine, so they are not counted as generation requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llm_serving.api.schema import _no_unknown, _object, _Reader, invalid
from llm_serving.api.tools import parse_tools
from llm_serving.config.serving_config import ConfigError
from llm_serving.describe import json_kind
from llm_serving.front.errors import error_response, json_response
from llm_serving.request_errors import ApiError, ChatTemplateError, MessageError
from llm_serving.tokenization.chat_template import check_messages

if TYPE_CHECKING:
    from llm_serving.api.route_context import RouteContext

_TOKENIZE_KEYS = ("model", "prompt", "messages", "tools", "add_special_tokens", "add_generation_prompt",
                  "return_token_strs", "continue_final_message")


class TokenizerRoutes:
    """The handlers; the served chat template is the server's (``RouteContext.chat_template``)."""

    def __init__(self, server: RouteContext) -> None:
        self.server = server

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = _object(await self.server.read_body(request), "the request body")
            _no_unknown(body, _TOKENIZE_KEYS, "the request body")
            r = _Reader(body, "", lenient=False)
            self.server.check_model(r.str("model"))
            ids = self._ids(body, r)
            answer: dict[str, Any] = {"count": len(ids), "max_model_len": self.server.config.max_model_len,
                                      "tokens": ids, "token_strs": None}
            if r.bool("return_token_strs", False):
                answer["token_strs"] = [self.server.tokenizer.id_to_piece(i) for i in ids]
            return json_response(answer)
        except ApiError as err:
            return error_response(err, openai=True)

    def _ids(self, body: Mapping[str, Any], r: _Reader) -> list[int]:
        if ("prompt" in body) == ("messages" in body):
            raise invalid("send either 'prompt' (text) or 'messages' (a chat)", "prompt")
        self.server.check_accepting()
        tok = self.server.tokenizer
        if "prompt" in body:
            prompt = r.str("prompt")
            if prompt is None:
                raise invalid("'prompt' must be a string", "prompt")
            return tok.encode(prompt, add_bos=r.bool("add_special_tokens", True))
        if r.bool("continue_final_message", False):
            raise invalid("continue_final_message is not served; end the messages with the user's turn",
                          "continue_final_message")
        tools = parse_tools({"tools": body.get("tools")})  # as the chat route renders them
        try:
            messages = check_messages(body["messages"])
            return self.server.chat_template().prompt_ids(messages, r.bool("add_generation_prompt", True),
                                                         tools.template_tools() if tools is not None else None)
        except (MessageError, ChatTemplateError) as exc:
            raise invalid(str(exc), "messages") from None
        except ConfigError as exc:  # serve loads the template at start-up; this is for apps run another way
            raise ApiError(500, f"the chat template cannot be used: {exc}", "chat_template_error") from None

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = _object(await self.server.read_body(request), "the request body")
            _no_unknown(body, ("model", "tokens"), "the request body")
            self.server.check_model(_Reader(body, "", lenient=False).str("model"))
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in tokens):
                raise invalid(f"'tokens' must be a list of token ids, got {json_kind(tokens)}", "tokens")
            self.server.check_accepting()
            vocab = self.server.tokenizer.vocab_size
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise invalid(f"'tokens' ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}", "tokens")
            return json_response({"prompt": self.server.tokenizer.decode(tokens)})
        except ApiError as err:
            return error_response(err, openai=True)

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """The special tokens by name, the chat template and the lengths (vLLM's ``/tokenizer_info`` fields that
        clients read)."""
        try:
            self.server.check_accepting()
            tok = self.server.tokenizer
            info: dict[str, Any] = {name: value or None for name, value in tok.template_variables().items()}
            try:
                info["chat_template"] = self.server.chat_template().source
            except ConfigError:  # a model without a usable template still tokenizes
                info["chat_template"] = None
            info.update(tokenizer_class=type(tok).__name__, vocab_size=tok.vocab_size,
                        model_max_length=self.server.config.max_model_len)
            return json_response(info)
        except ApiError as err:
            return error_response(err, openai=True)
