"""One device agent process: ``python -m agents.agent_main`` (started by ``llm_serving.executor.agent_pool``).

Attach the step segment, build the model runner (or the stand-in), warm every shape bucket, report ready,
then serve: block on the command pipe for a step number, run the batch in shared memory (step ``s`` in segment
``s % segments``: two while the master keeps a second step in flight), rank 0 writes the
answer back, every rank acknowledges on its reply pipe (rank 0 naming any sequence that failed on its own,
so the master fails only that request). In a pool with ranks on other hosts the ranks but 0 take each step from
rank 0's broadcast instead (``runtime.step_source``), and a rank on another host talks to the master over one
socket (``--link-fd``, from ``llm-serving agent --join``) in place of its reply and lifeline pipes. A KV-copy step
(prefill/decode disaggregation) copies blocks between the cache and the pool's KV segment (``--kv-shm``,
``runtime.kv_copy``) instead of running the model. The agent
exits when the master closes the pipes or goes away (a watchdog thread blocks on the lifeline pipe and also
notices re-parenting), so no orphan process outlives the master. Errors are reported as frames, never as a
silent exit.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from agents.runtime.compile_cache import CompileCache, open_cache
from agents.runtime.kv_copy import KvBlockCopier
from agents.runtime.multi_step import run_decode_steps
from agents.runtime.sampler import take_failures
from agents.runtime.step_broadcast import StepBroadcast
from agents.runtime.step_runner import AdapterSlots, StepRunner
from agents.runtime.step_source import BroadcastSteps, SharedMemorySteps
from agents.runtime.verify_rounds import run_verify_rounds
from llm_serving.protocol.batch import AdapterStep, KvCopyStep, StepBatch, StepOutput
from llm_serving.protocol.kv_segment import KvSegment
from llm_serving.protocol.prompt_lookup import NgramProposer
from llm_serving.protocol.shm_channel import StepChannel
from llm_serving.protocol.step import StepKind
from llm_serving.protocol.wire import (
    DONE,
    ERROR,
    PROGRESS,
    READY,
    STARTUP_STEP,
    AgentSpec,
    done_payload,
    encode_frame,
    error_payload,
    ready_payload,
)


class Replier:
    """Writes frames to the master; a closed pipe means the master is gone, so the agent exits."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, step: int, kind: int, payload: str = "") -> None:
        data = encode_frame(step, kind, payload)
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError:
            _exit(0)

    def error(self, step: int, exc: BaseException) -> None:
        self.send(step, ERROR, error_payload(exc))


def _exit(code: int) -> None:
    """Leave at once: skip interpreter/MindSpore teardown, which can be slow and has nothing to save."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def watch_master(lifeline_fd: int, parent_pid: int, poll_s: float = 2.0) -> None:
    """Exit the process when the lifeline pipe reaches EOF or the master (our parent) is gone."""
    while True:
        readable, _, _ = select.select([lifeline_fd], [], [], poll_s)
        master_closed = bool(readable) and not os.read(lifeline_fd, 1)
        if master_closed or os.getppid() != parent_pid:
            _exit(0)


def build_runner(spec: AgentSpec, rank: int, progress: Callable[[str], None], lifeline_fd: int | None = None,
                 device_id: int | None = None, ranks_here: int | None = None) -> StepRunner:
    """The runner for this rank: the instant stand-in, or MindSpore's ModelRunner on the checkpoint (under
    tensor parallelism: on this rank's slice of it, after joining the ranks' collective cluster); ``device_id``:
    its device (default ``start_device_id + rank``); ``ranks_here``: the pool's ranks on this host, which share
    its cores and memory (default: the ranks the pool starts, ``spec.num_local_ranks``)."""
    if spec.kind == "standin":
        from agents.runtime.standin import StandinRunner
        if "num_blocks" in spec.runner_config and spec.runner_config["num_blocks"] is None:  # auto
            raise ValueError("stand-in agents have no device to size a cache from: set pa_config.num_blocks")
        layers = int(spec.llama_config["num_hidden_layers"]) if spec.lora is not None else 1  # adapters' matching
        return StandinRunner(int(spec.llama_config["vocab_size"]), spec.step_delay_s, spec.lora, layers)
    if spec.backend == "mindformers":  # MindFormers' Llama (its own environment: scripts/mindformers_env.sh)
        from agents.mindformers.runner import build_runner as build_mindformers_runner
        return build_mindformers_runner(spec, rank, progress)
    from agents.runtime.collectives import join_cluster, share_cpus
    from agents.weights.kv_scales import with_kv_scales
    from agents.weights.sharded import load_rank_weights
    from llm_serving.protocol.model_config import LlamaConfig
    from llm_serving.protocol.parallel import ShardPlan

    config = LlamaConfig(**spec.llama_config)
    shard = ShardPlan(config, spec.tensor_parallel_size, rank, spec.expert_parallel)
    ranks_here = spec.num_local_ranks if ranks_here is None else ranks_here
    cpu_threads = share_cpus(shard, ranks_here) if shard.tp > 1 else 0  # before MindSpore starts any thread
    progress(f"loading weights from {spec.model_path}" + (f" (rank {rank} of {shard.tp})" if shard.tp > 1 else ""))
    # on Ascend each tensor of a rank's slice is read into the serving dtype as it is read (bfloat16 as uint16 bits:
    # numpy has none), so no float32 copy of the slice is held; CPU backends pack from float32
    serving = spec.runner_config.get("dtype")
    on_npu = spec.runner_config.get("device_target") == "Ascend" and serving in ("float16", "bfloat16")
    host_dtype = serving if on_npu else "float32"
    quantize = spec.runner_config.get("quantization", "none") != "none"  # tp > 1: int8 slices with whole-row scales
    weights = load_rank_weights(spec.model_path, config, shard, host_dtype, quantize)  # before MindSpore: fails fast
    weights = with_kv_scales(weights, spec.model_path, config, shard, spec.runner_config)
    from agents.runtime.runner import ModelRunner, RunnerConfig
    from agents.runtime.speculative_runner import SpeculativeRunner, draft_loops, layer_prefix

    if spec.exit_layer is not None:
        progress(f"early exit: serving layers 1..{spec.exit_layer} of {config.num_hidden_layers}")
        config, weights = layer_prefix(config, weights, spec.exit_layer)
        shard = ShardPlan(config, spec.tensor_parallel_size, rank, spec.expert_parallel)
    draft_model = None
    if spec.draft is not None and "layers" in spec.draft:  # self-speculation: the target's first layers
        draft_model = layer_prefix(config, weights, int(spec.draft["layers"]))
    elif spec.draft is not None:
        draft_config = LlamaConfig(**spec.draft["llama_config"])
        progress(f"loading the draft model from {spec.draft['model_path']}")
        draft_shard = ShardPlan(draft_config, shard.tp, rank)
        draft_weights = load_rank_weights(spec.draft["model_path"], draft_config, draft_shard, host_dtype, quantize)
        draft_model = draft_config, with_kv_scales(draft_weights, spec.draft["model_path"], draft_config, draft_shard,
                                                   spec.runner_config)

    device = spec.start_device_id + rank if device_id is None else device_id
    fields = {**spec.runner_config, "device_id": device}
    utilization = fields.pop("memory_utilization", None)
    if shard.tp > 1:
        progress(f"joining the collective cluster of {shard.tp} ranks")
        setup_s, init_s = join_cluster(shard, fields, cpu_threads, lifeline_fd)
        progress(f"joined: MindSpore import and device set-up {setup_s:.2f}s, init() {init_s:.2f}s")
    if fields["num_blocks"] is None:  # pa_config.num_blocks auto
        draft_share = None if draft_model is None else (ShardPlan(draft_model[0], shard.tp, rank), draft_model[1])
        budget = size_kv_cache(fields, shard, weights, utilization, draft_share, ranks_here, spec.lora)
        progress(budget.describe())
        fields["num_blocks"] = budget.num_blocks
    runner_config = RunnerConfig(**fields)
    progress(f"building model on {runner_config.device_target} device {runner_config.device_id}")
    runner = ModelRunner(config, weights, runner_config, shard=shard, lora=spec.lora)
    if draft_model is None:
        return runner
    draft_config, draft_weights = draft_model
    progress(f"building the draft model ({draft_config.num_hidden_layers} layers)")
    loops = draft_loops(runner_config.verify_tokens, runner_config.verify_step_tokens,
                        runner_config.decode_batch_sizes) if spec.draft.get("looped", True) else ()
    draft = ModelRunner(draft_config, draft_weights, replace(runner_config, verify_tokens=0, draft_loops=loops),
                        shard=ShardPlan(draft_config, shard.tp, rank))
    return SpeculativeRunner(runner, draft)


def warm_up(runner: StepRunner, cache: CompileCache | None, spec: AgentSpec, progress: Callable[[str], None]) -> None:
    """Warm every shape: where the compile cache hit, load the graphs with their saved costs, not running them;
    a miss publishes the graphs it compiled.

    Under tensor parallelism the ranks decide together (``every_rank``, always asked so every start compiles the
    same graphs in the same order): a graph that runs waits in its collectives for every other rank to run it,
    so one rank loading while another runs (one rank's cache evicted or unwritable) would hang both. Such a
    start runs every shape on every rank; the graphs still load from a rank's cache where it has one."""
    hit = cache is not None and cache.hit
    if spec.kind == "llama" and spec.backend == "ms" and spec.tensor_parallel_size > 1:
        from agents.model.parallel import every_rank
        if every_rank(hit, spec.tensor_parallel_size) != hit:
            progress("compile cache hit here but not on every rank: running every shape")
            hit = False
    runner.warmup(progress, known_costs=cache.costs if hit and cache is not None else None)
    if cache is not None:
        cache.commit(runner.step_costs)


def size_kv_cache(fields: dict, shard, weights: dict, utilization: float, draft: tuple | None = None,
                  ranks_here: int = 1, lora: dict | None = None):
    """This rank's KV blocks from its device's memory (``agents.runtime.kv_budget``), on the device it serves on;
    ``draft``: (shard plan, weights) of a draft model, whose cache has as many blocks as the target's;
    ``ranks_here``: the ranks sharing this host (on CPU, its memory); ``lora``: ``AgentSpec.lora``, whose adapter
    slots are held like weights (``protocol.lora_budget``)."""
    from agents.runtime import kv_budget
    from agents.runtime.device import setup_device
    from llm_serving.protocol.lora_budget import lora_pool_bytes
    from llm_serving.protocol.parallel import kv_block_bytes

    target = fields["device_target"]
    setup_device(target, fields["device_id"], fields.get("device_environment"), fields.get("max_device_memory"))
    dtype, block_size, max_len = fields["dtype"], fields["block_size"], fields["max_model_len"]
    batch = max(fields["decode_batch_sizes"][-1], fields["prefill_batch_sizes"][-1])
    tokens = max(fields["max_num_batched_tokens"] or 0, fields["prefill_batch_sizes"][-1]
                 * fields["prefill_seq_lengths"][-1], max_len) + batch  # the largest step, its appended rows
    device = kv_budget.device_memory_bytes(target, fields["device_id"])
    if target == "CPU":  # the ranks on this host share its memory
        device //= ranks_here
    kv_dtype = fields.get("kv_cache_dtype", "auto")
    per_block = kv_block_bytes(shard, block_size, dtype, kv_dtype, target)
    quantized = fields.get("quantization", "none") != "none"
    held = kv_budget.weight_bytes(weights, dtype, quantized) + lora_pool_bytes(shard, lora, dtype)
    if draft is not None:
        per_block += kv_block_bytes(draft[0], block_size, dtype, kv_dtype, target)
        held += kv_budget.weight_bytes(draft[1], dtype, quantized)
    return kv_budget.plan_blocks(
        device, utilization, held,
        kv_budget.step_reserve_bytes(shard, tokens, batch + 1, dtype, fields["device_target"]),
        per_block, block_size, max_len)


def serve(steps: SharedMemorySteps | BroadcastSteps, runner: StepRunner, replier: Replier, rank: int,
          block_size: int | None, copier: KvBlockCopier | None = None, lookup: NgramProposer | None = None,
          adapters: AdapterSlots | None = None) -> None:
    """Run steps until the master closes the command pipe or sends a negative step number, or rank 0 broadcasts
    the end (a batch of several decode steps: ``multi_step``; of several verify rounds: ``verify_rounds``, with
    ``lookup`` for prompt lookup; one that feeds the tokens of the step before: ``fed_inputs``; a KV-copy step:
    ``copier``, the pool's KV segment; an adapter step: ``adapters``, the runner's LoRA slots)."""
    picked: np.ndarray | None = None  # the last step's tokens, row for row: what a step after it may be fed
    while (number := steps.next_step()) is not None:
        try:
            fed, picked = picked, None
            step = steps.read_step(number)
            if isinstance(step, AdapterStep):
                if adapters is None:  # the pool sends one only when AgentSpec.lora gave the agents slots
                    raise RuntimeError("an adapter step reached an agent started without adapter slots")
                adapters.load_adapter(step.slot, step.path)
                if rank == 0:
                    steps.write_output(number, StepOutput(np.zeros(0, np.int32), np.zeros(0, np.float32)))
                replier.send(number, DONE)
                continue
            if isinstance(step, KvCopyStep):
                if copier is None:
                    raise RuntimeError("a KV-copy step reached an agent started without a KV segment")
                copier.run(step)
                del step
                if rank == 0:
                    steps.write_output(number, StepOutput(np.zeros(0, np.int32), np.zeros(0, np.float32)))
                replier.send(number, DONE)
                continue
            if step.feeds_previous:
                step = replace(step, input_ids=fed_inputs(fed, step), fed_rows=None)
            output = run_step(runner, step, block_size, lookup)
            failed = take_failures(step.sampling, output.token_ids)  # sequences that failed on their own
            del step  # views into shared memory: never keep them past the step
            picked = last_picks(output)
            if rank == 0:
                steps.write_output(number, output)
        except Exception as exc:  # noqa: BLE001 - the master decides; this agent keeps serving
            replier.error(number, exc)
            continue
        replier.send(number, DONE, done_payload(failed) if rank == 0 else "")


def run_step(runner: StepRunner, batch: StepBatch, block_size: int | None, lookup: NgramProposer | None) -> StepOutput:
    """One step of the master's: one model step, or the rounds of several decode steps or verify rounds."""
    if batch.num_steps == 1:
        return runner.step(batch)
    if batch.kind is StepKind.DECODE:
        looped = getattr(runner, "decode_steps", None)  # ModelRunner's looped graphs (``runtime.looped_decode``)
        output = looped(batch) if looped is not None else None
        return output if output is not None else run_decode_steps(runner.step, batch, block_size)
    if batch.kind is not StepKind.VERIFY:
        raise ValueError(f"a {batch.kind.name} step runs one round, not {batch.num_steps}")
    return run_verify_rounds(runner.step, batch, block_size, lookup)


def fed_inputs(picked: np.ndarray | None, batch: StepBatch) -> np.ndarray:
    """A fed step's input ids: this agent's picks of the step before at the rows ``batch.fed_rows`` names (every
    tensor-parallel rank picks the same greedy tokens, ``model.parallel.greedy``, so each feeds its own)."""
    if picked is None:
        raise RuntimeError("the step before failed or returned no tokens to feed this step's inputs")
    rows = batch.fed_rows
    fed = rows >= 0  # a mixed step's other rows are prompt chunks with their own ids
    if fed.any() and int(rows.max()) >= picked.shape[0]:
        raise RuntimeError(f"this step feeds rows {rows[fed].min()}..{rows.max()} of the step before, which picked "
                           f"{picked.shape[0]} tokens")
    picks = np.maximum(picked[rows[fed]], 0).astype(np.int32)  # a row that failed on its own: its sequence ends
    if fed.all() and batch.num_tokens == rows.shape[0]:
        return picks
    ids = np.array(batch.input_ids, np.int32)  # a copy: the batch is a view into shared memory
    ids[(np.cumsum(batch.query_lens) - batch.query_lens)[fed]] = picks  # a fed row's one token
    return ids


def last_picks(output: StepOutput) -> np.ndarray | None:
    """Each row's last token of a step (a multi-step batch's last step's); None after a verify step, whose
    rows end at different depths (the master never feeds one)."""
    if output.num_more is not None:
        return None
    if output.more_token_ids is not None and output.more_token_ids.shape[1]:
        return output.more_token_ids[:, -1].copy()
    return np.array(output.token_ids, np.int32)


def release_freed_memory() -> None:
    """Hand the heap memory freed since start (weight loading's temporaries, warm-up's host arrays) back to the
    system: glibc keeps freed heap pages resident otherwise, and under tensor parallelism the slicing leaves
    more of them (docs/model.md, tensor parallelism)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def freeze_startup_objects() -> None:
    """Leave everything alive after warm-up (MindSpore's and our modules, the model and its graphs) out of
    Python's cyclic garbage collection from now on: its collections otherwise walk those objects again and again
    between steps, ~0.2-0.5 ms of a bench-model decode step (docs/benchmarks.md, "Fixed cost of a decode step").
    Objects made while serving are collected as usual."""
    gc.collect()
    gc.freeze()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="llm-serving device agent (started by the master)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--spec", required=True, help="AgentSpec as JSON")
    parser.add_argument("--shm", help="names of the step shared-memory segments, comma-separated (ranks on the "
                        "master's host)")
    parser.add_argument("--cmd-fd", type=int)
    parser.add_argument("--reply-fd", type=int)
    parser.add_argument("--lifeline-fd", type=int)
    parser.add_argument("--link-fd", type=int, help="a socket connected to the master, instead of the reply and "
                        "lifeline pipes (a rank on another host: `llm-serving agent --join`)")
    parser.add_argument("--kv-shm", help="name of the pool's KV segment (prefill/decode disaggregation)")
    parser.add_argument("--device-id", type=int, help="this rank's device (default: start_device_id + rank)")
    parser.add_argument("--ranks-here", type=int, help="the pool's ranks on this host, sharing its cores (default: "
                        "the ranks the master starts)")
    args = parser.parse_args(argv)
    reply_fd = args.reply_fd if args.link_fd is None else args.link_fd
    lifeline_fd = args.lifeline_fd if args.link_fd is None else args.link_fd
    if reply_fd is None or lifeline_fd is None:
        parser.error("give --reply-fd and --lifeline-fd, or --link-fd")

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the master's to handle; it then closes us
    threading.Thread(target=watch_master, args=(lifeline_fd, os.getppid()), daemon=True,
                     name="watch-master").start()
    replier = Replier(reply_fd)

    def progress(line: str) -> None:
        replier.send(STARTUP_STEP, PROGRESS, line)

    cache = None
    try:
        spec = AgentSpec.from_json(args.spec)
        follows = spec.has_remote_ranks and args.rank > 0  # its steps come from rank 0, not shared memory
        if not follows and (args.shm is None or args.cmd_fd is None):
            raise ValueError(f"rank {args.rank} reads its steps from the master: it needs --shm and --cmd-fd")
        channels = [] if follows else [StepChannel.attach(name, spec.layout) for name in args.shm.split(",")]
        cache = open_cache(spec, args.rank, progress)  # before the first graph compiles
        runner = build_runner(spec, args.rank, progress, lifeline_fd, args.device_id, args.ranks_here)
        warm_up(runner, cache, spec, progress)
        copier = None
        if spec.kv_transfer:
            if args.kv_shm is None:
                raise ValueError("a pool with KV transfer starts its agents with --kv-shm")
            segment = KvSegment.attach(args.kv_shm, spec.tensor_parallel_size, spec.kv_block_bytes,
                                       spec.kv_segment_blocks)
            copier = KvBlockCopier.of_runner(runner, segment, args.rank)
        adapters = None
        if spec.lora is not None:
            if not isinstance(runner, AdapterSlots):
                raise ValueError(f"{type(runner).__name__} serves no LoRA adapters (AgentSpec lora)")
            adapters = runner
        broadcast = StepBroadcast() if spec.has_remote_ranks else None
        steps = BroadcastSteps(broadcast) if follows else SharedMemorySteps(channels, args.cmd_fd, broadcast)
        freeze_startup_objects()
        release_freed_memory()
    except BaseException as exc:  # noqa: BLE001 - any start-up failure must reach the master as text
        if cache is not None:
            cache.discard()
        replier.error(STARTUP_STEP, exc)
        _exit(1)
    costs = runner.step_costs  # seconds per warmed shape: the step timeout's base
    replier.send(STARTUP_STEP, READY, ready_payload(max(costs.values()) if costs else None, runner.num_blocks))
    lookup = None if spec.prompt_lookup is None else NgramProposer(*spec.prompt_lookup)
    serve(steps, runner, replier, args.rank, spec.runner_config.get("block_size"), copier, lookup, adapters)
    _exit(0)


if __name__ == "__main__":
    main()
