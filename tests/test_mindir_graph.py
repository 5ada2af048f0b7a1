"""Reading an exported graph node by node (``agents.tools.mindir.read_graph``): each fused op's attributes as the
constants MindSpore 2.10 passes them, and what feeds each of its inputs. This is what a check of an op's real
contract needs and an export alone does not give: whether a length input is a named graph input (as the
internal Ascend kernels read it) or a tensor computed in the graph, and whether heads and kv heads were swapped.
"""

from __future__ import annotations

import numpy as np
import pytest
from mindspore import Parameter, Tensor, export, nn, ops
from mindspore.ops.auto_generate import PagedAttention, ReshapeAndCache

from agents.tools.mindir import Source, TensorInfo, read_graph

HEADS, KV_HEADS, HEAD_DIM, BLOCKS, BLOCK_SIZE, BATCH = 4, 2, 32, 8, 16, 4


class CacheThenAttend(nn.Cell):
    """ReshapeAndCache then PagedAttention, the decode pattern of the Ascend backend; ``clamp`` computes the
    context lengths in the graph instead of passing the graph input on."""

    def __init__(self, heads: int, kv_heads: int, clamp: bool) -> None:
        super().__init__()
        self.attend = PagedAttention(heads, HEAD_DIM ** -0.5, kv_heads)
        self.write = ReshapeAndCache()
        self.clamp = clamp
        shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.key_cache = Parameter(Tensor(np.zeros(shape, np.float16)), name="key_cache")
        self.value_cache = Parameter(Tensor(np.zeros(shape, np.float16)), name="value_cache")

    def construct(self, query, key, value, slot_mapping, block_tables, batch_valid_length):
        written = self.write(key, value, self.key_cache, self.value_cache, slot_mapping)
        query = ops.depend(query, written)
        lens = ops.maximum(batch_valid_length, 1) if self.clamp else batch_valid_length
        return self.attend(query, self.key_cache, self.value_cache, block_tables, lens)


def export_graph(tmp_path, heads: int = HEADS, kv_heads: int = KV_HEADS, clamp: bool = False):
    inputs = [np.zeros((BATCH, 1, HEADS * HEAD_DIM), np.float16), np.zeros((BATCH, KV_HEADS * HEAD_DIM), np.float16),
              np.zeros((BATCH, KV_HEADS * HEAD_DIM), np.float16), np.zeros(BATCH, np.int32),
              np.zeros((BATCH, 2), np.int32), np.ones(BATCH, np.int32)]
    path = tmp_path / f"g_{heads}_{kv_heads}_{clamp}"
    export(CacheThenAttend(heads, kv_heads, clamp), *(Tensor(a) for a in inputs), file_name=str(path),
           file_format="MINDIR")
    return read_graph(path.with_suffix(".mindir"))


def test_inputs_are_traced_to_graph_inputs_parameters_and_constants(tmp_path):
    graph = export_graph(tmp_path)
    assert list(graph.inputs) == ["query", "key", "value", "slot_mapping", "block_tables", "batch_valid_length"]
    assert graph.inputs["block_tables"] == TensorInfo("int32", (BATCH, 2))
    (write,) = graph.of("ReshapeAndCache")
    cache = TensorInfo("float16", (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM))
    assert write.inputs[:5] == (
        Source("input", "key", info=TensorInfo("float16", (BATCH, KV_HEADS * HEAD_DIM))),
        Source("input", "value", info=TensorInfo("float16", (BATCH, KV_HEADS * HEAD_DIM))),
        Source("parameter", "key_cache", info=cache), Source("parameter", "value_cache", info=cache),
        Source("input", "slot_mapping", info=TensorInfo("int32", (BATCH,))))
    (attend,) = graph.of("PagedAttention")
    # the query through Depend, the caches through Load: both looked through to what they pass on
    assert [(s.kind, s.name) for s in attend.inputs[:5]] == [
        ("input", "query"), ("parameter", "key_cache"), ("parameter", "value_cache"), ("input", "block_tables"),
        ("input", "batch_valid_length")]
    # 2.10 passes the primitive's attributes as constant inputs after the tensors: head_num, scale, kv_head_num
    values = [s.value for s in attend.inputs if s.kind == "constant"]
    assert values[5:8] == [HEADS, pytest.approx(HEAD_DIM ** -0.5), KV_HEADS]
    assert attend.outputs == (TensorInfo("float16", (BATCH, 1, HEADS * HEAD_DIM)),)


def test_a_computed_length_and_swapped_head_counts_are_visible(tmp_path):
    """Two of the wiring mistakes that export accepts: the reader tells them apart from the right wiring."""
    clamped = export_graph(tmp_path, clamp=True).of("PagedAttention")[0].inputs[4]
    assert clamped.kind == "node" and clamped.op == "Maximum" and clamped.info == TensorInfo("int32", (BATCH,))
    swapped = export_graph(tmp_path, heads=KV_HEADS, kv_heads=HEADS).of("PagedAttention")[0]
    assert [s.value for s in swapped.inputs if s.kind == "constant"][5:8] == [
        KV_HEADS, pytest.approx(HEAD_DIM ** -0.5), HEADS]
