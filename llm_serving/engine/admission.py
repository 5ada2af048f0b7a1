"""The one check of a request against the served configuration, made when the engine admits it.

Every route (HTTP, offline ``LLM``, ``llm-serving generate``) reaches the engine through ``Engine.submit``,
which runs ``RequestLimits.admit``; so each limit is checked in one place, with one message naming the field,
and front ends only rename the field (``InvalidParameter.message_for``). Parameter values on their own
(max_new_tokens >= 1, top_p in (0, 1], ...) are checked by ``SamplingParams`` when it is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llm_serving.config.serving_config import ServingConfig
from llm_serving.core.sequence import SamplingParams
from llm_serving.request_errors import AdmissionError


@dataclass(frozen=True)
class RequestLimits:
    """What the served configuration allows one request."""

    max_new_tokens: int  # model_config.max_generate_length
    max_model_len: int  # prompt + generated tokens (pa_config.decode_seq_length)
    vocab_size: int  # prompt token ids must be below it: the tokenizer's pieces (the model has them all)
    priority_scheduling: bool = False  # scheduler.policy "priority": only then may a request set a priority

    @classmethod
    def from_config(cls, config: ServingConfig, vocab_size: int) -> RequestLimits:
        return cls(config.model_config.max_generate_length, config.max_model_len, vocab_size,
                   config.scheduler.policy == "priority")

    def admit(self, prompt_ids: list[int], params: SamplingParams,
              clip_to_context: bool = False) -> SamplingParams:
        """``params`` if the request can run, else AdmissionError naming the field.

        The context left after the prompt bounds max_new_tokens: a larger one is refused, or with
        ``clip_to_context`` (the HTTP routes, as the config documents) lowered to it, the answer then ending
        with finish reason "length". Any prompt shorter than the model length is served whatever the prefill
        buckets (chunked, or prefilled alone). The KV cache holds a request of the model length (the config is
        validated so); the scheduler refuses one that could not fit it (``Scheduler.add``).
        """
        if params.priority and not self.priority_scheduling:  # vLLM's check and words
            raise AdmissionError("priority", f"Got priority {params.priority} but Priority scheduling is not enabled "
                                             "(scheduler.policy: priority).")
        n = len(prompt_ids)
        if n == 0:
            raise AdmissionError("prompt", "{field} is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise AdmissionError("prompt", f"{{field}} token ids {bad[:5]} are outside the vocabulary "
                                           f"0..{self.vocab_size - 1}")
        for field, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                           ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in ids if t >= self.vocab_size]
            if outside:
                raise AdmissionError(field, f"{{field}} token ids {outside[:5]} are outside the vocabulary "
                                            f"0..{self.vocab_size - 1}")
        want = params.max_new_tokens
        if not want and n < 2:
            raise AdmissionError("prompt", "{field} has one token: scoring a prompt (0 tokens to generate) gives the "
                                           "logprobs of its tokens after the first, so it needs two or more")
        if want > self.max_new_tokens:
            raise AdmissionError("max_new_tokens", f"{{field}} {want} exceeds model_config.max_generate_length "
                                                   f"{self.max_new_tokens}")
        room = self.max_model_len - n
        if room < (1 if want else 0):
            raise AdmissionError("prompt", f"{{field}} has {n} tokens and leaves no room to generate within the "
                                           f"context of {self.max_model_len} tokens (pa_config.decode_seq_length)",
                                 "prompt_too_long")
        if want <= room:
            return params
        if clip_to_context:
            return dataclasses.replace(params, max_new_tokens=room)
        raise AdmissionError("max_new_tokens", f"prompt ({n} tokens) + {{field}} ({want}) = {n + want} exceeds "
                                               f"max_model_len {self.max_model_len} (pa_config.decode_seq_length)")
