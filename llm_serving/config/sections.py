"""The launch configuration's sections: one frozen dataclass per YAML section (``model_config``,
``serving_config``, ``pa_config``, ``tokenizer``, ``scheduler``, ``speculative``, ``default_model``), its keys
declared with ``setting`` (``yaml_sections`` reads them) and checked by its ``validate(source)``: the checks of
its own keys, each failure a ``ConfigError`` naming the key and the file. ``llm_serving.config.serving_config``
gathers them into the ``ServingConfig``, which validates every section and then the checks across sections.
Kept free of MindSpore.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from llm_serving.config.lora_section import LoraSection
from llm_serving.config.yaml_sections import need, setting
from llm_serving.core.scheduler_config import POLICIES
from llm_serving.core.speculative import METHODS as SPECULATIVE_METHODS
from llm_serving.protocol.ascend_env import ASCEND_ENVIRONMENT, INT8_KV_DIRECTIONS
from llm_serving.protocol.model_config import (
    ASCEND_DTYPES,
    DEVICE_TARGETS,
    DTYPES,
    KERNEL_CHOICES,
    KV_CACHE_DTYPES,
    PRECISIONS,
    QUANTIZATIONS,
    LlamaConfig,
)
from llm_serving.protocol.paths import cache_root
from llm_serving.protocol.wire import split_address

__all__ = ["SECTIONS", "DefaultModelSection", "LoraSection", "ModelSection", "PagedAttentionSection",
           "SchedulerSection", "ServingSection", "SpeculativeSection", "TokenizerSection"]

# tokenizer.type -> the file it reads: sentencepiece's tokenizer.model, Hugging Face's tokenizer.json, or auto
# (whichever the model directory has, tokenizer.model first)
# how a thinking model's answer is split into reasoning and content (``tokenization.reasoning``), as vLLM names them
REASONING_PARSERS = ("qwen3", "deepseek_r1")
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
    # a MoE model's experts held whole, num_experts / num_agents on each rank (else each expert cut over the ranks)
    expert_parallel: bool = setting(False, "bool")
    backend: str = setting("ms", "str")
    # one graph per step family with open input dimensions (Cell.set_inputs with None dims); None: on for Ascend
    # (backend ms), off on CPU, whose dynamic-shape graphs ran 3-13x slower (docs/ascend.md)
    dynamic_shapes: bool | None = setting(None, "bool", optional=True)
    model_cfg_path: str | None = setting(None, "path", optional=True)
    # early exit: serve only the first N decoder layers (then the final norm and lm_head); None: every layer
    early_exit_layer: int | None = setting(None, "int", optional=True)
    # Ascend only: the stacks' environment (llm_serving.protocol.ascend_env, docs/ascend.md); None: the table's
    ascend_internal_boost: str | None = setting(None, "str", optional=True)  # MS_ENABLE_INTERNAL_BOOST
    ascend_disable_custom_kernels: str | None = setting(None, "str", optional=True)  # ..._DISABLE_CUSTOM_KERNEL_LIST
    ascend_alloc_conf: str | None = setting(None, "str", optional=True)  # MS_ALLOC_CONF
    ascend_enable_lccl: str | None = setting(None, "str", optional=True)  # MS_ENABLE_LCCL
    ascend_hccl_op_expansion_mode: str | None = setting(None, "str", optional=True)  # HCCL_OP_EXPANSION_MODE
    # MindSpore's device memory pool cap, e.g. "58GB"; None: pa_config.memory_utilization of 64 GiB
    max_device_memory: str | None = setting(None, "str", optional=True)
    # kv_cache_dtype int8 on Ascend: how the NPU's PagedAttention applies its antiquant scale, multiply or
    # reciprocal, as its device check found (docs/ascend.md); None: int8 KV refused on Ascend
    ascend_int8_kv_direction: str | None = setting(None, "str", optional=True)
    # Ascend only: the verdict file `llm-serving preflight` wrote on the NPU; it picks the PagedAttention kernel
    # selection and the int8 direction that passed and refuses what failed (llm_serving.engine.ascend_settings)
    ascend_preflight: str | None = setting(None, "path", optional=True)

    def validate(self, source: str) -> None:
        """The checks of these keys together (a ``ConfigError`` naming the key and ``source``)."""
        need(bool(self.model_name.strip()), source, "model_config.model_name", "must not be empty")
        need(self.dtype in DTYPES, source, "model_config.dtype",
             f"expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        need(self.device_target in DEVICE_TARGETS, source, "model_config.device_target",
             f"expected one of {', '.join(DEVICE_TARGETS)}, got {self.device_target!r}")
        need(self.device_target != "Ascend" or self.dtype in ASCEND_DTYPES, source, "model_config.dtype",
             f"{self.dtype} is not served on Ascend (model_config.device_target): the fused NPU kernels take "
             f"{' or '.join(ASCEND_DTYPES)}")
        need(self.backend in MODEL_BACKENDS, source, "model_config.backend",
             f"expected one of {', '.join(MODEL_BACKENDS)}, got {self.backend!r}")
        mindformers = self.backend == "mindformers"
        if mindformers:
            need(self.model_cfg_path is not None, source, "model_config.model_cfg_path",
                 "backend mindformers builds MindFormers' Llama from a MindFormers predict YAML (e.g. "
                 "predict_llama2_7b.yaml): set model_config.model_cfg_path to it")
            need(self.device_target == "Ascend", source, "model_config.device_target",
                 f"backend mindformers serves on Ascend only (MindFormers' Llama kernels, e.g. RmsNorm, "
                 f"FlashAttention and PagedAttention, have no CPU kernels), got {self.device_target}; "
                 "`llm-serving export` builds its Ascend graphs on this machine's CPU")
        need(self.max_generate_length > 0, source, "model_config.max_generate_length",
             f"must be positive, got {self.max_generate_length}")
        need(self.vocab_size is None or self.vocab_size > 0, source, "model_config.vocab_size",
             f"must be positive, got {self.vocab_size}")
        for key in ("end_token", "pad_token_id"):
            v = getattr(self, key)
            need(v is None or v >= 0, source, f"model_config.{key}", f"must be a token id >= 0, got {v}")
        for key in ("seq_length", "prefill_batch_size", "decode_batch_size"):
            b = getattr(self, key)
            need(len(b) > 0, source, f"model_config.{key}", "needs at least one bucket")
            need(all(x > 0 for x in b), source, f"model_config.{key}", f"buckets must be positive, got {list(b)}")
            need(list(b) == sorted(set(b)), source, f"model_config.{key}",
                 f"buckets must be sorted and unique: {list(b)}")
        need(not self.dynamic_shapes or (self.device_target == "Ascend" and not mindformers), source,
             "model_config.dynamic_shapes", "dynamic-shape graphs are built for the Ascend kernels of backend ms "
             f"(got device_target {self.device_target}, backend {self.backend})")
        self._validate_kernels(source, mindformers)
        self._validate_environment(source)

    def environment_overrides(self) -> dict[str, str | None]:
        """config key -> value of the Ascend environment's keys (``ascend_environment``'s overrides)."""
        return {entry.key: getattr(self, entry.key.split(".", 1)[1]) for entry in ASCEND_ENVIRONMENT}

    def _validate_environment(self, source: str) -> None:
        """The Ascend environment's keys: set only for Ascend (never silently ignored), the pool cap as MindSpore
        reads it."""
        for key, value in {**self.environment_overrides(), "model_config.max_device_memory":
                           self.max_device_memory, "model_config.ascend_preflight": self.ascend_preflight}.items():
            need(value is None or self.device_target == "Ascend", source, key,
                 f"sets the Ascend agents' environment, but model_config.device_target is {self.device_target}")
        need(self.max_device_memory is None or re.fullmatch(r"\d+(\.\d+)?GB", self.max_device_memory) is not None,
             source, "model_config.max_device_memory",
             f"expected a size in GB as MindSpore reads it (e.g. 58GB), got {self.max_device_memory!r}")

    @property
    def dynamic_graphs(self) -> bool:
        """``dynamic_shapes`` as set, else on for our Ascend graphs only."""
        if self.dynamic_shapes is not None:
            return self.dynamic_shapes
        return self.device_target == "Ascend" and self.backend == "ms"

    def _validate_kernels(self, source: str, mindformers: bool) -> None:
        """kernels, precision, quantization and kv_cache_dtype, each with the device, dtype and backend it needs."""
        dtype, device, kernels, precision = self.dtype, self.device_target, self.kernels, self.precision
        need(kernels in KERNEL_CHOICES, source, "model_config.kernels",
             f"expected one of {', '.join(KERNEL_CHOICES)}, got {kernels!r}")
        need(precision in PRECISIONS, source, "model_config.precision",
             f"expected one of {', '.join(PRECISIONS)}, got {precision!r}")
        need(precision == "exact" or (device == "CPU" and kernels != "portable" and dtype == "float32"), source,
             "model_config.precision", f"{precision} runs on the native CPU kernels only: it needs "
             "model_config.device_target CPU, dtype float32 and kernels auto or native (got "
             f"{device}, {dtype}, {kernels})")
        need(self.quantization in QUANTIZATIONS, source, "model_config.quantization",
             f"expected one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        need(self.quantization == "none" or device == "Ascend"
             or (kernels != "portable" and dtype == "float32" and precision == "exact"), source,
             "model_config.quantization", f"{self.quantization} runs on Ascend (WeightQuantBatchMatmul) or on the "
             "native CPU projections with float32 activations: on CPU it needs dtype float32, kernels auto or "
             f"native and precision exact (got {dtype}, {kernels}, {precision})")
        need(self.quantization == "none" or not mindformers, source, "model_config.quantization",
             "is not served by backend mindformers")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, source, "model_config.kv_cache_dtype",
             f"expected one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        need(self.kv_cache_dtype == "auto" or not mindformers, source, "model_config.kv_cache_dtype",
             f"{self.kv_cache_dtype} is not served by backend mindformers")
        need(self.kv_cache_dtype == "auto" or device == "Ascend" or (kernels != "portable" and dtype == "float32"),
             source, "model_config.kv_cache_dtype", f"{self.kv_cache_dtype} is held and read by the native CPU "
             "attention (scales per row) or on Ascend by PagedAttention (static scales per channel from "
             "`llm-serving calibrate-kv`): on CPU it needs dtype float32 and kernels auto or native (got "
             f"{dtype}, {kernels}); docs/quantization.md")
        direction, int8_on_npu = self.ascend_int8_kv_direction, device == "Ascend" and self.kv_cache_dtype == "int8"
        need(direction is None or direction in INT8_KV_DIRECTIONS, source, "model_config.ascend_int8_kv_direction",
             f"expected one of {', '.join(INT8_KV_DIRECTIONS)}, got {direction!r}")
        need(direction is None or int8_on_npu, source, "model_config.ascend_int8_kv_direction",
             "applies to kv_cache_dtype int8 on Ascend only (got kv_cache_dtype "
             f"{self.kv_cache_dtype}, device_target {device})")
        need(direction is not None or not int8_on_npu or self.ascend_preflight is not None, source,
             "model_config.ascend_int8_kv_direction",
             "kv_cache_dtype int8 on Ascend needs it, or a preflight verdict (model_config.ascend_preflight): "
             "whether PagedAttention multiplies the int8 cache by its antiquant scale or divides by it is "
             "unverified (vllm-mindspore passes one scale to QuantV2 and to PagedAttention); run `llm-serving "
             "preflight` on the NPU and point model_config.ascend_preflight at its verdict, or set multiply or "
             "reciprocal as it found (docs/ascend.md)")


def http_origin(url: str) -> str | None:
    """``url`` as peers are compared: ``scheme://host:port/path``, scheme and host in lower case, the port always
    written, no trailing '/'; None unless it is an http(s) URL with a host (and no user, query or fragment)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    scheme, host = parts.scheme.lower(), parts.hostname
    if scheme not in ("http", "https") or not host or parts.username is not None or parts.query or parts.fragment:
        return None
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}:{port or (443 if scheme == 'https' else 80)}{parts.path.rstrip('/')}"


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
    # the prefill engines (URLs, as the router's --prefill names them) this engine may fetch KV blocks from; a
    # request naming any other is computed here, nothing fetched (none: this engine fetches from no one)
    kv_transfer_peers: tuple[str, ...] = setting((), "strs")
    max_queue_size: int = setting(1024, "int")
    # admission by expected wait (llm_serving/engine/queue_wait.py): a request that would wait longer than this many
    # seconds to start is refused (503, Retry-After); empty (the default): no bound in time, only max_queue_size. Off
    # by default: the contest's load script and other batch-style load tests send their whole workload at once and
    # wait for every answer (minutes of queued work), which a bound would turn into refusals
    max_queue_wait_s: float | None = setting(None, "float", optional=True)
    model_aliases: tuple[str, ...] = setting(("llama2",), "strs")
    api_key: str | None = setting(None, "str", optional=True)  # Bearer key on all routes but /health
    drain_timeout_s: float = setting(30.0, "float")
    # self-healing agents (llm_serving/engine/recovery.py): a step gets step_timeout_factor x the slowest warmed-up
    # step, at least step_timeout_min_s (factor 0: no timeout); restarts back off from agent_restart_backoff_s
    step_timeout_factor: float = setting(20.0, "float")
    step_timeout_min_s: float = setting(5.0, "float")
    agent_restart_limit: int = setting(5, "int")
    agent_restart_backoff_s: float = setting(1.0, "float")
    # a standby agent pool (llm_serving/engine/standby.py): a second set of ranks started and warmed up in the
    # background, promoted when the serving ones fail (recovery in well under a second instead of a restart);
    # off by default: it holds a second copy of the agents' host memory and its start-up takes CPU from serving
    standby_agents: bool = setting(False, "bool")
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

    def validate(self, source: str) -> None:
        """The checks of these keys together (a ``ConfigError`` naming the key and ``source``)."""
        need(not isinstance(self.compile_cache, str) or not os.path.exists(self.compile_cache)
             or os.path.isdir(self.compile_cache), source, "serving_config.compile_cache",
             f"{self.compile_cache} exists and is not a directory (expected true, false or a directory path)")
        agents, local = self.effective_num_agents, self.local_agents
        need(self.num_agents is not None or len(self.agent_ports) > 0, source, "serving_config.agent_ports",
             "needs at least one entry (one per agent rank) when serving_config.num_agents is not set")
        need(self.num_agents is None or self.num_agents >= 1, source, "serving_config.num_agents",
             f"must be at least 1, got {self.num_agents}")
        need(local is None or 1 <= local <= agents, source, "serving_config.local_agents",
             f"must be in 1..num_agents ({agents}), got {local}")
        if local is not None and local < agents:
            need(self.join_address is not None, source, "serving_config.join_address",
                 f"is needed when only {local} of the {agents} ranks run here: the address of this host "
                 "(HOST:PORT) where the others join with `llm-serving agent --join`")
        if self.join_address is not None:
            try:
                split_address(self.join_address)
            except ValueError as exc:
                need(False, source, "serving_config.join_address", str(exc))
        need(not self.standby_agents or local is None or local >= agents, source, "serving_config.standby_agents",
             "every rank must run on this host (ranks on other hosts join one pool, not a second one)")
        need(not self.kv_transfer or local is None or local >= agents, source, "serving_config.kv_transfer",
             "every rank must run on this host (the KV segment is shared memory)")
        for url in self.kv_transfer_peers:
            need(http_origin(url) is not None, source, "serving_config.kv_transfer_peers",
                 f"expected http(s) URLs of prefill engines (http://HOST:PORT), got {url!r}")
        need(not self.kv_transfer_peers or self.kv_transfer, source, "serving_config.kv_transfer_peers",
             "is for engines with serving_config.kv_transfer true")
        need(0 <= self.server_port < 65536, source, "serving_config.server_port",
             f"must be 0..65535 (0: any free port), got {self.server_port}")
        need(bool(self.server_ip.strip()), source, "serving_config.server_ip", "must not be empty")
        need(self.start_device_id >= 0, source, "serving_config.start_device_id",
             f"must be >= 0, got {self.start_device_id}")
        need(self.max_queue_size >= 1, source, "serving_config.max_queue_size",
             f"must be >= 1, got {self.max_queue_size}")
        need(self.max_queue_wait_s is None or self.max_queue_wait_s > 0, source, "serving_config.max_queue_wait_s",
             f"must be > 0 (empty: no bound in time), got {self.max_queue_wait_s}")
        need(all(a.strip() for a in self.model_aliases), source, "serving_config.model_aliases",
             f"aliases must be non-empty: {list(self.model_aliases)}")
        need(self.drain_timeout_s >= 0, source, "serving_config.drain_timeout_s",
             f"must be >= 0, got {self.drain_timeout_s}")
        for key in ("step_timeout_factor", "step_timeout_min_s", "agent_restart_limit", "agent_restart_backoff_s"):
            need(getattr(self, key) >= 0, source, f"serving_config.{key}", f"must be >= 0, got {getattr(self, key)}")
        need(self.dump_logits_tokens is None or self.dump_logits_tokens >= 1, source,
             "serving_config.dump_logits_tokens",
             f"must be >= 1 (empty: every generated position), got {self.dump_logits_tokens}")


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
    def fixed_blocks(self) -> int | None:
        """``num_blocks`` as a count; None with ``auto`` (the agents size their caches)."""
        return self.num_blocks if isinstance(self.num_blocks, int) else None

    @property
    def utilization(self) -> float:
        """``memory_utilization``, 0.9 when left empty (vLLM's default)."""
        return self.memory_utilization if self.memory_utilization is not None else 0.9

    def validate(self, source: str) -> None:
        """The checks of these keys together (a ``ConfigError`` naming the key and ``source``)."""
        for key in ("block_size", "decode_seq_length") + (() if self.auto_blocks else ("num_blocks",)):
            need(getattr(self, key) > 0, source, f"pa_config.{key}", f"must be positive, got {getattr(self, key)}")
        need(self.memory_utilization is None or self.auto_blocks, source, "pa_config.memory_utilization",
             f"sizes the cache only with pa_config.num_blocks: auto (num_blocks is {self.num_blocks})")
        need(self.memory_utilization is None or 0 < self.memory_utilization <= 1, source,
             "pa_config.memory_utilization", f"must be in (0, 1], got {self.memory_utilization}")
        # block 0: padding; num_blocks auto is not known before the agents measure their memory
        blocks = self.fixed_blocks
        usable = (blocks - 1) * self.block_size if blocks is not None else self.decode_seq_length
        need(self.decode_seq_length <= usable, source, "pa_config.decode_seq_length",
             f"{self.decode_seq_length} tokens do not fit in the cache of (num_blocks - 1) * block_size = "
             f"({self.num_blocks} - 1) * {self.block_size} = {usable} tokens (block 0 is reserved for padding)")


@dataclass(frozen=True)
class TokenizerSection:
    """``tokenizer``: a SentencePiece ``tokenizer.model`` or a Hugging Face ``tokenizer.json``."""

    type: str = setting("auto", "str")
    vocab_file: str | None = setting(None, "path", optional=True)
    chat_template: str | None = setting(None, "path", optional=True)  # a Jinja file; None: the model's own
    reasoning_parser: str | None = setting(None, "str", optional=True)  # REASONING_PARSERS; None: no split

    def validate(self, source: str) -> None:
        """The checks of these keys (a ``ConfigError`` naming the key and ``source``); the files are read later."""
        need(self.type in TOKENIZER_TYPES, source, "tokenizer.type",
             f"expected one of {', '.join(TOKENIZER_TYPES)}, got {self.type!r}")
        need(self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS, source,
             "tokenizer.reasoning_parser", f"expected one of {', '.join(REASONING_PARSERS)}, got "
                                           f"{self.reasoning_parser!r}")


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

    def validate(self, source: str) -> None:
        """The checks of these keys together (a ``ConfigError`` naming the key and ``source``)."""
        need(self.policy in POLICIES, source, "scheduler.policy",
             f"expected one of {', '.join(POLICIES)}, got {self.policy!r}")
        need(self.max_wait_s >= 0, source, "scheduler.max_wait_s", f"must be >= 0, got {self.max_wait_s}")
        need(self.min_decode_steps_between_prefills >= 0, source, "scheduler.min_decode_steps_between_prefills",
             f"must be >= 0, got {self.min_decode_steps_between_prefills}")
        need(1 <= self.decode_steps <= MAX_DECODE_STEPS, source, "scheduler.decode_steps",
             f"must be in 1..{MAX_DECODE_STEPS}, got {self.decode_steps}")


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
    # draft and self: a round's proposals in one looped graph call of the draft (CPU; else one call each)
    draft_loop: bool = setting(True, "bool")

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

    def validate(self, source: str) -> None:
        """The checks of these keys together (a ``ConfigError`` naming the key and ``source``)."""
        need(self.method in SPECULATIVE_METHODS, source, "speculative.method",
             f"expected one of {', '.join(map(repr, SPECULATIVE_METHODS))}, got {self.method!r}")
        need(1 <= self.num_tokens < MAX_DECODE_STEPS, source, "speculative.num_tokens",
             f"must be in 1..{MAX_DECODE_STEPS - 1}, got {self.num_tokens}")
        need(self.min_accepted is None or self.min_accepted >= 0, source, "speculative.min_accepted",
             f"must be >= 0, got {self.min_accepted}")
        need(self.rounds is None or 1 <= self.rounds <= MAX_VERIFY_ROUNDS, source, "speculative.rounds",
             f"must be in 1..{MAX_VERIFY_ROUNDS}, got {self.rounds}")
        need(self.max_step_tokens >= 2, source, "speculative.max_step_tokens",
             f"must be >= 2 (a sequence's last token and one proposal), got {self.max_step_tokens}")
        need(1 <= self.prompt_lookup_min <= self.prompt_lookup_max, source, "speculative.prompt_lookup_min",
             f"must be >= 1 and <= prompt_lookup_max ({self.prompt_lookup_max}), got {self.prompt_lookup_min}")
        need((self.method == "draft") == (self.draft_model_path is not None), source, "speculative.draft_model_path",
             "is the draft model of method draft, and only of it")
        need((self.method == "self") == (self.draft_layers is not None), source, "speculative.draft_layers",
             "is the number of the model's own layers that draft for method self, and only for it")


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

    def validate(self, source: str) -> None:
        """The checks of these keys together (a ``ConfigError`` naming the key and ``source``); the ``LlamaConfig``
        they describe is checked with the served length (``ServingConfig``)."""
        need(self.weights in DEFAULT_WEIGHTS, source, "default_model.weights",
             f"expected one of {', '.join(DEFAULT_WEIGHTS)}, got {self.weights!r}")
        if self.weights == "trained":
            for key in RANDOM_RECIPE_KEYS:
                default = DefaultModelSection.__dataclass_fields__[key].default
                need(getattr(self, key) == default, source, f"default_model.{key}",
                     f"describes the random model (default_model.weights: random); the shipped trained model has "
                     f"its own sizes (leave it at {default})")
        for key in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size"):
            need(getattr(self, key) > 0, source, f"default_model.{key}", f"must be positive, got {getattr(self, key)}")
        need(self.seed >= 0, source, "default_model.seed", f"must be >= 0, got {self.seed}")
        if self.num_heads > 0 and self.hidden_size % self.num_heads == 0:
            need(self.hidden_size // self.num_heads % 2 == 0, source, "default_model.hidden_size",
                 f"head_dim {self.hidden_size // self.num_heads} must be even for RoPE")


SECTIONS: dict[str, type] = {
    "model_config": ModelSection,
    "serving_config": ServingSection,
    "pa_config": PagedAttentionSection,
    "tokenizer": TokenizerSection,
    "scheduler": SchedulerSection,
    "speculative": SpeculativeSection,
    "default_model": DefaultModelSection,
    "lora": LoraSection,
}
