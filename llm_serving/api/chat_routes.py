"""The OpenAI chat route: ``POST /v1/chat/completions``.

The messages become the prompt through the served model's chat template (``RouteContext.chat_template``: the
tokenizer side's, loaded once after the engine started; ``serve`` asks for it at start-up so a bad template
stops it); from there a
chat request is a completion of its choices: the same admission, limits, metrics and abort on disconnect
(``RouteContext.start_generation``, ``Generation``), finish reasons and usage as ``/v1/completions``. Streams are
Server-Sent Events of ``chat.completion.chunk`` objects: each choice's first delta carries the role, its last one
the finish reason (``n`` choices interleaved by ``index``, sharing the prompt's KV blocks), then an optional usage
chunk (``stream_options.include_usage``) and ``data: [DONE]``.
``logprobs`` is the chat object (``content``: token, logprob, bytes, top_logprobs per token). With tools
(``api.tools``) the answer is read for tool calls when it ends; streamed, a named function's arguments come as they
are generated, and a choice that may or may not call a tool (auto, required) as one delta at its end (its content or
its calls), since those calls are known only from the whole answer. With ``tokenizer.reasoning_parser`` a thinking
model's ``<think>`` block comes apart from the content (``reasoning_content``; streamed, as it is generated:
``tokenization.reasoning``); ``chat_template_kwargs`` reach the template (Qwen3's ``enable_thinking``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llm_serving.api.chat_schema import ChatRequest, parse_chat
from llm_serving.api.generation import Generation, TokenInfo
from llm_serving.api.guards import check_prompt_count
from llm_serving.api.openai_routes import OPENAI_FINISH, _usage, merge_streams, start_choices
from llm_serving.api.responses import (
    ClientGone,
    end_stream,
    engine_errors,
    open_stream,
    openai_stream_error,
    write,
)
from llm_serving.api.route_context import OFFLOAD_ENCODE_CHARS
from llm_serving.api.tools import call_id
from llm_serving.config.serving_config import ConfigError
from llm_serving.core.sequence import OutputConstraint
from llm_serving.core.thinking_budget import BudgetSpec
from llm_serving.engine.request_stream import EngineError
from llm_serving.front.errors import json_response, stream_error_event
from llm_serving.request_errors import ApiError, ChatTemplateError
from llm_serving.tokenization.hf_tokenizer import AnyTokenizer
from llm_serving.tokenization.reasoning import END, START, ReasoningSplitter, starts_inside, tag_ids

if TYPE_CHECKING:
    from llm_serving.api.route_context import RouteContext


class ChatRoutes:
    """The handler; ``server`` admits the requests."""

    def __init__(self, server: RouteContext) -> None:
        self.server = server

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        server = self.server
        req = parse_chat(await server.read_body(request))
        model = server.check_model(req.model)
        server.kv_transfer.check(req.kv_transfer)
        max_new = req.max_tokens if req.max_tokens is not None else server.default_max_new_tokens
        params = req.sampling.to_params(max_new, req.ignore_eos, req.stop, req.field_names, req.top_logprobs)
        prompt_text, ids = await self._prompt(req)
        if req.thinking_token_budget is not None:
            params = replace(params, constraint=self._budget(req.thinking_token_budget, prompt_text))
        check_prompt_count(req.n, server.config.serving_config.max_queue_size)
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        await server.kv_transfer.import_blocks(req.kv_transfer, ids)  # a decode engine's: the prompt's blocks first
        gens = start_choices(server, ids, params, arrival, req.field_names, cid, req.n, clip=req.max_tokens is None,
                             model=model)
        try:
            meta = {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model}
            if req.stream:
                return await self._stream(request, gens, req, {**meta, "object": "chat.completion.chunk"},
                                          [self._splitter(prompt_text) for _ in gens])
            answers = await engine_errors(asyncio.gather(*(g.collect() for g in gens)))
        finally:
            for g in gens:  # a failed or abandoned choice ends the others too
                g.close()
        choices = []
        for j, answer in enumerate(answers):
            message, reason = _message(req, answer.text, OPENAI_FINISH[answer.finish_reason],
                                       self._splitter(prompt_text), whole=True)
            choices.append({"index": j, "message": {"role": "assistant", **message},
                            "logprobs": self._logprobs(req, answer.tokens), "finish_reason": reason})
        transfer = await server.kv_transfer.export(req.kv_transfer, ids)  # a prefill engine's
        return json_response({**meta, "choices": choices, "usage": _usage(gens, req.n), **transfer})

    def _budget(self, budget: int, prompt_text: str) -> OutputConstraint:
        """The thinking budget's constraint (``core.thinking_budget``), in the served tokenizer's ids."""
        parser = self.server.config.tokenizer.reasoning_parser
        if parser is None:
            raise ApiError(400, "thinking_token_budget needs a reasoning model served with a reasoning parser "
                                "(tokenizer.reasoning_parser, --reasoning-parser)", "invalid_request",
                           "thinking_token_budget")
        tok = self.server.tokenizer
        return BudgetSpec(budget, tuple(tag_ids(tok, START)), tuple(tag_ids(tok, END)),
                          starts_inside(parser, prompt_text)).constraint()

    def _splitter(self, prompt_text: str) -> ReasoningSplitter | None:
        """A choice's reasoning reader, where the served model has a reasoning parser."""
        parser = self.server.config.tokenizer.reasoning_parser
        return ReasoningSplitter(parser, prompt_text) if parser is not None else None

    async def _prompt(self, req: ChatRequest) -> tuple[str, list[int]]:
        """The conversation rendered by the model's template, and tokenized (long ones off the event loop)."""
        server = self.server
        server.check_accepting()  # the template comes with the model: none while loading
        try:
            template = server.chat_template()
        except ConfigError as exc:  # serve loads it at start-up; this is for apps run another way
            raise ApiError(500, f"the chat template cannot be used: {exc}", "chat_template_error") from None
        try:
            tools = req.tools.template_tools() if req.tools is not None else None
            if sum(len(m["content"]) for m in req.messages) > OFFLOAD_ENCODE_CHARS:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(None, template.prompt, req.messages, tools,
                                                  req.chat_template_kwargs)
            return template.prompt(req.messages, tools, req.chat_template_kwargs)
        except ChatTemplateError as exc:
            raise ApiError(400, f"the chat template refused the messages: {exc}", "invalid_request",
                           "messages") from None

    async def _stream(self, request: web.Request, gens: list[Generation], req: ChatRequest, meta: dict[str, Any],
                      splitters: list[ReasoningSplitter | None]) -> web.StreamResponse:
        resp = await open_stream(request, "text/event-stream")

        def chunk(index: int | None, delta: dict[str, Any] | None = None, logprobs: Any = None,
                  reason: str | None = None, **extra: Any) -> bytes:
            choices = [] if index is None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                                 "finish_reason": reason}]
            return f"data: {json.dumps({**meta, 'choices': choices, **extra}, ensure_ascii=False)}\n\n".encode()

        try:
            usage = req.usage.chunk_usage
            for j in range(len(gens)):
                await write(resp, chunk(j, {"role": "assistant", "content": ""}, **usage(lambda: _usage(gens, req.n))))
            held: list[list] = [[] for _ in gens]  # a choice's deltas while it may turn out to be tool calls
            mode = req.tools.choice if req.tools is not None else "none"
            function = req.tools.function if req.tools is not None else None  # mode "function": the one named
            call_ids = [call_id() for _ in gens] if mode == "function" else []
            async for j, delta in merge_streams([g.deltas() for g in gens]):
                reason = OPENAI_FINISH[delta.finish_reason] if delta.finish_reason else None
                if mode == "function":  # the whole answer is the named call's arguments: streamed as they come
                    tokens = [delta.token] if delta.token else []
                    first, held[j] = not held[j], [True]
                    call = {"index": 0, "function": {"arguments": delta.text}}
                    if first:
                        call = {"index": 0, "id": call_ids[j], "type": "function",
                                "function": {"name": function, "arguments": delta.text}}
                    content: dict[str, Any] = {"tool_calls": [call]} if delta.text or first else {}
                elif mode != "none":  # calls are known only from the whole answer: one delta at its end
                    held[j].append(delta)
                    if reason is None:
                        continue
                    text = "".join(d.text for d in held[j])
                    tokens = [d.token for d in held[j] if d.token]
                    if req.tools is not None:  # required calls cut short: the stream ends with the 400's error
                        req.tools.check_finished(reason)
                    message, reason = _message(req, text, reason, splitters[j])
                    if message.get("tool_calls"):
                        message["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
                    content = {k: v for k, v in message.items() if v is not None}
                elif (splitter := splitters[j]) is not None:  # the reasoning's text and the content's, as they come
                    tokens = [delta.token] if delta.token else []
                    thought, said = splitter.feed(delta.text, final=reason is not None)
                    content = {k: v for k, v in (("reasoning_content", thought), ("content", said)) if v}
                else:
                    tokens = [delta.token] if delta.token else []
                    content = {"content": delta.text} if delta.text or tokens else {}
                await write(resp, chunk(j, content, self._logprobs(req, tokens) if tokens else None, reason,
                                        **usage(lambda: _usage(gens, req.n))))
            if req.usage.include_usage:
                await write(resp, chunk(None, usage=_usage(gens, req.n)))
            await write(resp, b"data: [DONE]\n\n")
        except EngineError as exc:
            return await end_stream(resp, openai_stream_error(exc))
        except ApiError as err:  # found once the answer ended, after the stream began: its error event
            return await end_stream(resp, stream_error_event(err, openai=True))
        except ClientGone:
            return resp
        return await end_stream(resp)

    def _logprobs(self, req: ChatRequest, tokens: list[TokenInfo]) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        return {"content": [_token_logprob(self.server.tokenizer, t, req.top_logprobs) for t in tokens]}


def _message(req: ChatRequest, text: str, reason: str, splitter: ReasoningSplitter | None = None,
             whole: bool = False) -> tuple[dict[str, Any], str]:
    """The assistant message of a finished choice (its reasoning, with a ``splitter``; its content, or its tool
    calls) and its finish reason. Only a complete answer is read for calls: one cut short by its token limit is its
    content, or, ``whole`` (not streamed: nothing sent yet), a 400 where calls were required
    (``ToolRequest.check_finished``)."""
    if req.tools is not None and whole:
        req.tools.check_finished(reason)
    thought: dict[str, Any] = {}
    answer: str | None = text
    if splitter is not None:
        reasoning, answer = splitter.split(text)
        thought = {"reasoning_content": reasoning}
    if req.tools is None or reason != "stop" or not answer:
        return {**thought, "content": answer}, reason
    content, calls = req.tools.read(answer)
    if not calls:
        return {**thought, "content": answer}, reason
    return {**thought, "content": content, "tool_calls": calls}, req.tools.finish_reason


def _token_logprob(tok: AnyTokenizer, t: TokenInfo, top: int) -> dict[str, Any]:
    """One position of the chat ``logprobs.content``: the chosen token, and the ``top`` most likely tokens of the
    model's distribution there."""
    alternatives = [{"token": tok.token_text(i), "logprob": lp, "bytes": tok.token_bytes(i)}
                    for i, lp in (t.top or ())[:top]]
    return {"token": tok.token_text(t.id), "logprob": t.logprob, "bytes": tok.token_bytes(t.id),
            "top_logprobs": alternatives}
