"""Offline API: ``LLM(config).generate(prompts)`` runs a whole workload through the engine.

Every prompt is submitted at once (the scheduler batches them continuously), results come back in prompt
order. When more prompts than ``serving_config.max_queue_size`` are given, submission waits for earlier
requests to finish instead of failing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.engine.loop import Engine
from llm_serving.engine.request_stream import GenerationResult, RequestStream
from llm_serving.request_errors import QueueFull
from llm_serving.tokenization.hf_tokenizer import AnyTokenizer

if TYPE_CHECKING:
    from typing_extensions import Self  # noqa: UP035  (typing.Self is 3.11+: mypy checks for 3.10)

_OVERRIDES = ("model_path", "host", "port", "policy", "decode_batch_size", "prefill_batch_size", "num_agents")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load_config(config: ServingConfig | str | os.PathLike | Mapping[str, Any] | None = None,
                **overrides: Any) -> ServingConfig:
    """A ServingConfig from a config, a YAML path, a dict of sections or None (defaults), plus overrides.

    Overrides are ``ServingConfig.with_overrides`` names (``policy="fcfs"``, ``decode_batch_size=32``, ...) or
    dotted ``"section.key"`` names (``**{"pa_config.num_blocks": 256}``).
    """
    if config is None:
        cfg = ServingConfig()
    elif isinstance(config, ServingConfig):
        cfg = config
    elif isinstance(config, (str, os.PathLike)):
        cfg = ServingConfig.from_yaml(config)
    elif isinstance(config, Mapping):
        cfg = ServingConfig.from_dict(config)
    else:
        raise TypeError(f"config must be a ServingConfig, a YAML path, a dict or None, got "
                        f"{type(config).__name__}")
    dotted = {k: v for k, v in overrides.items() if "." in k}
    named = {k: v for k, v in overrides.items() if "." not in k}
    unknown = [k for k in named if k not in _OVERRIDES]
    if unknown:
        raise TypeError(f"unknown override(s) {unknown}; use {', '.join(_OVERRIDES)} or 'section.key' names")
    if dotted:
        cfg = cfg.with_values(dotted)
    return cfg.with_overrides(**named)


class LLM:
    """An engine with its agents, started on construction; ``close()`` (or ``with``) stops it."""

    def __init__(self, config: ServingConfig | str | os.PathLike | Mapping[str, Any] | None = None, *,
                 standin_agents: bool = False, progress: Callable[[str], None] | None = _stderr,
                 **overrides: Any) -> None:
        self.config = load_config(config, **overrides)
        self.engine = Engine(self.config, standin_agents=standin_agents)
        try:
            self.engine.start(progress)
        except BaseException:
            self.engine.shutdown()
            raise

    @property
    def tokenizer(self) -> AnyTokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str | Sequence[int]], max_new_tokens: int = 16,
                 ignore_eos: bool = False,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 logits_tokens: int = 0, **sampling: Any) -> list[GenerationResult]:
        """Generation for every prompt (text, or token ids used as given); results in prompt order.

        Greedy unless asked otherwise: either ``sampling_params`` (one for all prompts or one per prompt), or
        ``SamplingParams`` fields as keywords (``temperature=0.8, top_p=0.9, seed=1, stop=["\\n"]``) next to
        ``max_new_tokens``/``ignore_eos``; temperature 0 is greedy. A seed applies to every prompt it is given
        for. A stop string ends its prompt's generation with finish reason "stop" and is cut from the
        result's ``text``. A request the configuration cannot run raises ``AdmissionError`` naming the field.
        ``logits_tokens`` > 0: each result's ``logits`` holds the float32 logits of its first that many generated
        positions (``Engine.submit``).
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [SamplingParams(max_new_tokens, ignore_eos, **sampling)] * len(prompts)
        elif sampling:
            raise TypeError(f"give sampling_params or sampling keywords ({', '.join(sampling)}), not both")
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        streams: list[RequestStream] = []
        try:
            for prompt, p in zip(prompts, params):
                streams.append(self._submit(prompt, p, streams, logits_tokens))
            return [s.result() for s in streams]
        except BaseException:
            for s in streams:
                s.abort()
            raise

    def chat(self, conversations: Sequence[Sequence[Mapping[str, Any]]], max_new_tokens: int = 16,
             ignore_eos: bool = False, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             **sampling: Any) -> list[GenerationResult]:
        """``generate`` for conversations (lists of ``{"role", "content"}`` messages), each rendered by the
        served model's chat template (``chat_template``) as ``/v1/chat/completions`` renders it. Raises
        ``MessageError`` for messages that are not a conversation, ``ChatTemplateError`` when the template
        refuses them."""
        prompts = [self.chat_prompt_ids(c) for c in conversations]
        return self.generate(prompts, max_new_tokens, ignore_eos, sampling_params, **sampling)

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt token ids of one conversation (BOS included, as the template writes it)."""
        from llm_serving.tokenization.chat_template import check_messages

        # the served template, loaded on first use: a ConfigError if the configured one is bad
        return self.engine.chat_template.get().prompt_ids(check_messages(list(messages)))

    def _submit(self, prompt: str | Sequence[int], params: SamplingParams,
                earlier: list[RequestStream], logits_tokens: int = 0) -> RequestStream:
        waited = 0
        while True:
            try:
                return self.engine.submit(prompt if isinstance(prompt, str) else list(prompt), params,
                                          logits_tokens=logits_tokens)
            except QueueFull:  # offline: wait for an earlier request instead of failing
                pending = [s for s in earlier[waited:] if not s.finished]
                if not pending:
                    raise
                pending[0].result()
                waited = earlier.index(pending[0]) + 1

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
