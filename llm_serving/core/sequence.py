"""One generation request as the scheduler sees it: token ids, sampling parameters and KV block table.

Preemption is by recompute (as in vLLM): a preempted sequence drops its KV blocks but keeps the tokens it
generated, so its next prefill covers ``all_token_ids`` and only the tokens after that are new output. Its
random draws depend only on its seed and how many tokens it has generated, so a recompute samples the same,
and a logits dump asks only for the position being generated, so it keeps one row per generated token.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from llm_serving.core.logprobs import MAX_TOP_LOGPROBS, PromptLogprob, TopLogprobs
from llm_serving.protocol.batch import needs_logits
from llm_serving.request_errors import InvalidParameter

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from llm_serving.core.adapters import Adapter

# Why a request ended: its eos token, its max_new_tokens, an abort (client gone, shutdown), one of its stop
# strings. The one definition: the scheduler, the metrics' labels and the APIs' names all follow it.
FINISH_REASONS = ("eos", "length", "stop", "abort")

MAX_STOP_STRINGS = 16  # stop strings of one request; each is matched against every new piece of text
MAX_LOGIT_BIAS = 300  # logit_bias entries of one request
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids of one request (with the model's end ids, within MAX_LOGIT_ADJUSTMENTS)
MAX_STOP_LENGTH = 256  # characters of one stop string

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class ParamRange:
    """A sampling parameter's domain: ``lo``..``hi`` (``lo`` itself excluded when ``lo_open``; None: no bound on
    that side); ``neutral`` says which value changes nothing."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    neutral: str = ""

    def holds(self, value: float) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or value <= self.hi

    def message(self, value: float) -> str:
        """``InvalidParameter``'s template for a value outside it, e.g. "{field} must be in (0, 1] (1 = no limit),
        got 0"."""
        lo = _number(self.lo) if self.lo is not None else "-inf"
        if self.hi is None:
            bound = f"{'>' if self.lo_open else '>='} {lo}"
        else:
            bound = f"in ({lo}, {_number(self.hi)}]" if self.lo_open else f"in {lo}..{_number(self.hi)}"
        return f"{{field}} must be {bound} ({self.neutral}), got {_number(value)}"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


# The one definition of each sampling parameter's range: SamplingParams checks its values against it, and the
# HTTP API reads the parameters with it (api.schema), so a request is refused by the same bounds on every route.
SAMPLING_RANGES = {
    "temperature": ParamRange(lo=0.0, neutral="0 = greedy"),
    "top_k": ParamRange(lo=0, hi=_INT32_MAX, neutral="0 = no limit"),  # larger would not fit the int32 step arrays
    "top_p": ParamRange(lo=0.0, hi=1.0, lo_open=True, neutral="1 = no limit"),
    "repetition_penalty": ParamRange(lo=0.0, lo_open=True, neutral="1 = none"),
    "presence_penalty": ParamRange(lo=-2.0, hi=2.0, neutral="0 = none"),
    "frequency_penalty": ParamRange(lo=-2.0, hi=2.0, neutral="0 = none"),
    "min_p": ParamRange(lo=0.0, hi=1.0, neutral="0 = none"),
}


def _check_range(name: str, value: float) -> None:
    if not SAMPLING_RANGES[name].holds(value):
        raise InvalidParameter(name, SAMPLING_RANGES[name].message(value))


CONSTRAINT_KINDS = ("json", "regex", "choice", "thinking_budget")  # the last: core.thinking_budget


class AnswerMatcher(Protocol):
    """Where a constrained answer stands in its grammar (``core.grammar.TokenMatcher``)."""

    mask_words: int

    def fill_mask(self, row: npt.NDArray[np.int32]) -> None: ...
    def allows(self, token: int) -> bool: ...
    def advance(self, token: int) -> bool: ...
    @property
    def error(self) -> str: ...


@dataclass(frozen=True)
class OutputConstraint:
    """What a request's answer must match (structured output, ``core.grammar``).

    ``kind`` "json": ``spec`` is a JSON schema as JSON text (``{"type": "object"}``: any object); "regex": a regular
    expression the whole answer matches; "choice": a JSON list of the allowed answers. ``field`` is the request
    key it came from, named in the error a bad one gets.
    """

    kind: str
    spec: str
    field: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {CONSTRAINT_KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation limits and sampling controls (Hugging Face / vLLM semantics).

    ``temperature`` 0 is greedy (top_k/top_p then do not matter); ``top_k`` 0 and ``top_p`` 1.0 mean no limit;
    ``repetition_penalty`` 1.0 means none (it also applies to greedy requests, as in HF); OpenAI's
    ``presence_penalty``/``frequency_penalty`` (-2..2) subtract from the logit of every token generated so far
    once / per occurrence; ``min_p`` drops tokens less likely than that fraction of the most likely one (sampling
    only); ``logit_bias`` adds to chosen tokens' logits (-100..100); ``min_tokens`` bans the end ids (the model's,
    and ``stop_token_ids``, which end a request with finish reason "stop") until that many are generated.
    ``seed`` makes the draws reproducible whatever else is batched with the request; without one the scheduler
    picks a random seed when the request is admitted. ``stop`` strings (one string or several) end the request where one
    first appears in the generated text, with finish reason "stop" and the stop string cut from the text.
    ``constraint`` holds the answer to a JSON schema, a regex or a list of choices (``core.grammar``).
    Frozen, so one instance can be shared by many requests.

    Values outside a field's domain raise ``InvalidParameter`` (wrong types ``TypeError``), the float fields
    checked as the agents hold them, in float32 (one that becomes 0 or infinite there is refused); the limits
    of the served configuration (max_new_tokens against the context, ...) are checked when the engine admits
    the request (``admission.RequestLimits``).
    """

    max_new_tokens: int = 16
    ignore_eos: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0  # alternatives reported per generated token (their raw-logits logprobs), 0..20
    # None: no prompt scoring; k >= 0: the logprob of every prompt token after the first under the model, with k
    # alternatives per position (OpenAI's echo with logprobs); max_new_tokens may then be 0
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), or a mapping of them
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    constraint: OutputConstraint | None = None  # structured output: the answer matches it, then ends ("stop")
    # scheduling, not sampling, but it travels with the request as these do: under the "priority" policy lower runs
    # earlier (vLLM's meaning); other policies take only 0 (``admission.RequestLimits``)
    priority: int = 0
    # Whether the agent must read the logits (sampling, penalty, adjustment) instead of taking the in-graph argmax:
    # protocol.batch.needs_logits, the rule the agents apply to a step's rows
    needs_logits: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if _not_int(self.max_new_tokens):
            raise TypeError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise InvalidParameter("max_new_tokens", f"{{field}} must be >= 1, got {self.max_new_tokens} (0 only "
                                                     "when scoring the prompt: echo with logprobs)")
        if self.prompt_logprobs is not None and (_not_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidParameter("prompt_logprobs", f"{{field}} must be in 0..{MAX_TOP_LOGPROBS}, got "
                                                      f"{self.prompt_logprobs!r}")
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("temperature", "top_p", "repetition_penalty"):
            _check_range(name, getattr(self, name))
        for name in ("temperature", "top_p", "repetition_penalty"):
            _check_float32(name, getattr(self, name))
        if _not_int(self.top_k):
            raise TypeError(f"top_k must be an int, got {self.top_k!r}")
        _check_range("top_k", self.top_k)
        if _not_int(self.priority):
            raise TypeError(f"priority must be an int, got {self.priority!r}")
        if self.seed is not None and _not_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        object.__setattr__(self, "stop", _checked_stops(self.stop))
        for name in ("presence_penalty", "frequency_penalty", "min_p"):
            _check_range(name, getattr(self, name))
        object.__setattr__(self, "logit_bias", _checked_bias(self.logit_bias))
        if _not_int(self.min_tokens):
            raise TypeError(f"min_tokens must be an int, got {self.min_tokens!r}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidParameter("min_tokens", f"{{field}} must be in 0..max_new_tokens ({self.max_new_tokens}), "
                                                 f"got {self.min_tokens}")
        stop_ids = tuple(self.stop_token_ids)
        if any(_not_int(t) or t < 0 for t in stop_ids) or len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParameter("stop_token_ids", f"{{field}} must be at most {MAX_STOP_TOKEN_IDS} token ids "
                                                     f"(ints >= 0), got {list(stop_ids)[:5]}")
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(stop_ids)))
        if _not_int(self.top_logprobs):
            raise TypeError(f"top_logprobs must be an int, got {self.top_logprobs!r}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParameter("top_logprobs", f"{{field}} must be in 0..{MAX_TOP_LOGPROBS}, got "
                                                   f"{self.top_logprobs}")
        if self.constraint is not None and not isinstance(self.constraint, OutputConstraint):
            raise TypeError(f"constraint must be an OutputConstraint or None, got {self.constraint!r}")
        object.__setattr__(self, "needs_logits", needs_logits(
            self.temperature, self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.min_p,
            bool(self.logit_bias or self.min_tokens), self.constraint is not None))

    @property
    def uses_extras(self) -> bool:
        """Whether the agents need its rarer controls (``protocol.batch.SamplingExtras``)."""
        return bool(self.presence_penalty or self.frequency_penalty or (self.min_p and self.temperature > 0)
                    or self.logit_bias or self.min_tokens or self.constraint is not None)

    @property
    def speculable(self) -> bool:
        """Whether proposals may be verified for it several a step: greedy, or sampled with temperature, top-k and
        top-p alone (rejection sampling keeps that distribution; penalties and adjustments would change with
        every accepted token, and per-token logits to report need a step each)."""
        return (not self.needs_logits or (self.temperature > 0 and not self.penalises_history
                                          and not self.uses_extras)) and not self.top_logprobs

    @property
    def penalises_history(self) -> bool:
        """Whether its penalties read the tokens so far (repetition: prompt and output; presence, frequency)."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty or self.frequency_penalty)


def as_float32(value: float) -> float:
    """``value`` as the step arrays carry it to the agents (float32), overflow giving a signed infinity."""
    try:
        (held,) = struct.unpack("f", struct.pack("f", value))
        return float(held)
    except OverflowError:
        return math.copysign(math.inf, value)


def _check_float32(name: str, value: float) -> None:
    """The agents sample with float32 values: one that becomes 0 or infinite there would mean something else
    than what was asked (top_p 1e-300 would keep no token at all), so it is refused."""
    held = as_float32(value)
    if math.isinf(held) or (held == 0) != (value == 0):
        raise InvalidParameter(name, f"{{field}} {value:g} is {held:g} in float32, the precision the agents "
                                     "sample with; send 0 or a value from 1e-44 to 3.4e38")


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _checked_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``((token id, bias), ...)`` sorted by id, from a mapping or pairs; ids are the admission's
    to check against the vocabulary."""
    if isinstance(bias, dict):
        items = list(bias.items())
    elif isinstance(bias, Iterable):
        items = list(bias)
    else:
        raise TypeError(f"logit_bias must be a mapping or (token id, bias) pairs, got {bias!r}")
    if len(items) > MAX_LOGIT_BIAS:
        raise InvalidParameter("logit_bias", f"{{field}} has {len(items)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for item in items:
        token, value = item
        if _not_int(token) or token < 0 or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -100 <= value <= 100:
            raise InvalidParameter("logit_bias", f"{{field}} maps token ids (ints >= 0) to biases in -100..100, "
                                                 f"got {token!r}: {value!r}")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def _checked_stops(stop: object) -> tuple[str, ...]:
    """``stop`` as a tuple of distinct strings in their order; one string is a single stop string."""
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, (tuple, list)) or not all(isinstance(s, str) for s in items):
        raise TypeError(f"stop must be a string or a sequence of strings, got {stop!r}")
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidParameter("stop", f"{{field}} has {len(items)} strings; at most {MAX_STOP_STRINGS}")
    for s in items:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise InvalidParameter("stop", f"{{field}}: every stop string must have 1..{MAX_STOP_LENGTH} "
                                           f"characters, got {s!r}")
    return tuple(dict.fromkeys(items))


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)prefill; holds no KV blocks
    RUNNING = "running"  # holds KV blocks for its tokens; decoded every step
    FINISHED = "finished"  # done (see finish_reason); never scheduled again


@dataclass(eq=False)
class Sequence:
    """A request's state. Compared by identity: two requests with equal tokens are still different."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float | None = None  # scheduler clock; stamped by Scheduler.add when None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)  # per generated token, with params.top_logprobs
    prompt_scores: list[PromptLogprob] = field(default_factory=list)  # prompt tokens 1.., with prompt_logprobs
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # one of FINISH_REASONS once finished
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    seed: int | None = None  # int64 seed of its random draws; fixed by Scheduler.add (params.seed or random)
    # KV progress, kept by the scheduler: leading tokens whose K/V the agents hold (0 again after a preemption),
    # and the tokens of its step in flight (a prompt chunk, or the one token of a decode)
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0
    # prefix caching (llm_serving.core.prefix_cache): the keys of its full blocks, computed as they fill, and how many
    # leading blocks of its block table are in the cache
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_cached_blocks: int = 0
    # Logits dump: the float32 [vocab] logits of its first ``logits_tokens`` generated positions, row k from the
    # step that produced output token k (a recompute's prefill adds only the row of the token it produces).
    logits_tokens: int = 0
    logits: list[npt.NDArray[np.float32]] = field(default_factory=list, repr=False)
    # Parallel sampling (OpenAI's n): the first choice of its prompt, whose computed prompt blocks this one waits for
    # so it starts on them through the prefix cache (``Scheduler.add``'s ``follows``); None for a request of its own
    follows: Sequence | None = field(default=None, repr=False)
    # Structured output (``params.constraint``): where its answer stands in the grammar; set by the engine
    constraint: AnswerMatcher | None = field(default=None, repr=False)
    # Speculative decoding: a running mean of the proposals it accepted per verification (optimistic at first) and
    # the decode steps it sits out after the mean fell below the scheduler's threshold (``Scheduler._propose``)
    spec_accepted_mean: float = field(default=float("inf"), repr=False)
    spec_pause: int = field(default=0, repr=False)
    # LoRA (``core.adapters``): the adapter its request's model chose (None: the base model), and the agents' slot
    # that holds it while it runs (-1 while waiting, or without one)
    adapter: Adapter | None = field(default=None, repr=False)
    lora_slot: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (the length the next step's context grows from)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def budget(self) -> int:
        """Prompt plus max_new_tokens: the most tokens it can take, what admission by expected wait counts a
        request as (``engine.queue_wait``)."""
        return len(self.prompt_ids) + self.params.max_new_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token_id(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens ``start:stop`` of prompt + output, without copying the whole sequence."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[max(start - n, 0):stop - n]

    @property
    def is_prefilling(self) -> bool:
        """Whether its next step computes more than its last token (a prompt, the rest of one, a recompute)."""
        return self.num_computed_tokens == 0 or self.num_computed_tokens < self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def waits_for_leader(self) -> bool:
        """Whether the choice it follows has yet to compute its prompt (and has not ended)."""
        leader = self.follows
        return leader is not None and not leader.is_finished and leader.num_computed_tokens < leader.num_prompt_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt positions are still to be scored: it is computed one token a step, each step's logits
        giving the next prompt token's logprob (no prefix-cache hit: a cached position has no logits)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_scores) < self.num_prompt_tokens - 1

    @property
    def reads_logits(self) -> bool:
        """Whether its steps may need its logits back: a logits dump, alternatives to report, a prompt to score."""
        return self.logits_tokens > 0 or self.params.top_logprobs > 0 or self.params.prompt_logprobs is not None

    def wants_logits_row(self) -> bool:
        """Whether its next step must return its logits row (the next token's, or the next prompt token's)."""
        return self.num_output_tokens < self.logits_tokens or self.params.top_logprobs > 0 or self.scores_prompt

    def append_token(self, token_id: int, logprob: float) -> None:
        self.output_ids.append(int(token_id))
        self.output_logprobs.append(float(logprob))

    def finish(self, reason: str) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish_reason {reason!r}; expected one of {FINISH_REASONS}")
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}/{self.params.max_new_tokens}, blocks={len(self.block_table)})"
        )
