"""The scheduler's configuration: the engine derives it from the serving config (``engine.wiring``); the
simulator and tests build it directly, so it checks its own values."""

from __future__ import annotations

from dataclasses import dataclass

from llm_serving.core.speculative import METHODS

# admission order: arrival; the longest max_new_tokens first (``max_wait_s`` bounds the wait); a request's
# ``priority`` (lower first, as vLLM's), then arrival, the lowest running one preempted first
POLICIES = ("fcfs", "longest_output_first", "priority")


@dataclass
class SchedulerConfig:
    num_blocks: int  # KV cache blocks on the agents, dummy block 0 included
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 8  # running sequences = largest decode batch
    max_prefill_batch: int = 4  # sequences admitted by one prefill step
    max_num_batched_tokens: int = 2048  # token budget of one step (of one prefill step without chunked prefill)
    max_model_len: int = 2048  # prompt + max_new_tokens limit per request
    eos_token_id: int | None = 2  # None: only max_new_tokens ends a request
    other_eos_token_ids: tuple[int, ...] = ()  # further ids that end a request as eos does (Llama 3's <|eot_id|>)
    policy: str = "fcfs"  # admission order, see POLICIES
    max_wait_s: float | None = 30.0  # longest_output_first: admit requests queued this long first
    min_decode_steps_between_prefills: int = 0  # interleaving knob, see module docstring
    max_prompt_len: int | None = None  # longest prompt prefilled with others (unchunked); None: max_model_len
    chunked_prefill: bool = False  # decode tokens and prompt chunks share steps, see the module docstring
    prefix_caching: bool = False  # reuse the cached KV blocks of a shared prefix
    decode_steps: int = 1  # decode steps one batch may run while nothing waits (``_steps_ahead``)
    async_scheduling: bool = False  # the next plain decode step sent while one runs (``schedule_ahead``)
    speculative: str = ""  # proposer of speculative decoding (``core.speculative.METHODS``); "": none
    num_speculative_tokens: int = 4  # most proposals one sequence has verified in a step
    prompt_lookup_min: int = 1  # n-gram lengths the ngram proposer matches
    prompt_lookup_max: int = 4
    # tokens one verify step carries at most (its sequences' last tokens and proposals): fewer proposals each as the
    # batch grows, none from this many running sequences on (at saturation verifying costs more than it saves)
    speculative_step_tokens: int = 8
    # a sequence whose recent verifications accepted fewer proposals than this on average sits out
    # ``speculation.PAUSE_STEPS`` decode steps, then tries again (a verify step costs more than a decode step)
    speculative_min_accepted: float = 0.0
    # speculate only at the batch sizes where verify steps measured faster (tokens/s) than plain ones
    speculative_adaptive: bool = False
    speculative_rounds: int = 1  # verify rounds one step may run in the agents while nothing waits (``_rounds``)
    max_loras: int = 0  # LoRA adapter slots in the agents (``core.adapters``); 0: no adapters served

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_prefill_batch",
                     "max_num_batched_tokens", "max_model_len", "decode_steps", "speculative_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"scheduler config: {name} must be a positive int, got {value!r}")
        if self.num_blocks < 2:
            raise ValueError(f"scheduler config: num_blocks must be >= 2 (block 0 is reserved), got "
                             f"{self.num_blocks}")
        if self.chunked_prefill and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"scheduler config: max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence's decode token fits a step"
            )
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"scheduler config: max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}): without chunked prefill a preempted sequence is "
                "recomputed in one prefill"
            )
        if self.speculative not in METHODS:
            raise ValueError(f"scheduler config: speculative must be one of {METHODS}, got {self.speculative!r}")
        if self.speculative and self.decode_steps > 1:
            raise ValueError("scheduler config: speculative decoding and decode_steps > 1 both run several tokens per "
                             "step; choose one")
        if self.speculative and self.async_scheduling:
            raise ValueError("scheduler config: speculative decoding proposes tokens between steps, which a step sent "
                             "ahead cannot wait for; choose one")
        if self.max_loras < 0 or (self.max_loras and self.speculative):
            raise ValueError(f"scheduler config: max_loras must be >= 0, and 0 with speculative decoding (verify "
                             f"steps carry no adapters), got {self.max_loras}")
        if self.policy not in POLICIES:
            raise ValueError(f"scheduler config: policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_wait_s is not None and self.max_wait_s < 0:
            raise ValueError(f"scheduler config: max_wait_s must be >= 0 or None, got {self.max_wait_s}")
        if self.min_decode_steps_between_prefills < 0:
            raise ValueError("scheduler config: min_decode_steps_between_prefills must be >= 0, got "
                             f"{self.min_decode_steps_between_prefills}")
        if self.max_prompt_len is not None and not 1 <= self.max_prompt_len <= self.max_model_len:
            raise ValueError(f"scheduler config: max_prompt_len must be in 1..max_model_len "
                             f"({self.max_model_len}) or None, got {self.max_prompt_len}")
