"""Weights between our fused layout and MindFormers' Llama names (agents/weights/mindformers_names.py), numpy only.

The fused MindFormers order is checked against a hand-built example whose rows name themselves, so a plain
concatenation (what a naive converter would write) fails; the MindFormers environment's tests compare the same
functions with MindFormers' own converters (tests_mindformers/test_mindformers_model.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from agents.weights.checkpoints import canonical_shapes
from agents.weights.mindformers_names import (
    SplitView,
    from_mindformers,
    gate_up_from_mindformers,
    gate_up_to_mindformers,
    qkv_from_mindformers,
    qkv_to_mindformers,
    to_mindformers,
)
from llm_serving.protocol.model_config import LlamaConfig

GQA = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
MHA = LlamaConfig(vocab_size=40, hidden_size=24, intermediate_size=20, num_hidden_layers=1, num_attention_heads=3,
                  num_key_value_heads=3)


def canonical(config: LlamaConfig, dtype=np.float32, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(dtype) for k, s in canonical_shapes(config).items()}


@pytest.mark.parametrize("config", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_round_trip_is_exact(config: LlamaConfig, fused: bool, dtype) -> None:
    ours = canonical(config, dtype)
    theirs = to_mindformers(ours, config, fused)
    back = from_mindformers(theirs, config)
    assert sorted(back) == sorted(ours)
    for name, value in ours.items():
        assert back[name].dtype == value.dtype
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    # and MindFormers -> ours -> MindFormers gives the same tensors under the same names
    again = to_mindformers(back, config, fused)
    assert sorted(again) == sorted(theirs)
    for name, value in theirs.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)


def test_names_are_mindformers_llama_parameters() -> None:
    """The parameter names MindFormers 1.8.0's LlamaForCausalLM has (as listed by the real model in its
    environment), fused and split."""
    fused = to_mindformers(canonical(GQA), GQA, fused=True)
    assert {n for n in fused if ".layers.0." in n} == {
        "model.layers.0.attention_norm.weight", "model.layers.0.attention.w_qkv.weight",
        "model.layers.0.attention.wo.weight", "model.layers.0.ffn_norm.weight",
        "model.layers.0.feed_forward.w_gate_hidden.weight", "model.layers.0.feed_forward.w2.weight"}
    assert {n for n in fused if ".layers." not in n} == {
        "model.tok_embeddings.embedding_weight", "model.norm_out.weight", "lm_head.weight"}
    split = to_mindformers(canonical(GQA), GQA, fused=False)
    assert {n.split(".")[-2] for n in split if ".layers.1." in n} == {
        "attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3"}


def labelled_qkv(config: LlamaConfig) -> np.ndarray:
    """A [q; k; v] weight whose every row holds (part, head, row in head) so reordering shows."""
    d, rows = config.head_dim, []
    for part, heads in (("q", config.num_attention_heads), ("k", config.num_key_value_heads),
                        ("v", config.num_key_value_heads)):
        rows += [("qkv".index(part), h, r) for h in range(heads) for r in range(d)]
    return np.array(rows, np.float32)


def test_fused_qkv_is_grouped_per_kv_head() -> None:
    """MindFormers' w_qkv: per kv head g, its n_rep query heads, then k head g, then v head g."""
    mf = qkv_to_mindformers(labelled_qkv(GQA), GQA)
    d, rep = GQA.head_dim, GQA.num_attention_heads // GQA.num_key_value_heads
    expected = []
    for g in range(GQA.num_key_value_heads):
        expected += [(0, g * rep + j, r) for j in range(rep) for r in range(d)]
        expected += [(1, g, r) for r in range(d)] + [(2, g, r) for r in range(d)]
    np.testing.assert_array_equal(mf, np.array(expected, np.float32))
    np.testing.assert_array_equal(qkv_from_mindformers(mf, GQA), labelled_qkv(GQA))


def test_fused_gate_up_interleaves_rows() -> None:
    """MindFormers' w_gate_hidden: gate row j then up row j, for every j."""
    f = GQA.intermediate_size
    ours = np.concatenate([np.full((f, 1), 1.0), np.full((f, 1), 2.0)]) + np.arange(2 * f)[:, None] % f * 10
    mf = gate_up_to_mindformers(ours.astype(np.float32))
    np.testing.assert_array_equal(mf[0::2, 0], ours[:f, 0])
    np.testing.assert_array_equal(mf[1::2, 0], ours[f:, 0])
    np.testing.assert_array_equal(gate_up_from_mindformers(mf), ours)


def test_split_view_serves_split_names_from_fused_tensors() -> None:
    ours = canonical(GQA)
    fused, split = to_mindformers(ours, GQA, True), to_mindformers(ours, GQA, False)
    view = SplitView(fused, GQA)
    for name, value in split.items():
        assert name in view
        np.testing.assert_array_equal(view[name], value, err_msg=name)
    assert sorted(view) == sorted(split)
    assert len(view) == len(split)


def test_missing_tensor_is_named() -> None:
    theirs = to_mindformers(canonical(GQA), GQA, fused=False)
    del theirs["model.layers.1.feed_forward.w3.weight"]
    with pytest.raises(KeyError, match=r"model\.layers\.1\.feed_forward\.w3\.weight"):
        from_mindformers(theirs, GQA)
