"""The pipe protocol between the master and its agent processes, and the ``AgentSpec`` they start from.

Per step the master writes the batch into shared memory (``shm_channel``) and a ``CMD`` step number to every
rank's command pipe; each rank answers with a ``FRAME`` on its reply pipe. Frames also carry start-up progress,
readiness (with the slowest warmed-up step's time) and errors (a JSON payload with the summary and the
agent's traceback); rank 0's DONE frame names the sequences that failed on their own, if any. A rank on another
host sends the same frames over the socket it joined on (``llm_serving.executor.rank_join``).
"""

from __future__ import annotations

import json
import struct
import traceback
from dataclasses import asdict, dataclass, field

from llm_serving.protocol.model_config import JsonObject, LlamaConfig
from llm_serving.protocol.parallel import ShardPlan, kv_block_bytes
from llm_serving.protocol.shm_channel import ChannelLayout

KINDS = ("llama", "standin")
BACKENDS = ("ms", "mindformers")  # model_config.backend

CMD = struct.Struct("<q")  # master -> agent: step number to run; a negative number means "exit"
FRAME = struct.Struct("<qii")  # agent -> master: (step, kind, payload length) + utf-8 payload
DONE, PROGRESS, READY, ERROR = 0, 1, 2, 3
STARTUP_STEP = -1  # step number of frames sent before the agent is ready


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv4 address or a host name; the port 1..65535) as (host, port); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or ":" in host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT (an IPv4 address or a host name, the port 1..65535), got {address!r}")
    return host, int(port)


def encode_frame(step: int, kind: int, payload: str = "") -> bytes:
    data = payload.encode("utf-8", "replace")
    return FRAME.pack(step, kind, len(data)) + data


def error_payload(exc: BaseException) -> str:
    """An ERROR frame's payload for ``exc`` (call inside the ``except`` block, for the traceback)."""
    return json.dumps({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


def parse_error_payload(payload: str) -> tuple[str, str]:
    """(one-line summary, traceback) of an ERROR frame's payload."""
    try:
        data = json.loads(payload)
        return str(data["error"]), str(data.get("traceback", ""))
    except (ValueError, KeyError, TypeError):
        return payload, ""


def ready_payload(slowest_step_s: float | None, num_blocks: int | None = None) -> str:
    """A READY frame's payload: the slowest warmed-up step (seconds), which the master's step timeout is
    derived from, and the KV blocks the agent's cache holds (the count ``pa_config.num_blocks: auto`` sized)."""
    return json.dumps({"slowest_step_s": slowest_step_s, "num_blocks": num_blocks})


def parse_ready_payload(payload: str) -> tuple[float | None, int | None]:
    """``(slowest_step_s, num_blocks)``, None for what the payload leaves out."""
    try:
        values = json.loads(payload) if payload else {}
        slowest, blocks = values.get("slowest_step_s"), values.get("num_blocks")
        return (float(slowest) if slowest is not None else None), (int(blocks) if blocks is not None else None)
    except (ValueError, AttributeError, TypeError):
        return None, None


def done_payload(failed: dict[int, str]) -> str:
    """A DONE frame's payload: why the rows marked ``FAILED_TOKEN`` failed ("" when none did)."""
    return json.dumps({"failed": {str(row): reason for row, reason in failed.items()}}) if failed else ""


def parse_done_payload(payload: str) -> dict[int, str]:
    try:
        return {int(row): str(reason) for row, reason in json.loads(payload)["failed"].items()} if payload else {}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}


KV_SEGMENT_BYTES = 256 << 20  # the KV segment's default size at most (AgentSpec.kv_segment_blocks)


@dataclass(frozen=True)
class AgentSpec:
    """Everything an agent process needs to start; JSON-able so it travels on the command line.

    ``tensor_parallel_size`` is the number of ranks the pool starts for this model. Every rank receives the
    same batch and acknowledges each step; rank 0 writes the answer. Until the ranks shard the model each of
    them holds all of it.
    """

    kind: str  # "llama" (MindSpore ModelRunner) or "standin" (answers instantly, no MindSpore)
    model_path: str | None  # HF dir / converted dir / .ckpt / .safetensors for kind="llama"
    llama_config: JsonObject  # llm_serving.protocol.model_config.LlamaConfig fields
    runner_config: JsonObject  # agents.runtime.runner.RunnerConfig fields (device_id is set per rank)
    max_tokens: int  # shm capacity: max tokens in one step
    max_batch: int  # shm capacity: max sequences in one step
    max_blocks_per_seq: int  # shm capacity: block-table width
    max_penalty_tokens: int | None = None  # shm capacity: repetition-penalty ids per step (None: max_tokens)
    max_logits_rows: int = 0  # shm capacity: sequences per step whose float32 logits come back (0: none)
    max_decode_steps: int = 1  # shm capacity: tokens one sequence may get from a step (decode steps, verify rounds)
    tensor_parallel_size: int = 1  # ranks of this model, one agent process each
    expert_parallel: bool = False  # a MoE model's experts split whole over those ranks (ShardPlan.expert_parallel)
    start_device_id: int = 0  # rank r runs on device start_device_id + r
    step_delay_s: float = 0.0  # standin only: simulated compute time per step
    # environment variables for the agent processes (each value as str() writes it)
    extra_env: dict[str, object] = field(default_factory=dict)
    # model_config.backend: "ms" (our Llama graph, agents.runtime.runner) or "mindformers" (MindFormers' Llama built
    # from the predict YAML model_cfg_path, agents.mindformers.runner)
    backend: str = "ms"
    model_cfg_path: str | None = None
    # root of the agents' graph compile caches (agents.runtime.compile_cache: one directory per configuration and code
    # under it); None: compile every shape at each start
    compile_cache_dir: str | None = None
    # LoRA adapters per request: {"max_loras": n, "max_lora_rank": r}, the graphs hold n adapter slots of rank up to
    # r (``batch.AdapterStep`` fills one, ``StepBatch.lora_slots`` picks them per row); None: no adapters and
    # nothing added to the graphs
    lora: JsonObject | None = None
    # early exit: serve the model's first exit_layer layers (then its final norm and lm_head); None: all of them
    exit_layer: int | None = None
    # speculative decoding with a draft in the agents (agents.runtime.speculative_runner):
    # {"model_path", "llama_config"} of a draft model, or {"layers": n} for the target's own first n layers
    # (self-speculation), with "looped": a round's proposals in one looped draft call; None: no draft
    draft: JsonObject | None = None
    # [min n, max n] of prompt lookup (speculative method ngram): the agents propose in a verify step's later rounds
    # (agents.runtime.verify_rounds); None: not prompt lookup
    prompt_lookup: list[int] | None = None
    # steps the master may send before collecting the first: 2 with asynchronous scheduling (the next decode step
    # sent while one runs); one shared-memory segment each, step s in segment s % steps_in_flight
    steps_in_flight: int = 1
    # ranks the pool starts on the master's host (0 .. local_ranks-1; None: all of them); the others run on other
    # hosts and join the pool at join_address ("HOST:PORT", `llm-serving agent --join`), which is also where the
    # ranks' collective scheduler listens. Then rank 0 broadcasts each step to them (agents.runtime.step_broadcast)
    local_ranks: int | None = None
    join_address: str | None = None
    # prefill/decode disaggregation: a KV segment beside the step segments (protocol.kv_segment) through which
    # KV-copy steps export and import whole blocks
    kv_transfer: bool = False
    kv_segment_bytes: int = KV_SEGMENT_BYTES  # the KV segment's size at most (kv_segment_blocks)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"AgentSpec.kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "llama" and not self.model_path:
            raise ValueError("AgentSpec.model_path is required for kind 'llama'")
        if "vocab_size" not in self.llama_config:
            raise ValueError("AgentSpec.llama_config needs at least 'vocab_size'")
        if self.backend not in BACKENDS:
            raise ValueError(f"AgentSpec.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "mindformers" and not self.model_cfg_path:
            raise ValueError("AgentSpec.model_cfg_path is required for backend 'mindformers'")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"AgentSpec.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.steps_in_flight not in (1, 2):
            raise ValueError(f"AgentSpec.steps_in_flight must be 1 or 2, got {self.steps_in_flight}")
        if self.local_ranks is not None and not 1 <= self.local_ranks <= self.tensor_parallel_size:
            raise ValueError(f"AgentSpec.local_ranks must be in 1..{self.tensor_parallel_size}, got {self.local_ranks}")
        if self.has_remote_ranks and (self.kind != "llama" or self.backend != "ms"):
            raise ValueError("ranks on other hosts need MindSpore agents of our Llama (kind llama, backend ms): "
                             "they get each step through its collectives")
        if self.has_remote_ranks and not self.join_address:
            raise ValueError("AgentSpec.join_address is required when some ranks run on other hosts")
        if self.kv_transfer and (self.kind != "llama" or self.backend != "ms" or self.has_remote_ranks
                                 or self.exit_layer is not None or self.draft is not None):
            raise ValueError("KV transfer needs MindSpore agents of our Llama (kind llama, backend ms), all ranks on "
                             "this host, no early exit and no draft model")
        _ = self.layout  # validates the capacities

    @property
    def join_host_port(self) -> tuple[str, int]:
        """``join_address`` as (host, port)."""
        if self.join_address is None:
            raise ValueError("AgentSpec.join_address is not set")
        return split_address(self.join_address)

    @property
    def num_local_ranks(self) -> int:
        return self.tensor_parallel_size if self.local_ranks is None else self.local_ranks

    @property
    def has_remote_ranks(self) -> bool:
        """Some ranks run on other hosts: they cannot read the master's shared memory, rank 0 forwards each step."""
        return self.num_local_ranks < self.tensor_parallel_size

    @property
    def layout(self) -> ChannelLayout:
        return ChannelLayout(self.max_tokens, self.max_batch, self.max_blocks_per_seq, self.max_penalty_tokens,
                             self.max_logits_rows, int(self.llama_config["vocab_size"]), self.max_decode_steps)

    @property
    def kv_segment_blocks(self) -> int:
        """Blocks one KV-copy step moves (a longer prompt's take several): the KV segment is at most
        ``kv_segment_bytes`` (one block per rank at least), not one sequence's whole cache (4 GiB for a 7B model's
        4096 tokens in float32)."""
        per_block = self.tensor_parallel_size * self.kv_block_bytes
        return max(1, min(self.max_blocks_per_seq, self.kv_segment_bytes // per_block))

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block in each rank's cache (``parallel.kv_block_bytes``)."""
        rc = self.runner_config
        return kv_block_bytes(ShardPlan(LlamaConfig(**self.llama_config), self.tensor_parallel_size,
                                        expert_parallel=self.expert_parallel),
                              int(rc["block_size"]), rc.get("dtype", "float32"), rc.get("kv_cache_dtype", "auto"),
                              rc.get("device_target", "CPU"))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> AgentSpec:
        return cls(**json.loads(text))
