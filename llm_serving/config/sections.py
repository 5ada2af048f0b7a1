"""The launch configuration's sections: one frozen dataclass per YAML section (``model_config``,
``serving_config``, ``pa_config``, ``tokenizer``, ``scheduler``, ``speculative``, ``default_model``), its keys
declared with ``setting`` (``yaml_sections`` reads them). ``llm_serving.config.serving_config`` gathers them into
the ``ServingConfig``. Kept free of MindSpore.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_serving.config.yaml_sections import setting
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.paths import cache_root

__all__ = ["SECTIONS", "DefaultModelSection", "ModelSection", "PagedAttentionSection", "SchedulerSection",
           "ServingSection", "SpeculativeSection", "TokenizerSection"]

# tokenizer.type -> the file it reads: sentencepiece's tokenizer.model, Hugging Face's tokenizer.json, or auto
# (whichever the model directory has, tokenizer.model first)
TOKENIZER_TYPES = {"auto": None, "LlamaTokenizer": "tokenizer.model", "PreTrainedTokenizerFast": "tokenizer.json"}
# devices whose agents' ops attend over cached context (chunked prefill, prefix caching): the CPU backends, and
# the Ascend backend through PagedAttention's multi-token queries (q_seq_lens)
CACHED_CONTEXT_DEVICES = ("CPU", "Ascend")
# model_config.backend: llm-serving's 'ms' / 'ge' / 'kbk' all run our Llama graph; 'mindformers' runs MindFormers'
# LlamaForCausalLM built from model_cfg_path (agents/mindformers, its own environment: docs/mindformers.md)
MODEL_BACKENDS = ("ms", "ge", "kbk", "mindformers")
MAX_VERIFY_ROUNDS = 64  # speculative.rounds: a step's tokens come back together (64 x 16 a sequence at most)
MAX_DECODE_STEPS = 16  # scheduler.decode_steps: more only delays what a client sees (tokens come k at a time)


@dataclass(frozen=True)
class ModelSection:
    """``model_config``: what model to serve and the compiled shape buckets."""

    model_name: str = setting("llama2", "str")
    model_path: str | None = setting(None, "path", optional=True)  # None: serve the embedded default model
    dtype: str = setting("float32", "str")
    device_target: str = setting("CPU", "str")  # CPU or Ascend; rank r runs on device start_device_id + r
    max_generate_length: int = setting(512, "int")
    end_token: int | None = setting(None, "int", optional=True)  # None: the model's eos_token_id
    vocab_size: int | None = setting(None, "int", optional=True)  # None: the model's; else checked against it
    pad_token_id: int = setting(0, "int")
    seq_length: tuple[int, ...] = setting((64, 256), "buckets")
    prefill_batch_size: tuple[int, ...] = setting((1, 4), "buckets")
    decode_batch_size: tuple[int, ...] = setting((1, 8, 32), "buckets")
    page_attention: bool = setting(True, "bool")
    kernels: str = setting("auto", "str")  # native C++ ops on CPU (attention, greedy, projections), portable or auto
    precision: str = setting("exact", "str")  # exact; half / fast: float16 / bfloat16 weights of native projections
    quantization: str = setting("none", "str")  # none; w8a16: int8 weights of the layers' projections
    kv_cache_dtype: str = setting("auto", "str")  # auto (the model's dtype); int8: per token and kv head scales
    backend: str = setting("ms", "str")
    model_cfg_path: str | None = setting(None, "path", optional=True)
    # early exit: serve only the first N decoder layers (then the final norm and lm_head); None: every layer
    early_exit_layer: int | None = setting(None, "int", optional=True)


@dataclass(frozen=True)
class ServingSection:
    """``serving_config``: network endpoints, agent ranks and admission limits."""

    # llm-serving compatibility: its agents listen on these ports; ours talk over pipes, so only the
    # number of entries counts (the agent count when num_agents is not set)
    agent_ports: tuple[int, ...] = setting((16002,), "ints")
    start_device_id: int = setting(0, "int")
    server_ip: str = setting("127.0.0.1", "str")
    server_port: int = setting(8000, "int")
    num_agents: int | None = setting(None, "int", optional=True)
    # ranks started on this host (0 .. local_agents-1; None: all); the others run on other hosts and join at
    # join_address (HOST:PORT of this host, where `llm-serving agent --join` connects; docs/deployment.md)
    local_agents: int | None = setting(None, "int", optional=True)
    join_address: str | None = setting(None, "str", optional=True)
    # prefill/decode disaggregation: this engine exports prompts' KV blocks to, and imports them from, engines of
    # the same model and layout (kv_transfer_params of the OpenAI routes; `llm-serving router --prefill`)
    kv_transfer: bool = setting(False, "bool")
    max_queue_size: int = setting(1024, "int")
    model_aliases: tuple[str, ...] = setting(("llama2",), "strs")
    api_key: str | None = setting(None, "str", optional=True)  # Bearer key on all routes but /health
    drain_timeout_s: float = setting(30.0, "float")
    # self-healing agents (llm_serving/engine/recovery.py): a step gets step_timeout_factor x the slowest warmed-up
    # step, at least step_timeout_min_s (factor 0: no timeout); restarts back off from agent_restart_backoff_s
    step_timeout_factor: float = setting(20.0, "float")
    step_timeout_min_s: float = setting(5.0, "float")
    agent_restart_limit: int = setting(5, "int")
    agent_restart_backoff_s: float = setting(1.0, "float")
    # logits dump of `llm-serving generate` (--dump-logits DIR, --dump-logits-tokens N override these): float32
    # logits of each prompt's first N generated positions in DIR/<prompt index>.npy; None: no dump / every position
    dump_logits_dir: str | None = setting(None, "path", optional=True)
    dump_logits_tokens: int | None = setting(None, "int", optional=True)
    # the agents' graph compile cache (agents/runtime/compile_cache.py): true (compile-cache/ under the cache root,
    # llm_serving.protocol.paths), false, or
    # the directory to keep it in; a warm start loads every shape's graph instead of compiling it
    compile_cache: bool | str = setting(True, "switch_or_path")

    @property
    def effective_num_agents(self) -> int:
        return self.num_agents if self.num_agents is not None else len(self.agent_ports)


@dataclass(frozen=True)
class PagedAttentionSection:
    """``pa_config``: the paged KV cache."""

    num_blocks: int | str = setting(512, "int_or_auto")  # per device; auto: from its memory (memory_utilization)
    block_size: int = setting(16, "int")
    decode_seq_length: int = setting(512, "int")  # max tokens (prompt + output) of one sequence
    # the share of each device's memory that weights, steps and the KV cache may take, with num_blocks auto
    memory_utilization: float | None = setting(None, "float", optional=True)

    @property
    def auto_blocks(self) -> bool:
        return self.num_blocks == "auto"

    @property
    def utilization(self) -> float:
        """``memory_utilization``, 0.9 when left empty (vLLM's default)."""
        return self.memory_utilization if self.memory_utilization is not None else 0.9


@dataclass(frozen=True)
class TokenizerSection:
    """``tokenizer``: a SentencePiece ``tokenizer.model`` or a Hugging Face ``tokenizer.json``."""

    type: str = setting("auto", "str")
    vocab_file: str | None = setting(None, "path", optional=True)
    chat_template: str | None = setting(None, "path", optional=True)  # a Jinja file; None: the model's own


@dataclass(frozen=True)
class SchedulerSection:
    """``scheduler``: how waiting requests are admitted into steps."""

    policy: str = setting("longest_output_first", "str")
    max_wait_s: float = setting(5.0, "float")
    max_num_batched_tokens: int | None = setting(None, "int", optional=True)
    min_decode_steps_between_prefills: int = setting(0, "int")
    decode_steps: int = setting(1, "int")  # decode steps per agent round trip when nothing waits (multi-step)
    # the next plain decode step sent while one runs, fed the agents' own picks (Scheduler.schedule_ahead). None: on
    # unless speculative decoding is (its verify steps need the master's proposals between steps)
    async_scheduling: bool | None = setting(None, "bool", optional=True)
    # decode tokens and prompt chunks share steps; reuse the KV blocks of a cached prefix. None: on where the
    # agents' ops attend over cached context (CACHED_CONTEXT_DEVICES; not backend mindformers)
    enable_chunked_prefill: bool | None = setting(None, "bool", optional=True)
    enable_prefix_caching: bool | None = setting(None, "bool", optional=True)


@dataclass(frozen=True)
class SpeculativeSection:
    """``speculative``: proposed tokens verified by the model several per step (``llm_serving.core.speculative``)."""

    method: str = setting("", "str")  # "" (off), ngram, draft (draft_model_path) or self (the first draft_layers)
    num_tokens: int = setting(4, "int")  # most proposals one sequence has verified in a step
    prompt_lookup_min: int = setting(1, "int")
    prompt_lookup_max: int = setting(4, "int")
    draft_model_path: str | None = setting(None, "path", optional=True)
    draft_layers: int | None = setting(None, "int", optional=True)
    max_step_tokens: int = setting(8, "int")  # a verify step's tokens at most: proposals back off as batches grow
    # verify rounds the agents run per step while the master is not needed between tokens (all greedy, nothing
    # waiting): agents.runtime.verify_rounds; None: the method's default (verify_rounds())
    rounds: int | None = setting(None, "int", optional=True)
    # below this mean of accepted proposals a sequence pauses (0: never); None: the method's default (policies())
    min_accepted: float | None = setting(None, "float", optional=True)
    # speculate only at batch sizes where it measured faster; None: the method's default (policies())
    adaptive: bool | None = setting(None, "bool", optional=True)

    def verify_rounds(self) -> int:
        """Verify rounds a step, as set or the method's default: 8 for ngram (one stream 1.61x plain against 1.25x
        in one round a step), 1 for draft and self (their draft calls, not the master, bound them: 0.70x against
        0.77x): docs/speculative.md "Verify rounds in the agent"."""
        return self.rounds if self.rounds is not None else (8 if self.method == "ngram" else 1)

    def policies(self) -> tuple[float, bool]:
        """(min_accepted, adaptive), each as set or the method's default: off for ngram (its gains come in bursts
        that pauses and running means skip), on for draft and self (a draft step costs nearly a target step on
        CPU, and without them they ran at 0.6-0.76x of plain at one stream, with them 0.93-1.14x:
        docs/speculative.md "The policies per method")."""
        drafted = self.method in ("draft", "self")
        return (self.min_accepted if self.min_accepted is not None else (0.5 if drafted else 0.0),
                self.adaptive if self.adaptive is not None else drafted)


DEFAULT_WEIGHTS = ("trained", "random")
RANDOM_RECIPE_KEYS = ("seed", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                      "vocab_size")


@dataclass(frozen=True)
class DefaultModelSection:
    """``default_model``: the small Llama served when no model_path is given: the trained pydoc model the project
    ships (``weights: trained``), or a seeded random one built and cached locally from the keys below."""

    weights: str = setting("trained", "str")
    data_dir: str = setting(str(cache_root()), "path")
    seed: int = setting(0, "int")
    hidden_size: int = setting(256, "int")
    intermediate_size: int = setting(688, "int")
    num_layers: int = setting(4, "int")
    num_heads: int = setting(4, "int")
    num_kv_heads: int = setting(2, "int")
    vocab_size: int = setting(1000, "int")

    def llama_config(self, max_position_embeddings: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=max_position_embeddings,
        )


SECTIONS: dict[str, type] = {
    "model_config": ModelSection,
    "serving_config": ServingSection,
    "pa_config": PagedAttentionSection,
    "tokenizer": TokenizerSection,
    "scheduler": SchedulerSection,
    "speculative": SpeculativeSection,
    "default_model": DefaultModelSection,
}
