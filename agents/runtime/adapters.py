"""The host side of a model's LoRA adapter slots (``agents.model.lora``): loading an adapter into a slot, and telling
the graphs before each step which slot every row's tokens use.

Loading writes the slot's columns of every layer's stacked ``A`` and ``B`` with ``Parameter.set_data``: the
compiled graphs read the new values on their next call, nothing is recompiled. Everything is read and checked
before the first write, so an adapter that does not fit leaves the slot as it was. Host float32 copies of the
stacked weights are kept so that a slot is written without reading the device's (any dtype) back.
"""

from __future__ import annotations

from collections.abc import Iterator

import mindspore as ms
import numpy as np
from mindspore import Tensor

from agents.model.llama import LlamaModel
from agents.model.lora import LoraShape, LoraSlotWeights, LoraUpdate
from agents.weights.lora_weights import LoraPair, load_lora_weights
from agents.weights.packed import swiglu_rows
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.lora import LoraConfig
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.parallel import ShardPlan


class AdapterSlotTable:
    """A model's adapter slots: ``load`` fills or empties one, ``route`` prepares a step."""

    def __init__(self, model: LlamaModel, config: LlamaConfig, shard: ShardPlan, shape: LoraShape) -> None:
        if model.lora_masks is None:
            raise ValueError("the model was built without LoRA adapter slots")
        self.model, self.config, self.shard, self.shape = model, config, shard, shape
        self.blocks = np.full(model.lora_masks.blocks.shape[0], -1, np.int32)  # each KV block's slot, -1 base
        self.blocks_clean = True  # every entry -1: a step without adapters need not write the table
        # projections that add the update themselves are native panels: gate/up rows in their SwiGLU panel order
        self.interleaved = model.layers[0].lora.fused
        self.host = {name: (np.zeros(update.shapes[0], np.float32), np.zeros(update.shapes[1], np.float32))
                     for name, update in self._updates()}

    def _updates(self) -> Iterator[tuple[str, LoraUpdate | LoraSlotWeights]]:
        for i, layer in enumerate(self.model.layers):
            for kind, update in layer.lora.updates().items():
                yield f"layers.{i}.{kind}", update

    def load(self, slot: int, path: str | None) -> None:
        """Put the PEFT adapter at ``path`` into ``slot`` (None: empty it); ``ValueError`` (an ``AdapterError``
        where the adapter itself is at fault) naming the problem, the slot untouched, when it does not fit."""
        if not 0 <= slot < self.shape.max_loras:
            raise ValueError(f"adapter slot {slot} is not one of the {self.shape.max_loras} slots (max_loras)")
        pairs: dict[str, LoraPair] = {}
        if path is not None:
            lora = LoraConfig.from_dir(path, self.config.num_hidden_layers)
            too_large = [m for m in lora.modules if m.rank > self.shape.max_lora_rank]
            if too_large:
                m = too_large[0]
                raise ValueError(f"adapter {path}: layer {m.layer} {m.target} has rank {m.rank}, above the slots' "
                                 f"max_lora_rank {self.shape.max_lora_rank}")
            pairs = load_lora_weights(path, lora, self.config, self.shard)
        for name, update in self._updates():
            width = self.shape.width(name.rsplit(".", 1)[1])
            a, b = self.host[name]
            a[slot * width: (slot + 1) * width] = 0
            b[:, slot * width: (slot + 1) * width] = 0
            pair = pairs.get(name)
            if pair is not None:
                rank = pair.a.shape[0]
                a[slot * width: slot * width + rank] = pair.a
                interleaved = self.interleaved and name.endswith("w_gate_up")
                b[:, slot * width: slot * width + rank] = swiglu_rows(pair.b) if interleaved else pair.b
            update.store(a, b)

    def route(self, batch: StepBatch) -> None:
        """Before ``batch``'s graph calls: every block of each row's table (those its tokens write included, and a
        multi-step decode's later ones) names the row's slot; block 0, the padding rows', none. A step without
        adapters finds (or leaves) the whole table -1."""
        if batch.lora_slots is None:
            if self.blocks_clean:
                return
            self.blocks[:] = -1
        else:
            self.blocks[batch.block_tables] = batch.lora_slots.reshape(-1, 1)
            self.blocks[0] = -1
        self.blocks_clean = batch.lora_slots is None
        self.model.lora_masks.blocks.set_data(Tensor(self.blocks, ms.int32))
