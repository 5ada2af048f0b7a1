"""LoRA adapters in the master: which are served (by name) and which of the agents' adapter slots holds which.

``AdapterRegistry``: name -> ``Adapter`` (its directory, checked ``LoraConfig``, load generation). A request whose
``model`` names an adapter carries the ``Adapter`` object itself (``Sequence.adapter``), so unloading a name takes it
from the API at once while the requests that chose it finish with it (deferred unload: its slot is reused only once
none of them holds it). Each load gets a new generation, which salts its prompt blocks' prefix-cache keys: a prompt
under one adapter never hits the blocks of the base model, of another adapter, or of an earlier load of the same
name (its K/V differ wherever ``wq``/``wk``/``wv`` or an earlier layer is adapted).

``AdapterSlots``: the agents hold ``max_loras`` slots (``AgentSpec.lora``). A running sequence pins its adapter's
slot from admission until it stops running (finished or preempted); a slot no sequence pins stays loaded, idle, in
least-recently-used order, so a returning adapter finds it still there, and the LRU idle slot is the one reloaded
for an adapter that has none (vLLM's LRU adapter cache). A sequence whose adapter finds no slot waits in the queue;
since every running sequence pins a slot, no step computes more than ``max_loras`` distinct adapters. A load is an
``AdapterStep`` queued here and sent by the engine before the step that admits the sequence
(``take_loads``), when no step is in flight, so no step in flight ever reads a slot being replaced.
"""

from __future__ import annotations

import itertools
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from llm_serving.protocol.batch import AdapterStep
from llm_serving.protocol.lora import ADAPTER_WEIGHTS, AdapterError, LoraConfig

_GENERATIONS = itertools.count(1)
# an adapter's name is a model id in the API: printable, no spaces or '=' (the --lora-modules separator)
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")


@dataclass(frozen=True, eq=False)
class Adapter:
    """One load of a served adapter; compared by identity (a reload under the same name is another adapter)."""

    name: str
    path: str
    config: LoraConfig
    generation: int

    @property
    def cache_salt(self) -> bytes:
        """The seed of its prompt blocks' prefix-cache keys (``prefix_cache.extend_block_hashes``)."""
        return f"lora\0{self.name}\0{self.generation}".encode()


class AdapterRegistry:
    """The adapters served, by name; checked against the model's ``num_layers`` and the slots' ``max_rank``."""

    def __init__(self, num_layers: int, max_rank: int, base_names: tuple[str, ...] = ()) -> None:
        self.num_layers = num_layers
        self.max_rank = max_rank
        self.base_names = base_names
        self._adapters: dict[str, Adapter] = {}
        self.requests: dict[str, int] = {}  # requests admitted per adapter name (metrics)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    @property
    def adapters(self) -> list[Adapter]:
        return list(self._adapters.values())

    def check(self, name: str, path: str | Path) -> Adapter:
        """The adapter in ``path`` as it would be served under ``name`` (not added); AdapterError naming the file
        and key when it cannot be, ValueError for a name already taken."""
        if ADAPTER_NAME.fullmatch(name) is None:
            raise ValueError(f"adapter name {name!r}: 1-128 letters, digits and ._:/@+- (it is a model id)")
        if name in self.base_names:
            raise ValueError(f"{name!r} is the base model's name; an adapter needs a name of its own")
        if name in self._adapters:
            raise ValueError(f"an adapter named {name!r} is already loaded (unload it first)")
        config = LoraConfig.from_dir(path, self.num_layers)
        if config.max_rank > self.max_rank:
            worst = max(config.modules, key=lambda m: m.rank)
            raise AdapterError(f"{Path(path) / 'adapter_config.json'}: r {worst.rank} (layer {worst.layer} "
                               f"{worst.target}) is above max_lora_rank {self.max_rank} (lora.max_lora_rank, "
                               "--max-lora-rank: the slots' size)")
        if not (Path(path) / ADAPTER_WEIGHTS).is_file():
            raise AdapterError(f"{path}: no {ADAPTER_WEIGHTS} (a PEFT LoRA adapter directory has it)")
        return Adapter(name, str(path), config, next(_GENERATIONS))

    def add(self, name: str, path: str | Path) -> Adapter:
        """Check and serve the adapter in ``path`` under ``name`` (``check``'s errors)."""
        return self.put(self.check(name, path))

    def put(self, adapter: Adapter) -> Adapter:
        """Serve an adapter ``check`` made; ValueError if its name was taken meanwhile."""
        if adapter.name in self._adapters:
            raise ValueError(f"an adapter named {adapter.name!r} is already loaded (unload it first)")
        self._adapters[adapter.name] = adapter
        return adapter

    def remove(self, name: str) -> Adapter:
        """Stop serving ``name`` (KeyError if it is not served); requests holding it keep it until they end."""
        return self._adapters.pop(name)


class AdapterSlots:
    """Which adapter each of ``num_slots`` agent slots holds, and which sequences pin them (module docstring)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"adapter slots: need at least one, got {num_slots}")
        self.num_slots = num_slots
        self._held: list[Adapter | None] = []
        self._slot_of: dict[Adapter, int] = {}
        self._pins: list[int] = []
        self._idle: OrderedDict[int, None] = OrderedDict()  # unpinned slots, least recently used first
        self._loads: list[AdapterStep] = []
        self._empty()
        self.loads = 0  # adapter steps queued in all (the tests and stats read it)
        self.evictions = 0  # loads that replaced another adapter

    def slot_of(self, adapter: Adapter) -> int | None:
        return self._slot_of.get(adapter)

    def holder(self, slot: int) -> Adapter | None:
        return self._held[slot]

    def pins(self, slot: int) -> int:
        return self._pins[slot]

    def acquire(self, adapter: Adapter, may_load: bool = True) -> int | None:
        """Pin ``adapter``'s slot for one running sequence: the slot holding it, else (``may_load``) the first empty
        or least recently used idle one, its load queued; None when it must wait (every slot pinned by others, or a
        load not allowed now)."""
        slot = self._slot_of.get(adapter)
        if slot is None:
            if not may_load or not self._idle:
                return None
            slot = next((s for s in self._idle if self._held[s] is None), next(iter(self._idle)))
            old = self._held[slot]
            if old is not None:
                del self._slot_of[old]
                self.evictions += 1
            self._held[slot] = adapter
            self._slot_of[adapter] = slot
            self._loads.append(AdapterStep(slot, adapter.path))
            self.loads += 1
        if self._pins[slot] == 0:
            del self._idle[slot]
        self._pins[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """A sequence pinning ``slot`` stopped running; the last one leaves it loaded and idle (most recent)."""
        if self._pins[slot] < 1:
            raise RuntimeError(f"adapter slot {slot} released more often than acquired")
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._idle[slot] = None

    def take_loads(self) -> list[AdapterStep]:
        """The adapter steps queued since the last call, to run before the next model step."""
        loads, self._loads = self._loads, []
        return loads

    def forget(self, slot: int) -> Adapter | None:
        """Mark ``slot`` empty (its load failed); returns the adapter it was to hold."""
        adapter = self._held[slot]
        if adapter is not None:
            del self._slot_of[adapter]
            self._held[slot] = None
        self._loads = [load for load in self._loads if load.slot != slot]
        return adapter

    def reset(self) -> None:
        """New agents hold no adapters: every slot empty (no sequence runs, so none is pinned)."""
        if any(self._pins):
            raise RuntimeError("adapter slots reset while sequences still run on them")
        self._empty()

    def _empty(self) -> None:
        n = self.num_slots
        self._held, self._pins, self._loads = [None] * n, [0] * n, []
        self._slot_of.clear()
        self._idle = OrderedDict((s, None) for s in range(n))
