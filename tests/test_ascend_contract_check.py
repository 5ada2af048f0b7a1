"""The contract checker (``agents.tools.contracts``) on exported decode and prefill graphs: the right wiring passes,
and each wiring mistake that MindSpore's export accepts without complaint is refused, naming the op and the rule. The
graphs are built here, each with one mistake, exported to MindIR and read back, as ``llm-serving export`` does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, export, nn, ops
from mindspore.ops.auto_generate import (
    ApplyRotaryPosEmb,
    FlashAttentionScore,
    PagedAttention,
    ReshapeAndCache,
    WeightQuantBatchMatmul,
)

from agents.runtime.graph_call import dynamic_inputs
from agents.tools.contracts import DEFAULT_PA_KERNEL, RULES, add_check_argument, check_graph, selected_paged_attention
from agents.tools.export import infer_boost
from agents.tools.mindir import GraphNodes, read_graph
from tests.test_ascend_kv_int8 import INT8_CACHE_MISTAKES
from tests.test_ascend_moe import MOE_MISTAKES

HEADS, KV_HEADS, HEAD_DIM, BLOCKS, BLOCK_SIZE, BATCH, WIDTH = 4, 2, 64, 8, 16, 4, 2


@dataclass(frozen=True)
class Wiring:
    """One decode step's wiring; the defaults are right (as the internal kernels read them)."""

    heads: int = HEADS  # PagedAttention's head_num attribute
    kv_heads: int = KV_HEADS  # its kv_head_num
    scale: float = HEAD_DIM ** -0.5
    query: str = "BND"  # BND (tokens, heads, head_dim), BH (tokens, heads * head_dim) or B1ND
    cache: str = "BSND"  # the caches' block layout: BSND (blocks, block_size, kv_heads, d) or BNSD
    block_size: int = BLOCK_SIZE
    read_swapped: bool = False  # PagedAttention reads value_cache as its key cache and the other way round
    tables_and_lens_swapped: bool = False
    lens: str = "input"  # input (the graph input batch_valid_length), computed (max(., 1)) or renamed (lens)
    tables_dtype: type = np.int32
    slots_dtype: type = np.int32
    lens_dtype: type = np.int32
    cos_format: int = 2
    rope_on: str = "key"  # what ApplyRotaryPosEmb ropes beside the query: key, or value (the mistake)
    cos_width: int = HEAD_DIM
    rope_positions: str = "lengths"  # lengths (batch_valid_length) or positions (another graph input)
    attend_raw_query: bool = False  # PagedAttention reads the query before the rotary embedding
    kernel: str = "atb"  # the PagedAttention kernel the checker is told is selected
    # a dynamic-shape graph (every input dimension open): the mask's width computed from the block table's as
    # "table" (its width x block size), "half" (half of that) or "block8" (x 8, not the cache's block size)
    dynamic: str = ""


class DecodeStep(nn.Cell):
    def __init__(self, w: Wiring) -> None:
        super().__init__()
        self.w = w
        self.rope = ApplyRotaryPosEmb(w.cos_format)
        self.attend = PagedAttention(w.heads, w.scale, w.kv_heads)
        self.write = ReshapeAndCache()
        shape = ((BLOCKS, w.block_size, KV_HEADS, HEAD_DIM) if w.cache == "BSND"
                 else (BLOCKS, KV_HEADS, w.block_size, HEAD_DIM))
        self.key_cache = Parameter(Tensor(np.zeros(shape, np.float16)), name="key_cache")
        self.value_cache = Parameter(Tensor(np.zeros(shape, np.float16)), name="value_cache")

    def step(self, query, key, value, cos, sin, positions, slot_mapping, block_tables, lengths):
        at = lengths if self.w.rope_positions == "lengths" else positions
        if self.w.rope_on == "key":
            roped_query, key = self.rope(query, key, cos, sin, at)
        else:
            roped_query, value = self.rope(query, value, cos, sin, at)
        written = self.write(key, value, self.key_cache, self.value_cache, slot_mapping)
        query = ops.depend(query if self.w.attend_raw_query else roped_query, written)
        if self.w.query == "BH":
            query = query.reshape(BATCH, HEADS * HEAD_DIM)
        elif self.w.query == "B1ND":
            query = query.reshape(BATCH, 1, HEADS, HEAD_DIM)
        else:
            query = query.reshape(BATCH, HEADS, HEAD_DIM)
        if self.w.lens == "computed":
            lengths = ops.maximum(lengths, 1)
        caches = (self.value_cache, self.key_cache) if self.w.read_swapped else (self.key_cache, self.value_cache)
        tables, lens = (lengths, block_tables) if self.w.tables_and_lens_swapped else (block_tables, lengths)
        return self.attend(query, *caches, tables, lens)


class DecodeStepNamed(DecodeStep):
    def construct(self, query, key, value, cos, sin, positions, slot_mapping, block_tables, batch_valid_length):
        return self.step(query, key, value, cos, sin, positions, slot_mapping, block_tables, batch_valid_length)


class DecodeStepOtherName(DecodeStep):
    def construct(self, query, key, value, cos, sin, positions, slot_mapping, block_tables, lens):
        return self.step(query, key, value, cos, sin, positions, slot_mapping, block_tables, lens)


def checked(tmp_path, w: Wiring) -> list[str]:
    cell = (DecodeStepOtherName if w.lens == "renamed" else DecodeStepNamed)(w)
    rows = np.zeros((BATCH, KV_HEADS * HEAD_DIM), np.float16)
    inputs = [np.zeros((BATCH, HEADS * HEAD_DIM), np.float16), rows, rows, np.ones((BATCH, w.cos_width), np.float16),
              np.zeros((BATCH, w.cos_width), np.float16), np.zeros(BATCH, np.int32), np.zeros(BATCH, w.slots_dtype),
              np.zeros((BATCH, WIDTH), w.tables_dtype), np.ones(BATCH, w.lens_dtype)]
    path = tmp_path / "step"
    export(cell, *(Tensor(a) for a in inputs), file_name=str(path), file_format="MINDIR")
    return [str(v) for v in check_graph(read_graph(path.with_suffix(".mindir")), paged_attention=w.kernel)]


RIGHT = Wiring()
MISTAKES = {  # each exports without complaint; the rule that refuses it, and a phrase of its message
    "heads and kv_heads swapped": (replace(RIGHT, heads=KV_HEADS, kv_heads=HEADS), "head-counts-and-layout",
                                   "is neither (tokens, head_num 2, head_dim 64)"),
    "head_num doubled": (replace(RIGHT, heads=2 * HEADS), "head-counts-and-layout", "for head_num 8"),
    "2-D query on the custom kernel": (replace(RIGHT, query="BH", kernel="custom"), "head-counts-and-layout",
                                       "query must be 3-D"),
    "4-D query": (replace(RIGHT, query="B1ND"), "head-counts-and-layout", "query must be 3-D"),
    "BNSD cache": (replace(RIGHT, cache="BNSD"), "head-counts-and-layout", "caches' 16 kv heads"),
    "BNSD cache, as the write sees it": (replace(RIGHT, cache="BNSD"), "cache-layout",
                                         "is neither head_dim 64 nor a token's row 16 x 64"),
    "key and value caches swapped": (replace(RIGHT, read_swapped=True), "reads-the-written-caches", "swapped"),
    "block_tables and context_lens swapped": (replace(RIGHT, tables_and_lens_swapped=True),
                                              "lengths-from-graph-input", "got input 'block_tables'"),
    "context lengths computed in the graph": (replace(RIGHT, lens="computed"), "lengths-from-graph-input",
                                              "got computed by Maximum"),
    "context lengths under another name": (replace(RIGHT, lens="renamed"), "lengths-from-graph-input",
                                           "got input 'lens'"),
    "int64 block tables": (replace(RIGHT, tables_dtype=np.int64), "int32-tables-and-lengths",
                           "block_tables must be int32, got int64"),
    "int64 context lengths": (replace(RIGHT, lens_dtype=np.int64), "int32-tables-and-lengths",
                              "context_lens must be int32, got int64"),
    "int64 slot mapping": (replace(RIGHT, slots_dtype=np.int64), "int32-slots", "slot_mapping must be int32"),
    "wrong scale": (replace(RIGHT, scale=1.0), "scale", "scale_value 1 is not 1/sqrt(head_dim 64)"),
    "block size 8": (replace(RIGHT, block_size=8), "kernel-limits", "block_size 8 (dim 1 of the caches) is not one"),
    "block size 256": (replace(RIGHT, block_size=256), "kernel-limits", "is not one of 16, 32"),
    "cos_format 0": (replace(RIGHT, cos_format=0), "cos-format", "cos_format must be 2"),
    "RoPE applied to V": (replace(RIGHT, rope_on="value"), "caches-the-roped-key", "the key must be output 1"),
    "half-width cos/sin": (replace(RIGHT, cos_width=HEAD_DIM // 2), "tables-and-positions",
                           "rows of 32 values are not head_dim 64 wide"),
    "RoPE positions from another input": (replace(RIGHT, rope_positions="positions"), "tables-and-positions",
                                          "position_ids must be the graph input 'batch_valid_length'"),
    "attending the query before RoPE": (replace(RIGHT, attend_raw_query=True), "roped-query",
                                        "the query must be output 0 of ApplyRotaryPosEmb"),
}


def test_the_right_wiring_passes(tmp_path):
    assert checked(tmp_path, RIGHT) == []


def test_a_2d_query_passes_on_the_atb_kernel_only(tmp_path):
    """ATB's PagedAttention takes a query of rank 2 or 3; the refusal applies where the custom kernel runs."""
    assert checked(tmp_path, replace(RIGHT, query="BH")) == []


def test_export_check_takes_the_kernel_selection_else_the_agents_environments():
    """Left out, the kernel is the one the config's agent environment selects (tests/test_ascend_config.py)."""
    parser = argparse.ArgumentParser()
    add_check_argument(parser)
    assert parser.parse_args(["--check"]).paged_attention_kernel is None
    assert selected_paged_attention(None, {}) == DEFAULT_PA_KERNEL == "atb"
    assert parser.parse_args(["--paged-attention-kernel", "custom"]).paged_attention_kernel == "custom"
    assert selected_paged_attention("custom", {"device_environment": {"MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST":
                                                                      "PagedAttention"}}) == "custom"
    with pytest.raises(SystemExit):
        parser.parse_args(["--paged-attention-kernel", "aclnn"])


def test_an_unknown_kernel_selection_is_refused(tmp_path):
    with pytest.raises(ValueError, match="paged_attention must be one of atb, custom"):
        check_graph(GraphNodes(tmp_path / "none.mindir", {}, ()), paged_attention="aclnn")


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_wiring_mistake_is_refused_naming_the_op_and_the_rule(tmp_path, mistake):
    wiring, rule, phrase = MISTAKES[mistake]
    found = checked(tmp_path, wiring)
    assert any(f"[{rule}]" in v and phrase in v for v in found), found
    op = next(r.op for r in RULES if r.name == rule)
    assert any(v.startswith(op) and f"[{rule}]" in v for v in found)


@dataclass(frozen=True)
class ChunkWiring:
    """One step of queries over cached context through PagedAttention's multi-token path (``q_seq_lens``); the
    defaults are as vllm-mindspore passes it."""

    q_lens_name: str = "q_seq_lens"  # or another graph input name
    mask: str = "rows"  # rows (one per query token, reaching the table), none, float32, narrow, wide or constant
    decode_mask: bool = False  # a one-token decode step that passes a mask anyway
    mask_value: float = -10000.0  # what the masked positions hold
    compare: str = "later"  # later (kv > query: masked), flipped (query > kv) or diagonal (kv >= query)
    key_start: int = 0  # the first kv position of the row the queries are compared against
    constant_rows: str = "triu"  # a constant mask's shape: triu (0 up to the row's position) or tril (flipped)
    mask_mode: str = "MASK_DEFAULT"
    alibi: bool = False  # an alibi mask passed beside the mask
    mla_v_dim: int = 0
    positions_from: str = "positions"  # the graph input the mask's query positions come from, or slots
    kernel: str = "atb"  # the PagedAttention kernel the checker is told is selected
    # a dynamic-shape graph (every input dimension open): the mask's width computed from the block table's as
    # "table" (its width x block size), "half" (half of that) or "block8" (x 8, not the cache's block size)
    dynamic: str = ""


class ChunkStep(nn.Cell):
    def __init__(self, w: ChunkWiring) -> None:
        super().__init__()
        self.w = w
        self.rope = ApplyRotaryPosEmb(2)
        self.write = ReshapeAndCache()
        self.attend = PagedAttention(HEADS, HEAD_DIM ** -0.5, KV_HEADS, mask_mode=w.mask_mode,
                                     mla_v_dim=w.mla_v_dim)
        reach = WIDTH * BLOCK_SIZE
        rows = np.triu(np.ones((8, reach)), 1) if w.constant_rows == "triu" else np.tril(np.ones((8, reach)), -1)
        self.constant_mask = Tensor((rows * -10000.0).astype(np.float16))
        self.alibi = Tensor(np.zeros((8, HEADS, 1, reach), np.float16)) if w.alibi else None
        shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.key_cache = Parameter(Tensor(np.zeros(shape, np.float16)), name="key_cache")
        self.value_cache = Parameter(Tensor(np.zeros(shape, np.float16)), name="value_cache")

    def step(self, query, key, value, cos, sin, slot_mapping, block_tables, positions, q_lens, lengths):
        query, key = self.rope(query, key, cos, sin, lengths)
        written = self.write(key, value, self.key_cache, self.value_cache, slot_mapping)
        query = ops.depend(query, written).reshape(-1, HEADS, HEAD_DIM)
        span = WIDTH * BLOCK_SIZE * {"narrow": 1, "wide": 4}.get(self.w.mask, 2) // 2
        if self.w.dynamic:
            span = block_tables.shape[1] * (8 if self.w.dynamic == "block8" else BLOCK_SIZE)
            span = span // 2 if self.w.dynamic == "half" else span
        kv = ops.arange(self.w.key_start, self.w.key_start + span).astype(positions.dtype).reshape(1, span)
        at = (slot_mapping if self.w.positions_from == "slots" else positions).reshape(-1, 1)
        later = {"later": kv > at, "flipped": at > kv, "diagonal": kv >= at}[self.w.compare]
        mask = later.astype(np.float32 if self.w.mask == "float32" else np.float16) * self.w.mask_value
        if self.w.mask == "constant":
            mask = self.constant_mask
        if self.w.alibi:
            return self.attend(query, self.key_cache, self.value_cache, block_tables, lengths, None, None, mask,
                               q_lens, self.alibi)
        if self.w.mask == "none":
            return self.attend(query, self.key_cache, self.value_cache, block_tables, lengths, None, None, None, q_lens)
        if self.w.decode_mask:
            return self.attend(query, self.key_cache, self.value_cache, block_tables, lengths, None, None, mask)
        return self.attend(query, self.key_cache, self.value_cache, block_tables, lengths, None, None, mask, q_lens)


class ChunkStepNamed(ChunkStep):
    def construct(self, query, key, value, cos, sin, slot_mapping, block_tables, positions, q_seq_lens,
                  batch_valid_length):
        return self.step(query, key, value, cos, sin, slot_mapping, block_tables, positions, q_seq_lens,
                         batch_valid_length)


class ChunkStepOtherName(ChunkStep):
    def construct(self, query, key, value, cos, sin, slot_mapping, block_tables, positions, query_lens,
                  batch_valid_length):
        return self.step(query, key, value, cos, sin, slot_mapping, block_tables, positions, query_lens,
                         batch_valid_length)


def checked_chunk(tmp_path, w: ChunkWiring) -> list[str]:
    tokens = 8
    rows = np.zeros((tokens, KV_HEADS * HEAD_DIM), np.float16)
    inputs = [np.zeros((tokens, HEADS * HEAD_DIM), np.float16), rows, rows, np.ones((tokens, HEAD_DIM), np.float16),
              np.zeros((tokens, HEAD_DIM), np.float16), np.zeros(tokens, np.int32),
              np.zeros((BATCH, WIDTH), np.int32), np.zeros(tokens, np.int32), np.full(BATCH, 2, np.int32),
              np.full(BATCH, 9, np.int32)]
    cell = (ChunkStepNamed if w.q_lens_name == "q_seq_lens" else ChunkStepOtherName)(w)
    path = tmp_path / "chunk"
    args = dynamic_inputs(inputs) if w.dynamic else [Tensor(a) for a in inputs]
    with infer_boost(w.alibi):  # MindSpore's type inference refuses an alibi mask without it
        export(cell, *args, file_name=str(path), file_format="MINDIR")
    return [str(v) for v in check_graph(read_graph(path.with_suffix(".mindir")), paged_attention=w.kernel)]


CHUNK_MISTAKES = {
    "a dynamic graph's mask half the table's reach": (ChunkWiring(dynamic="half"), "chunk-mask-values-and-direction",
                                                      "width must be the block table's width x block_size"),
    "a dynamic graph's mask at another block size": (ChunkWiring(dynamic="block8"), "chunk-mask-values-and-direction",
                                                     "width must be the block table's width x block_size"),
    "a dynamic graph's kv positions off by one": (ChunkWiring(dynamic="table", key_start=1),
                                                  "chunk-mask-values-and-direction", "count from 0 by 1"),
    "query lengths under another name": (ChunkWiring(q_lens_name="query_lens"), "multi-token-queries",
                                         "q_seq_lens must be the graph input 'q_seq_lens'"),
    "multi-token queries without a mask": (ChunkWiring(mask="none"), "multi-token-queries", "got none"),
    "a float32 mask": (ChunkWiring(mask="float32"), "multi-token-queries", "in the compute dtype"),
    "a mask short of the table's reach": (ChunkWiring(mask="narrow"), "chunk-mask-width",
                                          "positions do not reach the 32"),
    # issue 52's blind spots
    "a mask wider than the table's reach (custom kernel)": (ChunkWiring(mask="wide", kernel="custom"),
                                                            "chunk-mask-width", "wider than the 32"),
    "a mask holding +1": (ChunkWiring(mask_value=1.0), "chunk-mask-values-and-direction", "hold 1.0, not -10000"),
    "a mask with its direction flipped": (ChunkWiring(compare="flipped"), "chunk-mask-values-and-direction",
                                          "direction is flipped"),
    # found here
    "a mask holding fp16's lowest": (ChunkWiring(mask_value=-65504.0), "chunk-mask-values-and-direction",
                                     "hold -65504.0"),
    "a mask masking each query's own position": (ChunkWiring(compare="diagonal"), "chunk-mask-values-and-direction",
                                                 "got GreaterEqual"),
    "a mask's kv positions off by one": (ChunkWiring(key_start=1), "chunk-mask-values-and-direction",
                                         "kv positions row must be 0..31"),
    "a constant mask, flipped": (ChunkWiring(mask="constant", constant_rows="tril"),
                                 "chunk-mask-values-and-direction", "direction flipped"),
    "TRAPEZOIDAL mask_mode with a real mask": (ChunkWiring(mask_mode="TRAPEZOIDAL"), "plain-attention-mode",
                                               "mask_mode must be MASK_DEFAULT"),
    "an alibi mask beside the mask": (ChunkWiring(alibi=True), "plain-attention-mode", "no alibi_mask"),
    "a mask built from the slot mapping": (ChunkWiring(positions_from="slots"), "chunk-mask-values-and-direction",
                                           "query positions must be the graph input 'positions'"),
    "MLA mode (mla_v_dim) on Llama": (ChunkWiring(mla_v_dim=HEAD_DIM), "plain-attention-mode", "mla_v_dim must be 0"),
    "a mask on a one-token decode": (ChunkWiring(decode_mask=True), "multi-token-queries", "passes no mask"),
}


@pytest.mark.parametrize("wiring", [ChunkWiring(), ChunkWiring(kernel="custom"), ChunkWiring(mask="constant"),
                                    ChunkWiring(mask="wide"), ChunkWiring(dynamic="table")],
                         ids=["atb", "custom", "constant", "wide-on-atb", "dynamic"])
def test_the_right_chunk_wiring_passes(tmp_path, wiring):
    found = checked_chunk(tmp_path, wiring)
    if wiring.dynamic:  # this cell's cos/sin are open inputs too (the model's are gathered from fixed tables)
        found = [v for v in found if v.startswith("PagedAttention")]
    assert found == []


@pytest.mark.parametrize("mistake", list(CHUNK_MISTAKES))
def test_each_chunk_mistake_is_refused_naming_the_rule(tmp_path, mistake):
    wiring, rule, phrase = CHUNK_MISTAKES[mistake]
    found = checked_chunk(tmp_path, wiring)
    assert any(v.startswith("PagedAttention") and f"[{rule}]" in v and phrase in v for v in found), found


@dataclass(frozen=True)
class CollectiveWiring:
    """A rank's row-parallel sum and candidate gather, as agents/model/parallel.py builds them for 2 ranks."""

    op: str = ops.ReduceOp.SUM
    group: str = "hccl_world_group"
    rank_size: int = 2
    checked_as: int = 2  # the tensor_parallel_size the checker is told


class CollectiveStep(nn.Cell):
    def __init__(self, w: CollectiveWiring) -> None:
        super().__init__()
        self.reduce = ops.AllReduce(w.op, w.group)
        self.gather = ops.AllGather(w.group)
        self.gather.add_prim_attr("rank_size", w.rank_size)

    def construct(self, x):
        return self.gather(self.reduce(x))


def checked_collectives(tmp_path, w: CollectiveWiring) -> list[str]:
    path = tmp_path / "collectives"
    export(CollectiveStep(w), Tensor(np.zeros((4, 8), np.float16)), file_name=str(path), file_format="MINDIR")
    return [str(v) for v in check_graph(read_graph(path.with_suffix(".mindir")), tensor_parallel=w.checked_as)]


COLLECTIVE_MISTAKES = {
    "a max where the partial sums add": (CollectiveWiring(op=ops.ReduceOp.MAX), "world-group-collectives",
                                         "op must be 'sum', got 'max'"),
    "the CPU world group in an Ascend graph": (CollectiveWiring(group="mccl_world_group"), "world-group-collectives",
                                               "got 'mccl_world_group'"),
    "an all-gather of one rank (no group joined)": (CollectiveWiring(rank_size=1), "world-group-collectives-gather",
                                                    "rank_size 1 is not the 2 ranks"),
    "collectives in a graph of one device": (CollectiveWiring(checked_as=1), "world-group-collectives",
                                             "holds no AllReduce"),
}


def test_the_right_collectives_pass(tmp_path):
    assert checked_collectives(tmp_path, CollectiveWiring()) == []


@pytest.mark.parametrize("mistake", list(COLLECTIVE_MISTAKES))
def test_each_collective_mistake_is_refused_naming_the_rule(tmp_path, mistake):
    wiring, rule, phrase = COLLECTIVE_MISTAKES[mistake]
    found = checked_collectives(tmp_path, wiring)
    assert any(f"[{rule}]" in v and phrase in v for v in found), found


def test_every_rule_says_where_it_was_read_and_is_shown_failing():
    assert len({r.name for r in RULES}) == len(RULES)
    assert all(r.source and r.op in ("PagedAttention", "ReshapeAndCache", "FlashAttentionScore",
                                     "ApplyRotaryPosEmb", "AllReduce", "AllGather", "WeightQuantBatchMatmul",
                                     "MoeGatingTopKSoftmax", "MoeInitRoutingV2", "GroupedMatmulV4",
                                     "InnerMoeTokenUnpermute")
               for r in RULES)
    shown = {rule for _, rule, _ in [*MISTAKES.values(), *PREFILL_MISTAKES.values(), *CHUNK_MISTAKES.values(),
                                     *COLLECTIVE_MISTAKES.values(), *QUANT_MISTAKES.values(),
                                     *MOE_MISTAKES.values()]}  # tests/test_ascend_moe.py's
    shown |= {rule for _, rule in INT8_CACHE_MISTAKES.values()}  # tests/test_ascend_kv_int8.py's
    assert shown == {r.name for r in RULES}


@dataclass(frozen=True)
class PrefillWiring:
    """One ragged prefill (layout TH): rope, cache write and FlashAttentionScore; the defaults are as MindFormers
    1.8 passes them."""

    lengths: str = "input"  # input (batch_valid_length per sequence) or cumulative (computed in the graph)
    sparse_mode: int = 0
    mask: tuple[int, int] = (128, 128)
    mask_dtype: type = np.float16
    mask_value: float = -10000.0  # above the diagonal: float16's (bfloat16 takes 1)
    heads: int = HEADS
    scale: float = HEAD_DIM ** -0.5
    attend_raw_key: bool = False  # FlashAttention reads the key before the rotary embedding


class PrefillStep(nn.Cell):
    def __init__(self, w: PrefillWiring) -> None:
        super().__init__()
        self.w = w
        self.rope = ApplyRotaryPosEmb(2)
        self.write = ReshapeAndCache()
        self.flash = FlashAttentionScore(w.heads, scale_value=w.scale, next_tokens=0, input_layout="TH",
                                         sparse_mode=w.sparse_mode)
        self.mask = Tensor((np.triu(np.ones(w.mask), 1) * w.mask_value).astype(w.mask_dtype))
        shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.key_cache = Parameter(Tensor(np.zeros(shape, np.float16)), name="key_cache")
        self.value_cache = Parameter(Tensor(np.zeros(shape, np.float16)), name="value_cache")

    def construct(self, query, key, value, cos, sin, slot_mapping, batch_valid_length):
        roped_query, roped_key = self.rope(query, key, cos, sin, batch_valid_length)
        written = self.write(roped_key, value, self.key_cache, self.value_cache, slot_mapping)
        roped_query = ops.depend(roped_query, written)
        lengths = ops.cumsum(batch_valid_length, 0) if self.w.lengths == "cumulative" else batch_valid_length
        attended_key = key if self.w.attend_raw_key else roped_key
        return self.flash(roped_query, attended_key, value, None, None, None, self.mask, None, lengths, lengths)[3]


def checked_prefill(tmp_path, w: PrefillWiring) -> list[str]:
    tokens = 2 * 8
    rows = np.zeros((tokens, KV_HEADS * HEAD_DIM), np.float16)
    inputs = [np.zeros((tokens, HEADS * HEAD_DIM), np.float16), rows, rows, np.ones((tokens, HEAD_DIM), np.float16),
              np.zeros((tokens, HEAD_DIM), np.float16), np.zeros(tokens, np.int32), np.full(2, 8, np.int32)]
    path = tmp_path / "prefill"
    export(PrefillStep(w), *(Tensor(a) for a in inputs), file_name=str(path), file_format="MINDIR")
    return [str(v) for v in check_graph(read_graph(path.with_suffix(".mindir")))]


PREFILL_MISTAKES = {
    "cumulative lengths computed in the graph": (PrefillWiring(lengths="cumulative"), "per-sequence-lengths",
                                                 "got computed by"),
    "sparse_mode 3": (PrefillWiring(sparse_mode=3), "mask-and-sparse-mode", "sparse_mode must be 0"),
    "a 0/1 float16 mask (bfloat16's values)": (PrefillWiring(mask_value=1.0), "mask-and-sparse-mode",
                                               "-10000 above it in float16, got 1 above it"),
    "a 2048 x 2048 uint8 mask": (PrefillWiring(mask=(2048, 2048), mask_dtype=np.uint8, mask_value=1.0),
                                 "mask-and-sparse-mode",
                                 "128 x 128 in the compute dtype"),
    "a float32 mask": (PrefillWiring(mask_dtype=np.float32), "mask-and-sparse-mode", "got float32[128,128]"),
    "FlashAttention head_num doubled": (PrefillWiring(heads=2 * HEADS), "heads-scale-and-head-dim",
                                        "head_num 8 x head_dim 64 (the caches') is not the query's width 256"),
    "FlashAttention wrong scale": (PrefillWiring(scale=1.0), "heads-scale-and-head-dim",
                                   "scale_value 1 is not 1/sqrt(head_dim 64)"),
    "FlashAttention reads the key before RoPE": (PrefillWiring(attend_raw_key=True), "roped-query-and-key",
                                                 "the key must be output 1 of ApplyRotaryPosEmb"),
}


def test_the_right_prefill_wiring_passes(tmp_path):
    assert checked_prefill(tmp_path, PrefillWiring()) == []


@pytest.mark.parametrize("mistake", list(PREFILL_MISTAKES))
def test_each_prefill_mistake_is_refused_naming_the_rule(tmp_path, mistake):
    wiring, rule, phrase = PREFILL_MISTAKES[mistake]
    found = checked_prefill(tmp_path, wiring)
    assert found and all(v.startswith("FlashAttentionScore") for v in found), found
    assert any(f"[{rule}]" in v and phrase in v for v in found), found



# ---- WeightQuantBatchMatmul (w8a16) ------------------------------------------------------------------------------
QN, QK = 64, 64  # square, so that a weight read the wrong way round still exports


@dataclass(frozen=True)
class QuantWiring:
    """One w8a16 projection as the Ascend backend builds it (agents/model/backends/ascend.py AscendProjection)."""

    transpose_weight: bool = True
    weight: str = "parameter"  # parameter (int8, quantized at load) or cast (a float weight cast in the graph)
    group_size: int = 0
    scale_len: int = QN
    bias: bool = False
    quant_scale: bool = False
    in_dim: int = QK


class QuantStep(nn.Cell):
    def __init__(self, w: QuantWiring) -> None:
        super().__init__()
        self.w = w
        self.matmul = WeightQuantBatchMatmul(False, w.transpose_weight, w.group_size)
        self.weight = Parameter(Tensor(np.ones((QN, w.in_dim), np.int8)), name="weight")
        self.float_weight = Parameter(Tensor(np.ones((QN, w.in_dim), np.float16)), name="float_weight")
        self.scale = Parameter(Tensor(np.ones(w.scale_len, np.float16)), name="scale")
        self.extra = Parameter(Tensor(np.ones(QN, np.float16)), name="extra")

    def construct(self, x):
        weight = self.weight if self.w.weight == "parameter" else self.float_weight.astype(ms.int8)
        return self.matmul(x, weight, self.scale, None, self.extra if self.w.quant_scale else None, None,
                           self.extra if self.w.bias else None)


def checked_quant(tmp_path, w: QuantWiring) -> list[str]:
    path = tmp_path / "quant"
    export(QuantStep(w), Tensor(np.zeros((4, w.in_dim), np.float16)), file_name=str(path), file_format="MINDIR")
    return [str(v) for v in check_graph(read_graph(path.with_suffix(".mindir")))]


QUANT_MISTAKES = {
    "the weight read as (in, out)": (QuantWiring(transpose_weight=False), "int8-weight-out-by-in",
                                     "transpose_weight True"),
    "an int8 weight cast in the graph": (QuantWiring(weight="cast"), "int8-weight-out-by-in",
                                         "must be an int8 Parameter"),
    "group-wise size with per-channel scales": (QuantWiring(group_size=32), "per-channel-scale",
                                                "antiquant_group_size must be 0"),
    "scales of half the outputs": (QuantWiring(scale_len=QN // 2), "per-channel-scale", "(n,) or (1, n)"),
    "a bias in the kernel": (QuantWiring(bias=True), "no-offset-bias-or-output-quantization", "bias must be None"),
    "an int8 output": (QuantWiring(quant_scale=True), "no-offset-bias-or-output-quantization",
                       "quant_scale must be None"),
    "k past the kernel's 65535": (QuantWiring(in_dim=70000), "quant-matmul-limits", "exceeds 65535"),
}


def test_the_right_quant_wiring_passes(tmp_path):
    assert checked_quant(tmp_path, QuantWiring()) == []


@pytest.mark.parametrize("mistake", list(QUANT_MISTAKES))
def test_each_quant_mistake_is_refused_naming_the_rule(tmp_path, mistake):
    wiring, rule, phrase = QUANT_MISTAKES[mistake]
    found = checked_quant(tmp_path, wiring)
    assert any(f"[{rule}]" in v and phrase in v for v in found), found
