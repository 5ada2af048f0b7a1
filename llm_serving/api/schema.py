"""Request bodies of the HTTP API, parsed and validated into plain dataclasses.

Two dialects are accepted:
- the TGI-style body of MindSpore llm-serving (``/models/<name>/generate[_stream]``):
  ``{"inputs": str, "parameters": {...}, "stream": bool}``. Its clients (the contest's load script among
  them) send booleans and numbers as strings ("True", "0.8"), so this dialect accepts those;
- the OpenAI completions body (``/v1/completions``), parsed strictly as OpenAI documents it.

Parsing checks the JSON: shapes, types and each dialect's own ranges. The values of the engine's parameters
(max_new_tokens >= 1, stop strings) are checked once, by ``SamplingParams``, and the limits of the served
configuration once, when the engine admits the request (``admission``); their ``InvalidParameter`` errors
become a 400 under the dialect's name of the field (``parameter_error``: ``max_tokens`` on the OpenAI route).
Every problem becomes an ``ApiError`` carrying the HTTP status and a message that names the parameter, so
the server answers ``{"error": ..., "error_type": ...}`` instead of failing deep in the engine. Unknown keys
are errors too: a misspelt ``max_new_token`` silently ignored would be a wrong answer, not a served one.
Every list and string has a bound past which it is a 400: the body the server's size limit, the prompt its
tokens (admission), OpenAI's prompt list ``MAX_PROMPTS``, stop strings ``SamplingParams``' limits, ``user``
``MAX_USER_CHARS``; so no request that can never run is queued, and error messages quote values shortened.

Sampling controls map onto ``SamplingParams`` (``SamplingOptions.to_params``). Temperature 0 means greedy on
every route: in the llm-serving body ``do_sample`` false means greedy whatever the temperature, ``do_sample``
true samples at the given temperature, greedy at 0, and at Hugging Face's default 1.0 when none is given;
OpenAI's temperature defaults to 1 (sampling). ``repetition_penalty`` applies to greedy requests too, as in
Hugging Face.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from llm_serving.api.errors import invalid, parameter_error, unsupported
from llm_serving.api.structured_schema import STRUCTURED_KEYS, parse_constraint
from llm_serving.core.sequence import SAMPLING_RANGES, OutputConstraint, SamplingParams
from llm_serving.describe import json_kind
from llm_serving.request_errors import ApiError, InvalidParameter

OPENAI_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_PROMPTS = 256  # prompts of one /v1/completions request; each choice of each is a sequence in the queue
MAX_CHOICES = 128  # n / best_of: choices of one prompt
MAX_USER_CHARS = 1024  # OpenAI's opaque end-user id: accepted and ignored, within this length
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on /v1/completions' logprobs (alternatives per position)
OPENAI_MAX_TEMPERATURE = 2.0  # OpenAI's own cap on the engine's temperature range (SAMPLING_RANGES)
HF_DEFAULT_TEMPERATURE = 1.0  # do_sample=true without a temperature


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling controls as sent (validated ranges); ``to_params`` turns them into the engine's parameters."""

    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    # OpenAI's and vLLM's further controls (``SamplingParams`` checks their values)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    constraint: OutputConstraint | None = None  # structured output (``structured_schema``)

    @property
    def wants_sampling(self) -> bool:
        """Whether tokens are drawn at random (else greedy argmax, possibly with a repetition penalty)."""
        return self.do_sample and self.temperature != 0

    def to_params(self, max_new_tokens: int, ignore_eos: bool = False, stop: tuple[str, ...] = (),
                  field_names: Mapping[str, str] | None = None, top_logprobs: int = 0,
                  prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; a value SamplingParams refuses becomes a 400 naming the field as
        ``field_names`` (the dialect) calls it."""
        penalty = 1.0 if self.repetition_penalty is None else self.repetition_penalty
        common = {"repetition_penalty": penalty, "seed": self.seed, "stop": stop, "top_logprobs": top_logprobs,
                  "prompt_logprobs": prompt_logprobs,
                  "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                  "logit_bias": self.logit_bias, "min_tokens": self.min_tokens, "stop_token_ids": self.stop_token_ids,
                  "constraint": self.constraint}
        try:
            if not self.wants_sampling:
                return SamplingParams(max_new_tokens, ignore_eos, **common)
            temperature = HF_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
            return SamplingParams(max_new_tokens, ignore_eos, temperature=temperature, top_k=self.top_k or 0,
                                  top_p=1.0 if self.top_p is None else self.top_p, min_p=self.min_p, **common)
        except InvalidParameter as exc:
            raise parameter_error(exc, field_names or {}) from None


@dataclass(frozen=True)
class StreamUsage:
    """``stream_options`` of the OpenAI routes: ``include_usage`` (a last chunk with the usage, and ``"usage": null``
    in every other chunk, as OpenAI sends them) and vLLM's ``continuous_usage_stats`` (the usage so far in every
    chunk; benchmark clients such as guidellm always send it)."""

    include: bool = False
    continuous: bool = False

    def chunk_usage(self, usage: Callable[[], dict[str, int]]) -> dict[str, Any]:
        """The ``usage`` key of a content chunk: none, null, or the usage so far."""
        if self.continuous:
            return {"usage": usage()}
        return {"usage": None} if self.include else {}


def parse_stream_options(body: Mapping[str, Any], stream: bool) -> StreamUsage:
    options = body.get("stream_options")
    if options is None:
        return StreamUsage()
    options = _object(options, "'stream_options'")
    _no_unknown(options, ("include_usage", "continuous_usage_stats"), "'stream_options'")
    r = _Reader(options, "stream_options.", lenient=False)
    usage = StreamUsage(r.bool("include_usage", False), r.bool("continuous_usage_stats", False))
    if not stream:
        raise invalid("stream_options is only allowed with stream=true", "stream_options")
    return usage


@dataclass(frozen=True)
class GenerateRequest:
    """An llm-serving ``generate``/``generate_stream`` body."""

    FIELD_NAMES: ClassVar[Mapping[str, str]] = {"prompt": "inputs"}  # engine field -> this body's name

    inputs: str
    max_new_tokens: int | None  # None: as many as the context allows, up to model_config.max_generate_length
    sampling: SamplingOptions
    stop: tuple[str, ...] = ()
    return_full_text: bool = False
    details: bool = False
    stream: bool = False
    sse: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    """An OpenAI ``/v1/completions`` body; ``prompts`` holds one entry per choice."""

    FIELD_NAMES: ClassVar[Mapping[str, str]] = {"max_new_tokens": "max_tokens"}  # engine field -> OpenAI's

    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]
    max_tokens: int | None  # None: OpenAI's default 16, clipped to the context left
    sampling: SamplingOptions
    stop: tuple[str, ...] = ()
    stream: bool = False
    usage: StreamUsage = field(default_factory=StreamUsage)
    echo: bool = False
    logprobs: int | None = None
    ignore_eos: bool = False
    n: int = 1  # choices per prompt
    best_of: int = 1  # choices generated per prompt, the n with the highest total logprob returned (>= n)
    kv_transfer: KvTransferParams | None = None  # prefill/decode disaggregation (``kv_transfer_params``)


@dataclass(frozen=True)
class KvTransferParams:
    """``kv_transfer_params`` (vLLM's name) of prefill/decode disaggregation (``api.kv_transfer_routes``):
    ``do_remote_decode`` asks the engine that prefills to keep the prompt's KV blocks for a decode engine (its
    answer names them: ``transfer_id``); ``transfer_id`` + ``remote_url`` ask the decode engine to fetch them from
    the engine at ``remote_url`` before computing the prompt."""

    do_remote_decode: bool = False
    transfer_id: str | None = None
    remote_url: str | None = None


_KV_TRANSFER_KEYS = ("do_remote_decode", "do_remote_prefill", "transfer_id", "remote_url", "num_blocks")


def parse_kv_transfer(body: Mapping[str, Any], stream: bool, choices: int) -> KvTransferParams | None:
    """The body's ``kv_transfer_params`` (None when absent or null); the prefill side's request must be a single
    unstreamed choice (its answer carries the transfer's id)."""
    value = body.get("kv_transfer_params")
    if value is None:
        return None
    where = "kv_transfer_params"
    value = _object(value, f"'{where}'")
    _no_unknown(value, _KV_TRANSFER_KEYS, f"'{where}'")
    r = _Reader(value, f"{where}.", lenient=False)
    params = KvTransferParams(r.bool("do_remote_decode", False), r.str("transfer_id"), r.str("remote_url"))
    r.bool("do_remote_prefill", False)
    r.int("num_blocks", lo=0)
    if params.do_remote_decode and (stream or choices != 1):
        raise invalid("kv_transfer_params.do_remote_decode is served for one unstreamed choice of one prompt (the "
                      "answer names the prompt's KV blocks)", where)
    if (params.transfer_id is None) != (params.remote_url is None):
        raise invalid("kv_transfer_params needs both transfer_id and remote_url (where the prefill engine holds the "
                      "prompt's KV blocks), or neither", where)
    if params.transfer_id is not None and re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", params.transfer_id) is None:
        raise invalid("kv_transfer_params.transfer_id must be the id a prefill engine answered (letters, digits, "
                      "'_', '-', '.')", where)
    if params.remote_url is not None and not params.remote_url.startswith(("http://", "https://")):
        raise invalid(f"kv_transfer_params.remote_url must be an http(s) URL, got {params.remote_url[:80]!r}", where)
    return params


# ---- entry points ------------------------------------------------------------------------------------------
def parse_json(raw: bytes) -> Any:
    """The request body as JSON, or a 400 naming the parse problem."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty; expected a JSON object", "invalid_json")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8 text", "invalid_json") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body nests JSON too deeply", "invalid_json") from None
    except ValueError as exc:  # an integer past Python's int() digit limit (4,300 digits)
        raise ApiError(400, f"the request body has a number this server does not read: {exc}",
                       "invalid_json") from None


_GENERATE_TOP = ("inputs", "parameters", "stream", "sse")
_GENERATE_PARAMS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
                    "seed", "stop", "return_full_text", "details", "sse")
# TGI parameters that only mean "off" here: accepted at their neutral value, refused otherwise.
_TGI_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "watermark": (False,), "decoder_input_details": (False,), "truncate": (None,), "typical_p": (None, 1.0),
    "best_of": (None, 1), "top_n_tokens": (None, 0),
}


def parse_generate(body: Any, stream: bool | None = None) -> GenerateRequest:
    """Validate an llm-serving body. ``stream`` forces streaming (the generate_stream route)."""
    body = _object(body, "the request body")
    _no_unknown(body, _GENERATE_TOP, "the request body")
    inputs = body.get("inputs")
    if inputs is None:
        raise invalid("missing 'inputs': the prompt text", "inputs")
    if not isinstance(inputs, str):
        raise invalid(f"'inputs' must be a string, got {json_kind(inputs)}", "inputs")
    if not inputs:
        raise invalid("'inputs' is empty: the prompt must have at least one character", "inputs")
    params = body.get("parameters")
    params = {} if params is None else _object(params, "'parameters'")
    _no_unknown(params, (*_GENERATE_PARAMS, *_TGI_NEUTRAL), "'parameters'")
    for key, neutral in _TGI_NEUTRAL.items():
        if key in params and _neutral_value(params[key]) not in neutral:
            raise ApiError(422, f"parameters.{key}={json_kind(params[key])} is not supported; leave it out",
                           "unsupported", key)
    p = _Reader(params, "parameters.", lenient=True)
    b = _Reader(body, "", lenient=True)
    stream_flag = b.bool("stream", False)  # validated even where the route decides
    max_new = p.int("max_new_tokens")  # its value is the engine's to check (SamplingParams, admission)
    sampling = SamplingOptions(
        do_sample=p.bool("do_sample", False), temperature=p.ranged("temperature"), top_k=p.ranged_int("top_k"),
        top_p=p.ranged("top_p"), repetition_penalty=p.ranged("repetition_penalty"), seed=p.int("seed", lo=0),
    )
    return GenerateRequest(
        inputs=inputs, max_new_tokens=max_new, sampling=sampling, stop=p.stop("stop"),
        return_full_text=p.bool("return_full_text", False), details=p.bool("details", False),
        stream=stream if stream is not None else stream_flag,
        sse=b.bool("sse", False) or p.bool("sse", False),
    )


# OpenAI's sampling keys, and vLLM's extras, of both OpenAI routes
OPENAI_SAMPLING_KEYS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
                        "top_k", "repetition_penalty", "ignore_eos", "min_p", "min_tokens", "stop_token_ids")
_COMPLETION_KEYS = ("model", "prompt", "max_tokens", "n", "stream", "stream_options", "logprobs", "echo", "stop",
                    "best_of", "user", "suffix", *OPENAI_SAMPLING_KEYS, *STRUCTURED_KEYS, "kv_transfer_params")


def openai_sampling(body: Mapping[str, Any], r: _Reader) -> SamplingOptions:
    """The sampling controls of an OpenAI body (temperature defaults to OpenAI's 1: sampling), structured output
    among them."""
    temperature = r.float("temperature", lo=SAMPLING_RANGES["temperature"].lo, hi=OPENAI_MAX_TEMPERATURE)
    temperature = 1.0 if temperature is None else temperature
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise invalid(f"logit_bias must be an object mapping token ids to biases, got {json_kind(bias)}",
                      "logit_bias")
    try:
        pairs = tuple((int(k), v) for k, v in bias.items())
    except ValueError:
        raise invalid("logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise invalid(f"stop_token_ids must be a list of token ids, got {json_kind(stop_ids)}", "stop_token_ids")
    return SamplingOptions(
        do_sample=temperature > 0, temperature=temperature, top_k=r.ranged_int("top_k"), top_p=r.ranged("top_p"),
        repetition_penalty=r.ranged("repetition_penalty"), seed=r.int("seed"),
        presence_penalty=r.ranged("presence_penalty") or 0.0, frequency_penalty=r.ranged("frequency_penalty") or 0.0,
        min_p=r.ranged("min_p") or 0.0, logit_bias=pairs, min_tokens=r.int("min_tokens", lo=0) or 0,
        stop_token_ids=tuple(stop_ids), constraint=parse_constraint(body),
    )


def parse_completion(body: Any) -> CompletionRequest:
    """Validate an OpenAI completions body (strict JSON types; vLLM's top_k/repetition_penalty/ignore_eos too)."""
    body = _object(body, "the request body")
    _no_unknown(body, _COMPLETION_KEYS, "the request body")
    r = _Reader(body, "", lenient=False)
    model = r.str("model")
    prompts = _prompts(body.get("prompt"))
    max_tokens = r.int("max_tokens")  # its value is the engine's to check (SamplingParams, admission)
    sampling = openai_sampling(body, r)
    n = r.int("n", lo=1, hi=MAX_CHOICES) or 1
    best_of = r.int("best_of", lo=1, hi=MAX_CHOICES) or n
    if best_of < n:
        raise invalid(f"best_of ({best_of}) must be >= n ({n})", "best_of")
    if body.get("suffix"):
        raise unsupported("suffix (insertion) is not supported", "suffix")
    user = r.str("user")
    if user is not None and len(user) > MAX_USER_CHARS:
        raise invalid(f"'user' has {len(user)} characters; at most {MAX_USER_CHARS}", "user")
    logprobs = r.int("logprobs", lo=0, hi=MAX_COMPLETION_LOGPROBS)  # alternatives per position: OpenAI's range
    echo = r.bool("echo", False)
    stream = r.bool("stream", False)
    if stream and echo and logprobs is not None:
        raise unsupported("echo with logprobs (the prompt's logprobs) is served without stream only", "stream")
    if stream and best_of > n:
        raise invalid("best_of above n cannot be streamed (the best choices are known only at the end)", "best_of")
    return CompletionRequest(
        model=model, prompts=prompts, sampling=sampling,
        max_tokens=max_tokens,
        stop=r.stop("stop"), stream=stream, usage=parse_stream_options(body, stream), echo=echo, logprobs=logprobs,
        ignore_eos=r.bool("ignore_eos", False), n=n, best_of=best_of,
        kv_transfer=parse_kv_transfer(body, stream, len(prompts) * best_of),
    )


# ---- helpers -----------------------------------------------------------------------------------------------
def _prompts(prompt: Any) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's prompt: a string, a list of strings, a list of token ids, or a list of such lists."""
    if prompt is None:
        raise invalid("missing 'prompt'", "prompt")
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise invalid(f"'prompt' must be a non-empty string, a list of strings or a list of token ids, got "
                      f"{json_kind(prompt)}", "prompt")
    if len(items) > MAX_PROMPTS:
        raise invalid(f"'prompt' has {len(items)} prompts; at most {MAX_PROMPTS} per request", "prompt")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(items):
        where = "'prompt'" if len(items) == 1 else f"'prompt[{i}]'"
        if isinstance(item, str):
            if not item:
                raise invalid(f"{where} is empty", "prompt")
            out.append(item)
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            out.append(tuple(item))  # the ids' range is checked at admission
        else:
            raise invalid(f"{where} must be a non-empty string or a non-empty list of token ids (ints), "
                          f"got {json_kind(item)}", "prompt")
    return tuple(out)


class _Reader:
    """Typed access to one JSON object's optional keys; null means absent."""

    def __init__(self, obj: Mapping[str, Any], prefix: str, lenient: bool) -> None:
        self.obj, self.prefix, self.lenient = obj, prefix, lenient

    def _get(self, key: str) -> Any:
        return self.obj.get(key)

    def bool(self, key: str, default: bool) -> bool:
        v = self._get(key)
        if v is None:
            return default
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.strip().lower() in ("true", "false"):
            return v.strip().lower() == "true"
        raise invalid(f"{self.prefix}{key} must be a boolean (true/false or the strings \"True\"/\"False\"), "
                      f"got {json_kind(v)}", key)

    def str(self, key: str) -> str | None:
        v = self._get(key)
        if v is not None and not isinstance(v, str):
            raise invalid(f"{self.prefix}{key} must be a string, got {json_kind(v)}", key)
        return v

    def int(self, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
        v = self._get(key)
        if v is None:
            return None
        if self.lenient and isinstance(v, str):
            try:
                v = int(v.strip())
            except ValueError:
                got = json_kind(self._get(key))
                raise invalid(f"{self.prefix}{key} must be an integer, got {got}", key) from None
        if not _is_int(v):
            raise invalid(f"{self.prefix}{key} must be an integer, got {json_kind(v)}", key)
        if lo is not None and v < lo:
            raise invalid(f"{self.prefix}{key} must be >= {lo}, got {v}", key)
        if hi is not None and v > hi:
            raise invalid(f"{self.prefix}{key} must be <= {hi}, got {v}", key)
        if v >= 2**63:
            raise invalid(f"{self.prefix}{key} is too large: {v}", key)
        return v

    def float(self, key: str, lo: float | None = None, hi: float | None = None,
              lo_open: bool = False) -> float | None:
        v = self._get(key)
        if v is None:
            return None
        if self.lenient and isinstance(v, str):
            try:
                v = float(v.strip())
            except ValueError:
                got = json_kind(self._get(key))
                raise invalid(f"{self.prefix}{key} must be a number, got {got}", key) from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise invalid(f"{self.prefix}{key} must be a finite number, got {json_kind(v)}", key)
        try:
            v = float(v)  # an integer past float's range raises
        except OverflowError:
            v = math.inf
        if not math.isfinite(v):
            raise invalid(f"{self.prefix}{key} must be a finite number, got {json_kind(self._get(key))}", key)
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise invalid(f"{self.prefix}{key} must be {'>' if lo_open else '>='} {lo:g}, got {v:g}", key)
        if hi is not None and v > hi:
            raise invalid(f"{self.prefix}{key} must be <= {hi:g}, got {v:g}", key)
        return v

    def ranged(self, key: str) -> float | None:
        """A sampling parameter read within the engine's range of it (``core.sequence.SAMPLING_RANGES``)."""
        domain = SAMPLING_RANGES[key]
        return self.float(key, lo=domain.lo, hi=domain.hi, lo_open=domain.lo_open)

    def ranged_int(self, key: str) -> int | None:
        """An integer sampling parameter read within the engine's range of it (``SAMPLING_RANGES``)."""
        domain = SAMPLING_RANGES[key]
        return self.int(key, lo=domain.lo, hi=domain.hi)

    def stop(self, key: str) -> tuple[str, ...]:
        """Stop strings as sent; their number and lengths are SamplingParams' to check."""
        v = self._get(key)
        if v is None:
            return ()
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise invalid(f"{self.prefix}{key} must be a string or a list of strings, got {json_kind(v)}", key)
        return tuple(items)


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise invalid(f"{what} must be a JSON object, got {json_kind(value)}")
    return value


def _no_unknown(obj: Mapping[str, Any], known: tuple[str, ...], what: str) -> None:
    unknown = [k for k in obj if k not in known]
    if unknown:
        shown = ", ".join(repr(k[:40]) for k in unknown[:5])  # bounded: a body may carry thousands
        if len(unknown) > 5:
            shown += f" and {len(unknown) - 5} more"
        raise invalid(f"{what} has unknown key(s) {shown}; known keys: {', '.join(known)}", unknown[0][:40])


def _neutral_value(v: Any) -> Any:
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
