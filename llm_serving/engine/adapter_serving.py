"""The engine's side of LoRA adapters (``core.adapters``): the registry built from ``lora.modules`` at start-up,
and the adapter steps run before the step that needs them.

A load runs when no step is in flight (the engine sends it right before a step ``schedule()`` built, never before
one sent ahead), so no step reads a slot while it is replaced. A load the agents refuse (the weights file does not
match its configuration, say) fails only the requests of that adapter: the slot is marked empty and the step goes
on, their rows computed with the empty slot and discarded.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from llm_serving.config.serving_config import ConfigError, ServingConfig
from llm_serving.core.adapters import AdapterRegistry
from llm_serving.core.scheduler import Scheduler
from llm_serving.core.sequence import Sequence
from llm_serving.engine.live_requests import LiveRequests, SequenceError
from llm_serving.executor.agent_pool import AgentStepError
from llm_serving.executor.step_pool import StepPool
from llm_serving.protocol.lora import AdapterError
from llm_serving.protocol.model_config import LlamaConfig

log = logging.getLogger(__name__)


def adapter_registry(config: ServingConfig, llama: LlamaConfig) -> AdapterRegistry | None:
    """The adapters ``lora.modules`` serves from the start, each checked (a ``ConfigError`` naming
    ``lora.modules.NAME`` and the adapter's own file and key); None without ``lora.enable``."""
    lora = config.lora
    if not lora.enable:
        return None
    registry = AdapterRegistry(llama.num_hidden_layers, lora.max_lora_rank, config.model_names)
    for name, path in lora.adapters.items():
        try:
            registry.add(name, path)
        except (AdapterError, ValueError) as exc:
            raise ConfigError(f"{config.source}: lora.modules.{name}: {exc}", key=f"lora.modules.{name}",
                              source=config.source) from None
    return registry


def lora_stats(scheduler: Scheduler, registry: AdapterRegistry) -> dict[str, Any]:
    """The adapters' part of ``Engine.stats()``: those running and waiting (vLLM's ``lora_requests_info``), the
    slots' loads and evictions, and requests admitted per adapter name."""
    def names(seqs: tuple[Sequence, ...]) -> str:
        return ",".join(sorted({seq.adapter.name for seq in seqs if seq.adapter is not None}))

    slots = scheduler.adapters
    return {"lora_max_loras": slots.num_slots if slots is not None else 0,
            "lora_running_adapters": names(scheduler.running), "lora_waiting_adapters": names(scheduler.waiting),
            "lora_adapters_served": len(registry), "lora_slot_loads": slots.loads if slots is not None else 0,
            "lora_slot_evictions": slots.evictions if slots is not None else 0,
            "lora_requests": dict(registry.requests)}


def run_adapter_loads(pool: StepPool, scheduler: Scheduler, requests: LiveRequests, lock: threading.Lock) -> None:
    """Send the adapter steps the last ``schedule()`` queued (nothing in flight), one at a time."""
    slots = scheduler.adapters
    if slots is None:
        return
    with lock:
        loads = slots.take_loads()
    for load in loads:
        try:
            pool.collect(pool.submit(load), load.batch_size)
        except AgentStepError as exc:
            log.error("loading adapter %s into slot %d failed: %s", load.path, load.slot, exc)
            with lock:
                adapter = slots.forget(load.slot)
                users = [s for s in requests.sequences() if adapter is not None and s.adapter is adapter]
                requests.fail(users, SequenceError(f"loading LoRA adapter {load.path} on the agents failed: {exc}"))
