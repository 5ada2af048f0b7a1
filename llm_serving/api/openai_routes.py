"""The OpenAI routes: ``POST /v1/completions`` (legacy completions) and ``GET /v1/models``.

A completion has ``n`` choices per prompt (choice ``i * n + j`` is prompt ``i``'s ``j``-th), all admitted or none;
the choices of a prompt share its KV blocks (``start_choices``); with ``best_of`` > n, best_of are generated and the
n of highest total logprob returned. Streams are Server-Sent Events ending ``data: [DONE]``, the choices' chunks
interleaved as they come. ``logprobs`` is the legacy object (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from llm_serving.api.generation import AnswerDelta, Generation, TokenInfo
from llm_serving.api.guards import check_prompt_count
from llm_serving.api.responses import (
    ClientGone,
    end_stream,
    engine_errors,
    open_stream,
    openai_stream_error,
    write,
)
from llm_serving.api.schema import OPENAI_DEFAULT_MAX_TOKENS, CompletionRequest, parse_completion
from llm_serving.core.logprobs import PromptLogprob, TopLogprobs
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.request_stream import EngineError
from llm_serving.front.errors import error_response, json_response
from llm_serving.request_errors import ApiError
from llm_serving.tokenization.hf_tokenizer import AnyTokenizer

if TYPE_CHECKING:
    from llm_serving.api.route_context import RouteContext

# finish reasons as this API names them (OpenAI's), for each of sequence.FINISH_REASONS
OPENAI_FINISH = {"eos": "stop", "length": "length", "stop": "stop", "abort": "abort"}


class OpenAIRoutes:
    """The handlers; ``server`` admits the requests."""

    def __init__(self, server: RouteContext) -> None:
        self.server = server

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        server = self.server
        req = parse_completion(await server.read_body(request))
        model = server.check_model(req.model)
        server.kv_transfer.check(req.kv_transfer)
        check_prompt_count(len(req.prompts) * req.best_of, server.config.serving_config.max_queue_size)
        max_tokens = OPENAI_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        scored = req.logprobs if req.echo else None  # echo with logprobs: the prompt's too (max_tokens may be 0)
        params = req.sampling.to_params(max_tokens, req.ignore_eos, req.stop, req.FIELD_NAMES, req.logprobs or 0,
                                        prompt_logprobs=scored)
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"
        prompts = [await server.tokenize(p) for p in req.prompts]
        # a decode engine's: the prompt's blocks first (one prompt's: the router splits no others)
        await server.kv_transfer.import_blocks(req.kv_transfer, prompts[0])
        gens: list[Generation] = []
        try:
            for i, ids in enumerate(prompts):
                gens += start_choices(server, ids, params, arrival, req.FIELD_NAMES, f"{cid}-{i}", req.best_of,
                                      clip=req.max_tokens is None, model=model)
        except ApiError:
            for g in gens:  # all or nothing: the request is counted once, as refused
                g.close(record=False)
            raise
        try:
            meta = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model}
            echoes = [self._echo_text(req, p) for p in req.prompts for _ in range(req.best_of)]
            if req.stream:  # best_of == n (parse_completion)
                return await self._stream(request, gens, req, meta, echoes)
            answers = await engine_errors(asyncio.gather(*(g.collect() for g in gens)))
        finally:
            for g in gens:  # a failed or abandoned choice ends the others too
                g.close()
        tok = server.tokenizer
        choices = []
        for i in range(len(prompts)):
            group = range(i * req.best_of, (i + 1) * req.best_of)
            best = sorted(group, key=lambda k: -sum(t.logprob for t in answers[k].tokens))[: req.n]
            for j, k in enumerate(sorted(best) if req.best_of == req.n else best):  # k: the choice's index in gens
                answer, echo = answers[k], echoes[k]
                lp = _logprobs(tok, answer.tokens, len(echo), req.logprobs)
                if lp is not None and answer.prompt_logprobs is not None:
                    lp = _with_prompt(tok, prompts[i], answer.prompt_logprobs, lp)
                choices.append({"index": i * req.n + j, "text": echo + answer.text, "logprobs": lp,
                                "finish_reason": OPENAI_FINISH[answer.finish_reason]})
        transfer = await server.kv_transfer.export(req.kv_transfer, prompts[0])  # a prefill engine's
        return json_response({**meta, "choices": choices, "usage": _usage(gens, req.best_of), **transfer})

    def _model_card(self, name: str) -> dict[str, Any]:
        """A served name's card; an adapter's (as vLLM lists them) has its directory as ``root`` and the base
        model as ``parent``."""
        server = self.server
        adapter = server.adapters.get(name) if name not in server.names else None
        return {"id": name, "object": "model", "created": server.created, "owned_by": "llm-serving",
                "root": adapter if adapter is not None else server.model_name,
                "parent": server.model_name if adapter is not None else None,
                "max_model_len": server.config.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        names = [*self.server.names, *self.server.adapters]
        return json_response({"object": "list", "data": [self._model_card(name) for name in names]})

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: one served name's card (ids may hold slashes), 404 otherwise."""
        try:
            return json_response(self._model_card(self.server.check_model(request.match_info["model_id"])))
        except ApiError as err:
            return error_response(err, openai=True)

    async def _stream(self, request: web.Request, gens: list[Generation], req: CompletionRequest,
                      meta: dict[str, Any], echoes: list[str]) -> web.StreamResponse:
        resp = await open_stream(request, "text/event-stream")
        tok = self.server.tokenizer

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return f"data: {json.dumps({**meta, 'choices': choices, **extra}, ensure_ascii=False)}\n\n".encode()

        offsets = [len(e) for e in echoes]
        try:
            for i, echo in enumerate(echoes):
                if echo:
                    await write(resp, chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}],
                                            **req.usage.chunk_usage(lambda: _usage(gens, req.n))))
            async for i, delta in merge_streams([g.deltas() for g in gens]):
                tokens = [delta.token] if delta.token else []
                lp = _logprobs(tok, tokens, offsets[i], req.logprobs)
                offsets[i] += len(delta.text)
                reason = OPENAI_FINISH[delta.finish_reason] if delta.finish_reason else None
                await write(resp, chunk([{"index": i, "text": delta.text, "logprobs": lp, "finish_reason": reason}],
                                        **req.usage.chunk_usage(lambda: _usage(gens, req.n))))
            if req.usage.include_usage:
                await write(resp, chunk([], usage=_usage(gens, req.n)))
            await write(resp, b"data: [DONE]\n\n")
        except EngineError as exc:
            return await end_stream(resp, openai_stream_error(exc))
        except ClientGone:
            return resp
        return await end_stream(resp)

    def _echo_text(self, req: CompletionRequest, prompt: str | tuple[int, ...]) -> str:
        if not req.echo:
            return ""
        return prompt if isinstance(prompt, str) else self.server.tokenizer.decode(prompt)


async def merge_streams(iters: list[AsyncIterator[AnswerDelta]]) -> AsyncIterator[tuple[int, AnswerDelta]]:
    """Items of several async iterators as they come, tagged with the iterator's index."""
    if len(iters) == 1:
        async for item in iters[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iters[i].__anext__())] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()  # the generator's own cleanup (Generation.close) aborts its request


def start_choices(server: RouteContext, ids: list[int], params: SamplingParams, arrival: float,
                  field_names: Mapping[str, str], request_id: str, n: int, clip: bool,
                  model: str | None = None) -> list[Generation]:
    """``n`` choices of one prompt: each its own seed stream (``seed + j`` when a seed is given, as vLLM's
    parallel sampling; else each its own random seed), the first computing the prompt and the others starting on
    its KV blocks (``follows``), all computed with ``model`` (a LoRA adapter's name, or the base model's). A refusal
    closes those already started."""
    gens: list[Generation] = []
    try:
        for j in range(n):
            choice = params if params.seed is None else dataclasses.replace(params, seed=params.seed + j)
            gens.append(server.start_generation(ids, choice, arrival, field_names, f"{request_id}-{j}", clip=clip,
                                                follows=f"{request_id}-0" if j else None, model=model))
    except ApiError:
        for g in gens:
            g.close(record=False)
        raise
    return gens


def _usage(gens: list[Generation], per_prompt: int = 1) -> dict[str, int]:
    """Tokens of the prompts (each counted once, ``per_prompt`` choices apiece) and of every choice generated."""
    prompt = sum(g.prompt_len for g in gens[::per_prompt])
    completion = sum(g.num_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _alternatives(tok: AnyTokenizer, name: str, token: int, logprob: float,
                  top: TopLogprobs | None) -> dict[str, float]:
    """One position's ``top_logprobs`` entry: text -> logprob of the most likely tokens, and the chosen one
    (``token``, whose text is ``name``)."""
    top = top or ()
    out = {tok.token_text(i): lp for i, lp in top}
    if all(i != token for i, _ in top):
        out[name] = logprob
    return out


def _with_prompt(tok: AnyTokenizer, ids: list[int], scores: list[PromptLogprob],
                 generated: dict[str, Any]) -> dict[str, Any]:
    """The legacy ``logprobs`` object of an echoed prompt followed by its answer's: the first prompt token has no
    logprob (null, as OpenAI and vLLM answer), every later one its logprob and its position's most likely tokens.

    A prompt token's text is what it adds to the decoded prompt, so the tokens join to the echoed text at their
    offsets (the first word has no dummy-prefix space); a special token (BOS) keeps its piece, as vLLM shows it,
    at the offset of the text it precedes, adding none."""
    decoder = tok.incremental_decoder()
    names, offsets, offset = [], [], 0
    for token in ids:
        text = decoder.push(token)
        names.append(tok.token_text(token) if tok.is_special(token) else text)
        offsets.append(offset)
        offset += len(text)
    tops: list[dict[str, float] | None] = [None]
    tops += [_alternatives(tok, name, token, logprob, top)
             for name, token, (logprob, top) in zip(names[1:], ids[1:], scores)]
    return {"tokens": names + generated["tokens"],
            "token_logprobs": [None, *(lp for lp, _ in scores), *generated["token_logprobs"]],
            "top_logprobs": tops + generated["top_logprobs"] if generated["top_logprobs"] is not None else None,
            "text_offset": offsets + generated["text_offset"]}


def _logprobs(tok: AnyTokenizer, tokens: list[TokenInfo], offset: int, want: int | None) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object: per position the ``want`` most likely tokens of the model's
    distribution, and the chosen one where it is not among them (as vLLM answers)."""
    if want is None:
        return None
    names, offsets = [], []
    for t in tokens:
        names.append(tok.token_text(t.id))
        offsets.append(offset)
        offset += len(t.text)
    top = [_alternatives(tok, n, t.id, t.logprob, t.top) for n, t in zip(names, tokens)] if want >= 1 else None
    return {"tokens": names, "token_logprobs": [t.logprob for t in tokens], "top_logprobs": top,
            "text_offset": offsets}
