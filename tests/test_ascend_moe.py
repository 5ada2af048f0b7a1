"""The Ascend MoE wiring (agents/model/backends/ascend_moe.py) on CPU: the same cell with the kernels' stand-ins
(ascend_moe_reference.py) against the numpy reference of the routed experts (agents/model/moe_routing.py, itself
held to transformers' blocks), whole and split over expert-parallel ranks whose parts sum to the whole; and the
stand-ins' routing outputs against CANN's formulas where the cell does not show them (row order, counts)."""

from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, export, nn, ops
from mindspore.ops.auto_generate import (
    GroupedMatmulV4,
    MoeGatingTopKSoftmax,
    MoeInitRoutingV2,
    MoeTokenUnpermute,
    Swiglu,
)

from agents.model.backends.ascend_moe import AscendRoutedExperts, ExpertSlice, MoeOps
from agents.model.backends.ascend_moe_reference import GatingTopKSoftmaxRef, InitRoutingV2Ref, MoeReferenceOps
from agents.model.moe_routing import moe_forward
from agents.runtime.device import setup_device
from agents.tools.contracts import check_graph
from agents.tools.mindir import read_graph

HIDDEN, FFN, EXPERTS = 32, 16, 8


@pytest.fixture(scope="module", autouse=True)
def cpu():
    setup_device("CPU", 0)


def layer(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"router": rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32),
            "gate_up": (rng.standard_normal((EXPERTS, 2 * FFN, HIDDEN)) / HIDDEN ** 0.5).astype(np.float32),
            "down": (rng.standard_normal((EXPERTS, HIDDEN, FFN)) / FFN ** 0.5).astype(np.float32)}


def routed(x: np.ndarray, w: dict[str, np.ndarray], k: int, normalise: bool, experts: ExpertSlice) -> np.ndarray:
    """The cell's output on one rank: its experts' weights in the grouped matmul's [in, out] layout."""
    part = slice(experts.first, experts.first + experts.count)
    cell = AscendRoutedExperts(MoeReferenceOps(), k, normalise, experts)
    gate_up, down = (np.ascontiguousarray(w[name][part].transpose(0, 2, 1)) for name in ("gate_up", "down"))
    return cell(Tensor(x), Tensor(x @ w["router"].T), Tensor(gate_up), Tensor(down)).asnumpy()


@pytest.mark.parametrize("tokens,k,normalise", [(1, 2, True), (7, 2, False), (5, 3, True), (16, 1, False)])
def test_the_routed_experts_match_the_reference(tokens, k, normalise):
    w = layer(tokens)
    x = np.random.default_rng(100 + tokens).standard_normal((tokens, HIDDEN)).astype(np.float32)
    want = moe_forward(x, w["router"], w["gate_up"], w["down"], k, normalise)
    got = routed(x, w, k, normalise, ExpertSlice(0, EXPERTS, EXPERTS))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_ranks_parts_sum_to_the_whole(ranks):
    """Each rank's part (its experts' picks; the others' weighted 0 and never computed) summed, as the block's
    all-reduce does, is the whole layer's output; a rank whose experts no token picked returns zeros."""
    w, tokens, k = layer(3), 6, 2
    x = np.random.default_rng(4).standard_normal((tokens, HIDDEN)).astype(np.float32)
    parts = [routed(x, w, k, True, ExpertSlice.of_rank(EXPERTS, ranks, r)) for r in range(ranks)]
    assert all(np.isfinite(p).all() for p in parts)
    np.testing.assert_allclose(sum(parts), moe_forward(x, w["router"], w["gate_up"], w["down"], k, True),
                               rtol=2e-5, atol=2e-6)
    one = x[:1]  # one token picks k experts: with 4 ranks of 2 experts some rank holds none of them
    ids = np.argsort(-(one @ w["router"].T), -1)[0, :k]
    idle = [r for r in range(ranks) if not any(r * (EXPERTS // ranks) <= e < (r + 1) * (EXPERTS // ranks)
                                                for e in ids)]
    for r in idle:
        assert not routed(one, w, k, True, ExpertSlice.of_rank(EXPERTS, ranks, r)).any()


def test_uneven_expert_parallelism_is_refused():
    with pytest.raises(ValueError, match="8 experts do not split evenly over 3"):
        ExpertSlice.of_rank(8, 3, 0)


def test_the_routing_stand_ins_follow_cann_s_formulas():
    """rowIdx = j * T + t; sortedRowIdx sorts the flat (token, pick) pairs by expert, stable; expanded_x[i] =
    x[sortedRowIdx[i] // k]; expandedRowIdx[sortedRowIdx[i]] = i; counts per expert."""
    logits = np.array([[0.1, 0.9, 0.5, 0.0], [0.8, 0.1, 0.7, 0.2], [0.3, 0.2, 0.1, 0.9]], np.float32)
    weights, ids, rows = (t.asnumpy() for t in GatingTopKSoftmaxRef()(Tensor(logits), None, 2))
    assert ids.tolist() == [[1, 2], [0, 2], [3, 0]]
    assert rows.tolist() == [[0, 3], [1, 4], [2, 5]]
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(weights, np.take_along_axis(probs, ids, -1), rtol=1e-6)
    x = np.arange(3, dtype=np.float32).reshape(3, 1) * np.ones((1, 2), np.float32)
    expanded, where, counts, _ = (t.asnumpy() for t in InitRoutingV2Ref()(Tensor(x), Tensor(ids), 0, 0, 4, 0, 2, True))
    order = np.argsort(ids.reshape(-1), kind="stable")
    assert expanded[:, 0].tolist() == (order // 2).tolist() == [1, 2, 0, 0, 1, 2]
    assert where[order].tolist() == list(range(6))
    assert counts.tolist() == [2, 1, 2, 1]


# ---- the exported graph against the MoE kernels' contracts (agents/tools/contracts/moe_ops.py) --------------------
TOKENS, H, F, E, K = 6, 64, 48, 8, 2  # F's 2F = 96 and F = 48 differ from H: a transposed weight shows


def exported(tmp_path, cell, name: str = "moe") -> list[str]:
    """``cell(x, router_logits, gate_up, down)`` exported with the fused primitives in float16, read back and
    checked as ``llm-serving export --check`` does. (A weight stored (experts, out, in) MindSpore's own shape
    inference refuses, unless square, when no check can tell.)"""
    inputs = [np.zeros((TOKENS, H)), np.zeros((TOKENS, E)), np.zeros((E, H, 2 * F)), np.zeros((E, F, H))]
    path = tmp_path / name
    export(cell, *(Tensor(a.astype(np.float16)) for a in inputs), file_name=str(path), file_format="MINDIR")
    return [str(v) for v in check_graph(read_graph(path.with_suffix(".mindir")))]


@pytest.mark.parametrize("experts", [ExpertSlice(0, E, E), ExpertSlice.of_rank(E, 2, 1), ExpertSlice.of_rank(E, 4, 0)])
def test_the_served_wiring_passes_the_checker(tmp_path, experts):
    cell = AscendRoutedExperts(MoeOps(), K, True, experts)
    assert exported(tmp_path, cell if experts.whole else Sliced(cell, experts)) == []


class Sliced(nn.Cell):
    """An expert-parallel rank's graph takes its experts' weights only."""

    def __init__(self, cell: AscendRoutedExperts, experts: ExpertSlice) -> None:
        super().__init__()
        self.cell, self.first, self.count = cell, experts.first, experts.count

    def construct(self, x, logits, gate_up, down):
        part = slice(self.first, self.first + self.count)
        return self.cell(x, logits, gate_up[part], down[part])


def test_int8_experts_wired_as_served_pass_the_checker(tmp_path):
    """w8a16 on Ascend: the served cell's grouped matmuls over int8 experts [E, in, out] with antiquant_scale
    (E, out) in x's dtype (float16 here) pass the checker, whole and on an expert-parallel rank; and the wiring
    test's int8 form too (the mutations below change one thing of it)."""
    inputs = [np.zeros((TOKENS, H), np.float16), np.zeros((TOKENS, E), np.float16), np.zeros((E, H, 2 * F), np.int8),
              np.zeros((E, F, H), np.int8), np.zeros((E, 2 * F), np.float16), np.zeros((E, H), np.float16)]
    for experts in (ExpertSlice(0, E, E), ExpertSlice.of_rank(E, 2, 1)):
        cell = AscendRoutedExperts(MoeOps(), K, True, experts)
        path = tmp_path / f"int8_{experts.first}"
        export(cell if experts.whole else SlicedInt8(cell, experts), *(Tensor(a) for a in inputs),
               file_name=str(path), file_format="MINDIR")
        assert [str(v) for v in check_graph(read_graph(path.with_suffix(".mindir")))] == []
    assert exported(tmp_path, Wired(MoeWiring(int8=True)), name="int8_wired") == []


class SlicedInt8(nn.Cell):
    """An expert-parallel rank's graph over its int8 experts and their scales only."""

    def __init__(self, cell: AscendRoutedExperts, experts: ExpertSlice) -> None:
        super().__init__()
        self.cell, self.first, self.count = cell, experts.first, experts.count

    def construct(self, x, logits, gate_up, down, gate_up_scale, down_scale):
        part = slice(self.first, self.first + self.count)
        return self.cell(x, logits, gate_up[part], down[part], gate_up_scale[part], down_scale[part])


@pytest.mark.parametrize("experts", [ExpertSlice(0, EXPERTS, EXPERTS), ExpertSlice.of_rank(EXPERTS, 2, 0)])
def test_int8_experts_on_the_stand_ins_are_the_dequantized_experts(experts):
    """The stand-in grouped matmul applies antiquant_scale: int8 experts [in, out] with per-out scales give the
    reference on the dequantized experts (the float32 stand-ins: to float32 rounding)."""
    from agents.weights import packed as pw

    w, tokens, k = layer(11), 7, 2
    x = np.random.default_rng(12).standard_normal((tokens, HIDDEN)).astype(np.float32)
    part = slice(experts.first, experts.first + experts.count)
    held, values = {}, dict(w)
    for name in ("gate_up", "down"):
        e, out, inp = w[name].shape
        q, scale = pw.quantize_rows(w[name].reshape(e * out, inp))
        values[name] = pw.dequantize_rows(q, scale).reshape(e, out, inp)
        held[name] = (np.ascontiguousarray(q.reshape(e, out, inp)[part].transpose(0, 2, 1)),
                      scale.reshape(e, out)[part])
    cell = AscendRoutedExperts(MoeReferenceOps(), k, True, experts)
    got = cell(Tensor(x), Tensor(x @ w["router"].T), Tensor(held["gate_up"][0]), Tensor(held["down"][0]),
               Tensor(held["gate_up"][1]), Tensor(held["down"][1])).asnumpy()
    whole = moe_forward(x, w["router"], values["gate_up"], values["down"], k, True)
    if experts.whole:
        np.testing.assert_allclose(got, whole, rtol=2e-5, atol=2e-6)
    float_part = routed(x, values, k, True, experts)  # the float cell on the dequantized experts
    np.testing.assert_allclose(got, float_part, rtol=2e-5, atol=2e-6)
    assert np.abs(got - routed(x, w, k, True, experts)).max() > 1e-4  # really quantized


@dataclass(frozen=True)
class MoeWiring:
    """The routed experts' wiring with one thing changed; the defaults are the served wiring's."""

    k: int = K
    ids_output: int = 1  # the gating output taken as expert ids (2: its row ids)
    active_num: int = 0  # > 0: only that many picks routed ("Active scenario")
    count_flag: int = 2  # the routing's expert_tokens_count_or_cumsum_flag
    list_output: int = 2  # the routing output taken as the group list (3: counts before capacity)
    list_int64: bool = True
    list_type: int = 1
    index_output: int = 1  # the routing output the unpermute reads (0 would not type; 1: expanded_row_idx)
    index_from_gating: bool = False  # the unpermute reads the gating's row ids instead
    bias: bool = False  # a bias on the experts' outputs
    expert_num: int = E  # the experts routed to (the weights hold E)
    int8: bool = False  # the experts int8 (w8a16), dequantized by antiquant_scale
    # the scales: "per-out" (E, N) in x's dtype (int8 only), "none", "per-in" (E, K), "float32", "on-float" (a
    # float weight given per-out scales)
    antiquant: str = "per-out"


class Wired(nn.Cell):
    def __init__(self, w: MoeWiring) -> None:
        super().__init__()
        self.w = w
        self.gating, self.routing = MoeGatingTopKSoftmax(), MoeInitRoutingV2()
        self.grouped, self.unpermute, self.swiglu = GroupedMatmulV4(), MoeTokenUnpermute(), Swiglu()

    def mm(self, x, weight, counts):
        bias = [ops.zeros((weight.shape[0], weight.shape[2]), weight.dtype)] if self.w.bias else None
        scale, kind = None, self.w.antiquant
        if self.w.int8 or kind == "on-float":  # scales computed from the weight, so the graph shows their shape
            rows = weight[:, :, 0] if kind == "per-in" else weight[:, 0, :]
            scale = None if kind == "none" else [rows.astype(ms.float32 if kind == "float32" else x.dtype)]
            weight = weight.astype(ms.int8) if self.w.int8 else weight
        return self.grouped([x], [weight], bias, None, None, scale, None, None, counts, None, None, None,
                            3, 0, self.w.list_type)[0]

    def construct(self, x, logits, gate_up, down):
        gating = self.gating(logits, None, self.w.k)
        weights, ids, rows = gating[0], gating[self.w.ids_output], gating[2]
        routed = self.routing(x, ids, self.w.active_num, 0, self.w.expert_num, 0, self.w.count_flag, True)
        counts = routed[self.w.list_output].astype(ms.int64 if self.w.list_int64 else ms.int32)
        out = self.mm(self.swiglu(self.mm(routed[0], gate_up, counts), -1), down, counts)
        where = rows.reshape(-1) if self.w.index_from_gating else routed[self.w.index_output]
        return self.unpermute(out, where, weights, False, None)


MOE_MISTAKES = {  # each exports without complaint; the rule that refuses it, and a phrase of its message
    "the gating's row ids routed as expert ids": (MoeWiring(ids_output=2), "expert-ids-from-gating",
                                                  "MoeGatingTopKSoftmax's output 1"),
    "an active-token cap": (MoeWiring(active_num=TOKENS * K), "dropless-routing", "active_num must be 0"),
    "cumulative counts read as sizes": (MoeWiring(count_flag=1), "row-groups-from-routing",
                                        "does not read the routing's cumulative sums"),
    "sizes read as cumulative counts": (MoeWiring(list_type=0), "row-groups-from-routing", "it must be 1"),
    "counts before capacity (unset when dropless)": (MoeWiring(list_output=3), "row-groups-from-routing",
                                                     "got output 3 of MoeInitRoutingV2"),
    "an int32 group list": (MoeWiring(list_int64=False), "row-groups-from-routing", "must be int64"),
    "a bias on the experts": (MoeWiring(bias=True), "experts-in-by-out", "bias must be None"),
    "routed to more experts than the weights hold": (MoeWiring(expert_num=E + 2), "experts-in-by-out",
                                                     "group_list's 10 groups are not the weight's 8 experts"),
    "unpermuted by the gating's row ids": (MoeWiring(index_from_gating=True), "unpermute-by-routing-index",
                                           "MoeInitRoutingV2's output 1"),
    "k above the experts": (MoeWiring(k=E + 1), "gating-logits-and-k", "k must be a constant in 1..experts (8)"),
    "int8 experts without their scales": (MoeWiring(int8=True, antiquant="none"), "experts-in-by-out",
                                          "an int8 weight needs antiquant_scale"),
    "int8 experts scaled per input row": (MoeWiring(int8=True, antiquant="per-in"), "experts-in-by-out",
                                          "antiquant_scale must be (experts, out) (8, 96)"),
    "int8 experts' scales in float32 beside float16 x": (MoeWiring(int8=True, antiquant="float32"),
                                                          "experts-in-by-out", "antiquant_scale must be in x's dtype"),
    "float experts given antiquant scales": (MoeWiring(antiquant="on-float"),
                                             "experts-in-by-out", "antiquant_scale must be None"),
}


@pytest.mark.parametrize("mistake", list(MOE_MISTAKES))
def test_each_moe_wiring_mistake_is_refused_naming_the_rule(tmp_path, mistake):
    wiring, rule, phrase = MOE_MISTAKES[mistake]
    assert exported(tmp_path, Wired(MoeWiring())) == []  # the same cell, right, passes
    found = exported(tmp_path, Wired(wiring), name="mistake")
    assert any(f"[{rule}]" in v and phrase in v for v in found), found
