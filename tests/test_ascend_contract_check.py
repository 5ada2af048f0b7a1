"""The contract checker (``agents.tools.contracts``) on exported decode and prefill graphs: the right wiring passes, and each
wiring mistake that MindSpore's export accepts without complaint is refused, naming the op and the rule. The
graphs are built here, each with one mistake, exported to MindIR and read back, as ``llm-serving export`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from mindspore import Parameter, Tensor, export, nn, ops
from mindspore.ops.auto_generate import FlashAttentionScore, PagedAttention, ReshapeAndCache

from agents.tools.contracts import RULES, check_graph
from agents.tools.mindir import read_graph

HEADS, KV_HEADS, HEAD_DIM, BLOCKS, BLOCK_SIZE, BATCH, WIDTH = 4, 2, 32, 8, 16, 4, 2


@dataclass(frozen=True)
class Wiring:
    """One decode step's wiring; the defaults are right (as the internal kernels read them)."""

    heads: int = HEADS  # PagedAttention's head_num attribute
    kv_heads: int = KV_HEADS  # its kv_head_num
    scale: float = HEAD_DIM ** -0.5
    query: str = "BND"  # BND (tokens, heads, head_dim), BH (tokens, heads * head_dim) or B1ND
    cache: str = "BSND"  # the caches' block layout: BSND (blocks, block_size, kv_heads, d) or BNSD
    read_swapped: bool = False  # PagedAttention reads value_cache as its key cache and the other way round
    tables_and_lens_swapped: bool = False
    lens: str = "input"  # input (the graph input batch_valid_length), computed (max(., 1)) or renamed (lens)
    tables_dtype: type = np.int32
    slots_dtype: type = np.int32
    lens_dtype: type = np.int32


class DecodeStep(nn.Cell):
    def __init__(self, w: Wiring) -> None:
        super().__init__()
        self.w = w
        self.attend = PagedAttention(w.heads, w.scale, w.kv_heads)
        self.write = ReshapeAndCache()
        shape = ((BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM) if w.cache == "BSND"
                 else (BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM))
        self.key_cache = Parameter(Tensor(np.zeros(shape, np.float16)), name="key_cache")
        self.value_cache = Parameter(Tensor(np.zeros(shape, np.float16)), name="value_cache")

    def step(self, query, key, value, slot_mapping, block_tables, lengths):
        written = self.write(key, value, self.key_cache, self.value_cache, slot_mapping)
        query = ops.depend(query, written)
        if self.w.query == "BH":
            query = query.reshape(BATCH, HEADS * HEAD_DIM)
        elif self.w.query == "B1ND":
            query = query.reshape(BATCH, 1, HEADS, HEAD_DIM)
        if self.w.lens == "computed":
            lengths = ops.maximum(lengths, 1)
        caches = (self.value_cache, self.key_cache) if self.w.read_swapped else (self.key_cache, self.value_cache)
        tables, lens = (lengths, block_tables) if self.w.tables_and_lens_swapped else (block_tables, lengths)
        return self.attend(query, *caches, tables, lens)


class DecodeStepNamed(DecodeStep):
    def construct(self, query, key, value, slot_mapping, block_tables, batch_valid_length):
        return self.step(query, key, value, slot_mapping, block_tables, batch_valid_length)


class DecodeStepOtherName(DecodeStep):
    def construct(self, query, key, value, slot_mapping, block_tables, lens):
        return self.step(query, key, value, slot_mapping, block_tables, lens)


def checked(tmp_path, w: Wiring) -> list[str]:
    cell = (DecodeStepOtherName if w.lens == "renamed" else DecodeStepNamed)(w)
    inputs = [np.zeros((BATCH, HEADS, HEAD_DIM), np.float16), np.zeros((BATCH, KV_HEADS * HEAD_DIM), np.float16),
              np.zeros((BATCH, KV_HEADS * HEAD_DIM), np.float16), np.zeros(BATCH, w.slots_dtype),
              np.zeros((BATCH, WIDTH), w.tables_dtype), np.ones(BATCH, w.lens_dtype)]
    path = tmp_path / "step"
    export(cell, *(Tensor(a) for a in inputs), file_name=str(path), file_format="MINDIR")
    return [str(v) for v in check_graph(read_graph(path.with_suffix(".mindir")))]


RIGHT = Wiring()
MISTAKES = {  # each exports without complaint; the rule that refuses it, and a phrase of its message
    "heads and kv_heads swapped": (replace(RIGHT, heads=KV_HEADS, kv_heads=HEADS), "head-counts-and-layout",
                                   "is neither (tokens, head_num 2, head_dim 32)"),
    "head_num doubled": (replace(RIGHT, heads=2 * HEADS), "head-counts-and-layout", "for head_num 8"),
    "2-D query": (replace(RIGHT, query="BH"), "head-counts-and-layout", "query must be 3-D"),
    "4-D query": (replace(RIGHT, query="B1ND"), "head-counts-and-layout", "query must be 3-D"),
    "BNSD cache": (replace(RIGHT, cache="BNSD"), "head-counts-and-layout", "caches' 16 kv heads"),
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
    "wrong scale": (replace(RIGHT, scale=1.0), "scale", "scale_value 1 is not 1/sqrt(head_dim 32)"),
}


def test_the_right_wiring_passes(tmp_path):
    assert checked(tmp_path, RIGHT) == []


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_wiring_mistake_is_refused_naming_the_op_and_the_rule(tmp_path, mistake):
    wiring, rule, phrase = MISTAKES[mistake]
    found = checked(tmp_path, wiring)
    assert any(f"[{rule}]" in v and phrase in v for v in found), found
    op = next(r.op for r in RULES if r.name == rule)
    assert all(v.startswith(("PagedAttention", "ReshapeAndCache")) for v in found)
    assert any(v.startswith(op) and f"[{rule}]" in v for v in found)


def test_every_rule_says_where_it_was_read():
    assert len({r.name for r in RULES}) == len(RULES)
    assert all(r.source and r.op in ("PagedAttention", "ReshapeAndCache", "FlashAttentionScore") for r in RULES)


@dataclass(frozen=True)
class PrefillWiring:
    """One ragged prefill's FlashAttentionScore (layout TH); the defaults are as MindFormers 1.8 passes it."""

    lengths: str = "input"  # input (batch_valid_length per sequence) or cumulative (computed in the graph)
    sparse_mode: int = 0
    mask: tuple[int, int] = (128, 128)
    mask_dtype: type = np.float16


class PrefillStep(nn.Cell):
    def __init__(self, w: PrefillWiring) -> None:
        super().__init__()
        self.w = w
        self.flash = FlashAttentionScore(HEADS, scale_value=HEAD_DIM ** -0.5, next_tokens=0, input_layout="TH",
                                         sparse_mode=w.sparse_mode)
        self.mask = Tensor(np.triu(np.ones(w.mask, w.mask_dtype), 1))

    def construct(self, query, key, value, batch_valid_length):
        lengths = ops.cumsum(batch_valid_length, 0) if self.w.lengths == "cumulative" else batch_valid_length
        return self.flash(query, key, value, None, None, None, self.mask, None, lengths, lengths)[3]


def checked_prefill(tmp_path, w: PrefillWiring) -> list[str]:
    tokens = 2 * 8
    inputs = [np.zeros((tokens, HEADS * HEAD_DIM), np.float16), np.zeros((tokens, KV_HEADS * HEAD_DIM), np.float16),
              np.zeros((tokens, KV_HEADS * HEAD_DIM), np.float16), np.full(2, 8, np.int32)]
    path = tmp_path / "prefill"
    export(PrefillStep(w), *(Tensor(a) for a in inputs), file_name=str(path), file_format="MINDIR")
    return [str(v) for v in check_graph(read_graph(path.with_suffix(".mindir")))]


PREFILL_MISTAKES = {
    "cumulative lengths computed in the graph": (PrefillWiring(lengths="cumulative"), "per-sequence-lengths",
                                                 "got computed by"),
    "sparse_mode 3": (PrefillWiring(sparse_mode=3), "mask-and-sparse-mode", "sparse_mode must be 0"),
    "a 2048 x 2048 uint8 mask": (PrefillWiring(mask=(2048, 2048), mask_dtype=np.uint8), "mask-and-sparse-mode",
                                 "128 x 128 in the compute dtype"),
    "a float32 mask": (PrefillWiring(mask_dtype=np.float32), "mask-and-sparse-mode", "got float32[128,128]"),
}


def test_the_right_prefill_wiring_passes(tmp_path):
    assert checked_prefill(tmp_path, PrefillWiring()) == []


@pytest.mark.parametrize("mistake", list(PREFILL_MISTAKES))
def test_each_prefill_mistake_is_refused_naming_the_rule(tmp_path, mistake):
    wiring, rule, phrase = PREFILL_MISTAKES[mistake]
    found = checked_prefill(tmp_path, wiring)
    assert found and all(v.startswith("FlashAttentionScore") for v in found), found
    assert any(f"[{rule}]" in v and phrase in v for v in found), found
