"""The Ascend backend on a real NPU: each fused kernel against its numpy reference (agents/tools/preflight),
and the whole model against Hugging Face in the same dtype.

The NPU tests run where ``ms.set_device("Ascend")`` works (a 910B with the CANN toolkit MindSpore 2.10 needs) and
skip elsewhere, saying why. Each runs a child process (``agents.tools.preflight.ops``, ``tests/ascend_npu_check.py``):
this test process has already put MindSpore on the CPU, and a process can hold one device target. The per-op
check also runs everywhere on the CPU stand-ins, so its script and its comparison are tested without an NPU.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from agents.tools.preflight.op_checks import int8_direction as preflight_int8_direction
from agents.tools.preflight.op_checks import op_results
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.model_config import LlamaConfig
from tests.hf_reference import check_greedy_near, load_hf, model_logits
from tests.script_runner import ROOT

# dtype -> (near-tie, logprob and logits tolerance) against Hugging Face in that dtype
TOLERANCE = {"float16": (0.1, 0.1), "bfloat16": (0.5, 0.5)}  # bfloat16: 3 fewer mantissa bits
PROBE = """import mindspore as ms
ms.set_device("Ascend", 0)
print((ms.Tensor([1.0], ms.float16) + 1).asnumpy())
"""


def npu_unavailable() -> str | None:
    """Why MindSpore cannot use an Ascend NPU here, or None when it can."""
    cann = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    if not cann and not ctypes.util.find_library("ascendcl") and not os.path.isdir("/usr/local/Ascend"):
        return ("no Ascend NPU: the CANN toolkit is not installed (no libascendcl, ASCEND_HOME_PATH unset), so "
                "MindSpore's Ascend plugin cannot load and ms.set_device('Ascend') fails; the Ascend graphs are "
                "checked without one by export and by their CPU stand-ins "
                "(test_ascend_export.py, test_ascend_reference.py)")
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=False)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        return f"no usable Ascend NPU: ms.set_device('Ascend', 0) failed: {last}"
    return None


@pytest.fixture(scope="module")
def npu():
    reason = npu_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_kernels_on_the_npu_match_hugging_face(npu, dtype, tmp_path):
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model_dir = build_random_model(tmp_path / "llama", config, seed=7, std=0.2)
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, config.vocab_size, n - 1).tolist() for n in (5, 40, 17, 64, 3, 30)]
    out = tmp_path / "npu.json"
    res = subprocess.run([sys.executable, "-m", "tests.ascend_npu_check", str(model_dir), dtype,
                          json.dumps(prompts), "16", str(out)], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["backend"] == "ascend"
    tie, atol = TOLERANCE[dtype]
    hf = load_hf(model_dir).to(getattr(torch, dtype))
    for prompt, row in zip(prompts[:2], got["logits"]):
        np.testing.assert_allclose(row, model_logits(hf, prompt).numpy(), atol=atol)
    for tokens, logprobs in ((got["tokens"], got["logprobs"]), (got["chunked"], got["chunked_logprobs"])):
        identical = sum(check_greedy_near(hf, p, t, lp, tie, atol) for p, t, lp in zip(prompts, tokens, logprobs))
        assert identical >= len(prompts) - 2


def run_ops(device: str, out) -> dict[str, np.ndarray]:
    res = subprocess.run([sys.executable, "-m", "agents.tools.preflight.ops", "--device", device, str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(np.load(out))


def check_ops(got: dict[str, np.ndarray]) -> None:
    """Every primitive's outputs against its numpy reference (``op_results``: float16 in, float64 references)."""
    failed = [result.line("ops") for result in op_results(got) if not result.passed]
    assert not failed, "\n".join(failed)


def int8_direction(got: dict[str, np.ndarray]) -> str:
    """How the kernel applied the int8 caches' antiquant scale (``model_config.ascend_int8_kv_direction``);
    ``AssertionError`` if neither or both directions match its answer."""
    direction, results = preflight_int8_direction(got)
    assert direction is not None, "int8 PagedAttention matches " + (
        "both directions" if all(r.passed for r in results) else "neither direction")
    return direction


def test_the_per_op_check_runs_and_compares_on_the_cpu_stand_ins(tmp_path):
    """The script the NPU test runs, on the stand-ins: the comparison passes, and fails when a kernel's answer is
    off (the check can fail)."""
    got = run_ops("CPU", tmp_path / "ops.npz")
    check_ops(got)
    broken = {**got, "out_chunk_0": got["out_chunk_0"][::-1].copy()}
    with pytest.raises(AssertionError):
        check_ops(broken)
    assert int8_direction(got) == "multiply"  # the stand-in's default (ReferenceOps)
    with pytest.raises(AssertionError, match="matches neither direction"):
        int8_direction({**got, "out_int8_decode_0": got["out_int8_decode_0"][::-1].copy()})


def test_each_fused_kernel_on_the_npu_matches_its_reference(npu, tmp_path):
    got = run_ops("Ascend", tmp_path / "ops.npz")
    check_ops(got)
    print(f"model_config.ascend_int8_kv_direction: {int8_direction(got)}")  # the NPU's answer, for the config
