"""Request bodies of the HTTP API, parsed and validated.

Two dialects are accepted:
- the TGI-style body of MindSpore llm-serving (``/models/<name>/generate[_stream]``):
  ``{"inputs": str, "parameters": {...}, "stream": bool}``. Its clients (the contest's load script among
  them) send booleans and numbers as strings ("True", "0.8"), so this dialect accepts those;
- the OpenAI completions body (``/v1/completions``), parsed strictly as OpenAI documents it, as a pydantic model
  (``body_model``: types, ranges and defaults declared per field; the chat body, ``chat_schema``, shares its base).

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

import builtins
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import Field, PrivateAttr, StringConstraints, field_validator, model_validator

from llm_serving.api.body_model import Body, Int64, NonNegInt64, in_range, refuse, unknown_keys_error, validate_body
from llm_serving.api.errors import invalid, parameter_error
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
    priority: int = 0  # vLLM's: lower runs earlier under scheduler.policy "priority" (refused otherwise unless 0)

    @property
    def wants_sampling(self) -> bool:
        """Whether tokens are drawn at random (else greedy argmax, possibly with a repetition penalty)."""
        return self.do_sample and self.temperature != 0

    def to_params(self, max_new_tokens: int, ignore_eos: bool = False, stop: tuple[str, ...] = (),
                  field_names: Mapping[str, str] | None = None, top_logprobs: int = 0,
                  prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; a value SamplingParams refuses becomes a 400 naming the field as
        ``field_names`` (the dialect) calls it."""
        sampled = self.wants_sampling  # greedy: the sampling knobs are left at their neutral values
        temperature = HF_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        try:
            return SamplingParams(
                max_new_tokens, ignore_eos, temperature=temperature if sampled else 0.0,
                top_k=(self.top_k or 0) if sampled else 0, min_p=self.min_p if sampled else 0.0,
                top_p=1.0 if self.top_p is None or not sampled else self.top_p,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                seed=self.seed, stop=stop, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                logit_bias=self.logit_bias, min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
                constraint=self.constraint, priority=self.priority)
        except InvalidParameter as exc:
            raise parameter_error(exc, field_names or {}) from None


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


# ---- the OpenAI bodies (pydantic models: ``body_model``) ---------------------------------------------------
class StreamUsage(Body):
    """``stream_options`` of the OpenAI routes: ``include_usage`` (a last chunk with the usage, and ``"usage": null``
    in every other chunk, as OpenAI sends them) and vLLM's ``continuous_usage_stats`` (the usage so far in every
    chunk; benchmark clients such as guidellm always send it)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False

    def chunk_usage(self, usage: Callable[[], dict[str, int]]) -> dict[str, Any]:
        """The ``usage`` key of a content chunk: none, null, or the usage so far."""
        if self.continuous_usage_stats:
            return {"usage": usage()}
        return {"usage": None} if self.include_usage else {}


class KvTransferParams(Body):
    """``kv_transfer_params`` (vLLM's name) of prefill/decode disaggregation (``api.kv_transfer_routes``):
    ``do_remote_decode`` asks the engine that prefills to keep the prompt's KV blocks for a decode engine (its
    answer names them: ``transfer_id``); ``transfer_id`` + ``remote_url`` ask the decode engine to fetch them from
    the engine at ``remote_url`` before computing the prompt. ``do_remote_prefill`` and ``num_blocks`` (of a prefill
    engine's answer, sent back as it came) are accepted and unused."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: str | None = None
    remote_url: str | None = None
    num_blocks: NonNegInt64 | None = None

    @field_validator("transfer_id")
    @classmethod
    def _transfer_id(cls, transfer_id: str) -> str:
        if re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", transfer_id) is None:
            raise refuse("{field} must be the id a prefill engine answered (letters, digits, '_', '-', '.')",
                         "kv_transfer_params")
        return transfer_id

    @model_validator(mode="after")
    def _both_or_neither(self) -> KvTransferParams:
        if (self.transfer_id is None) != (self.remote_url is None):
            raise refuse("{field} needs both transfer_id and remote_url (where the prefill engine holds the "
                         "prompt's KV blocks), or neither")
        if self.remote_url is not None and not self.remote_url.startswith(("http://", "https://")):
            raise refuse(f"{{field}}.remote_url must be an http(s) URL, got {self.remote_url[:80]!r}")
        return self


class OpenAIBody(Body):
    """What both OpenAI routes take besides the prompt: OpenAI's sampling keys (temperature defaults to OpenAI's 1:
    sampling) and vLLM's extras, each within the engine's range of it (``in_range``), structured output
    (``structured_schema``) and the choices, streaming and KV transfer keys. A ``*_sent`` field is the key as sent
    where the request's attribute of that name is what the route serves."""

    model: str | None = None
    temperature: Annotated[float, in_range("temperature", hi=OPENAI_MAX_TEMPERATURE)] = 1.0
    top_p: Annotated[float, in_range("top_p")] | None = None
    top_k: Annotated[int, in_range("top_k")] | None = None
    repetition_penalty: Annotated[float, in_range("repetition_penalty")] | None = None
    seed: Int64 | None = None
    presence_penalty: Annotated[float, in_range("presence_penalty")] = 0.0
    frequency_penalty: Annotated[float, in_range("frequency_penalty")] = 0.0
    min_p: Annotated[float, in_range("min_p")] = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: NonNegInt64 = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1  # choices (per prompt)
    stop: tuple[str, ...] = ()  # as sent; their number and lengths are SamplingParams' to check
    stream: bool = False
    usage: StreamUsage = Field(default=StreamUsage(), alias="stream_options")
    user: Annotated[str, StringConstraints(max_length=MAX_USER_CHARS)] | None = None  # accepted and ignored
    response_format: Any = None  # the structured keys: ``structured_schema`` reads them
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    structured_outputs: Any = None
    kv_transfer: KvTransferParams | None = Field(default=None, alias="kv_transfer_params")
    priority: Int64 = 0  # vLLM's; the engine refuses one but 0 unless scheduler.policy is "priority"
    _sampling: SamplingOptions = PrivateAttr()

    @property
    def sampling(self) -> SamplingOptions:
        """The sampling controls, structured output among them."""
        return self._sampling

    @field_validator("logit_bias", mode="plain")
    @classmethod
    def _logit_bias(cls, bias: Any) -> tuple[tuple[int, Any], ...]:
        if not isinstance(bias, dict):
            raise refuse(f"{{field}} must be an object mapping token ids to biases, got {json_kind(bias)}")
        try:
            return tuple((int(k), v) for k, v in bias.items())  # the biases' values are SamplingParams' to check
        except ValueError:
            raise refuse("{field} keys must be token ids (integers as strings)") from None

    @field_validator("stop_token_ids", mode="plain")
    @classmethod
    def _token_ids(cls, ids: Any) -> tuple[int, ...]:
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise refuse(f"{{field}} must be a list of token ids, got {json_kind(ids)}")
        return tuple(ids)

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, stop: Any) -> tuple[str, ...]:
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise refuse(f"{{field}} must be a string or a list of strings, got {json_kind(stop)}")
        return tuple(items)

    @model_validator(mode="after")
    def _across_keys(self) -> OpenAIBody:
        self._check()
        if "usage" in self.model_fields_set and not self.stream:
            raise refuse("stream_options is only allowed with stream=true", "stream_options")
        if self.kv_transfer is not None and self.kv_transfer.do_remote_decode and (self.stream or self.choices != 1):
            raise refuse("kv_transfer_params.do_remote_decode is served for one unstreamed choice of one prompt (the "
                         "answer names the prompt's KV blocks)", "kv_transfer_params")
        self._sampling = SamplingOptions(
            do_sample=self.temperature > 0, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            repetition_penalty=self.repetition_penalty, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, min_p=self.min_p, logit_bias=self.logit_bias,
            min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids, priority=self.priority,
            constraint=parse_constraint({key: getattr(self, key) for key in STRUCTURED_KEYS}))
        self._finish()
        return self

    def _check(self) -> None:
        """The route's own checks across keys (run before the sampling controls are made)."""

    def _finish(self) -> None:
        """The route's own controls, once the sampling controls are made."""

    @property
    def choices(self) -> int:
        """The sequences this request generates."""
        return self.n


class CompletionRequest(OpenAIBody):
    """An OpenAI ``/v1/completions`` body (vLLM's top_k/repetition_penalty/ignore_eos too); ``prompts`` holds one
    entry per prompt, each generating ``best_of`` choices and answering the ``n`` with the highest total logprob."""

    FIELD_NAMES: ClassVar[Mapping[str, str]] = {"max_new_tokens": "max_tokens"}  # engine field -> OpenAI's

    prompts: tuple[str | tuple[int, ...], ...] = Field(default=None, alias="prompt", validate_default=True)
    max_tokens: Int64 | None = None  # None: OpenAI's default 16, clipped to the context left; the value is the
    # engine's to check (SamplingParams, admission)
    best_of_sent: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = Field(default=None, alias="best_of")
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None  # alternatives per position
    suffix: Any = None  # insertion: refused unless empty

    @property
    def best_of(self) -> int:
        """Choices generated per prompt (>= n)."""
        return self.n if self.best_of_sent is None else self.best_of_sent

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.best_of

    @field_validator("prompts", mode="plain")
    @classmethod
    def _prompts(cls, prompt: Any) -> tuple[str | tuple[int, ...], ...]:
        """OpenAI's prompt: a string, a list of strings, a list of token ids, or a list of such lists."""
        if prompt is None:
            raise refuse("missing 'prompt'", "prompt")  # absent: pydantic names the field, not its key
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
            items: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt:
            items = prompt
        else:
            raise refuse(f"'prompt' must be a non-empty string, a list of strings or a list of token ids, got "
                         f"{json_kind(prompt)}")
        if len(items) > MAX_PROMPTS:
            raise refuse(f"'prompt' has {len(items)} prompts; at most {MAX_PROMPTS} per request")
        out: list[str | tuple[int, ...]] = []
        for i, item in enumerate(items):
            where = "'prompt'" if len(items) == 1 else f"'prompt[{i}]'"
            if isinstance(item, str) and item:
                out.append(item)
            elif isinstance(item, list) and item and all(_is_int(t) for t in item):
                out.append(tuple(item))  # the ids' range is checked at admission
            elif isinstance(item, str):
                raise refuse(f"{where} is empty")
            else:
                raise refuse(f"{where} must be a non-empty string or a non-empty list of token ids (ints), "
                             f"got {json_kind(item)}")
        return tuple(out)

    def _check(self) -> None:
        if self.best_of < self.n:
            raise refuse(f"best_of ({self.best_of}) must be >= n ({self.n})", "best_of")
        if self.suffix:
            raise refuse("suffix (insertion) is not supported", "suffix", unsupported=True)
        if self.stream and self.echo and self.logprobs is not None:
            raise refuse("echo with logprobs (the prompt's logprobs) is served without stream only", "stream",
                         unsupported=True)
        if self.stream and self.best_of > self.n:
            raise refuse("best_of above n cannot be streamed (the best choices are known only at the end)",
                         "best_of")


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


def parse_completion(body: Any) -> CompletionRequest:
    """Validate an OpenAI completions body."""
    return validate_body(CompletionRequest, body)


class _Reader:
    """Typed access to one JSON object's optional keys; null means absent."""

    def __init__(self, obj: Mapping[str, Any], prefix: builtins.str, lenient: builtins.bool) -> None:
        self.obj, self.prefix, self.lenient = obj, prefix, lenient

    def _get(self, key: builtins.str) -> Any:
        return self.obj.get(key)

    def bool(self, key: builtins.str, default: builtins.bool) -> builtins.bool:
        v = self._get(key)
        if v is None:
            return default
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.strip().lower() in ("true", "false"):
            return v.strip().lower() == "true"
        raise invalid(f"{self.prefix}{key} must be a boolean (true/false or the strings \"True\"/\"False\"), "
                      f"got {json_kind(v)}", key)

    def str(self, key: builtins.str) -> builtins.str | None:
        v = self._get(key)
        if v is not None and not isinstance(v, str):
            raise invalid(f"{self.prefix}{key} must be a string, got {json_kind(v)}", key)
        return v

    def int(self, key: builtins.str, lo: builtins.int | None = None,
            hi: builtins.int | None = None) -> builtins.int | None:
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

    def float(self, key: builtins.str, lo: builtins.float | None = None, hi: builtins.float | None = None,
              lo_open: builtins.bool = False) -> builtins.float | None:
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

    def ranged(self, key: builtins.str) -> builtins.float | None:
        """A sampling parameter read within the engine's range of it (``core.sequence.SAMPLING_RANGES``)."""
        domain = SAMPLING_RANGES[key]
        return self.float(key, lo=domain.lo, hi=domain.hi, lo_open=domain.lo_open)

    def ranged_int(self, key: builtins.str) -> builtins.int | None:
        """An integer sampling parameter read within the engine's range of it (``SAMPLING_RANGES``)."""
        domain = SAMPLING_RANGES[key]
        return self.int(key, lo=None if domain.lo is None else int(domain.lo),
                        hi=None if domain.hi is None else int(domain.hi))

    def stop(self, key: builtins.str) -> tuple[builtins.str, ...]:
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
        raise unknown_keys_error(unknown, known, what)


def _neutral_value(v: Any) -> Any:
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
