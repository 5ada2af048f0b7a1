"""The Ascend backend on a real NPU: MindSpore's fused kernels against Hugging Face in the same dtype.

These run where ``ms.set_device("Ascend")`` works (a 910B with the CANN toolkit MindSpore 2.10 needs) and skip
elsewhere, saying why. Each runs ``tests/ascend_npu_check.py`` in a child process: this test process has already
put MindSpore on the CPU, and a process can hold one device target.
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
                "checked without one by export and by their CPU stand-ins (test_ascend_export.py, test_ascend_reference.py)")
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
    identical = sum(check_greedy_near(hf, p, t, lp, tie, atol)
                    for p, t, lp in zip(prompts, got["tokens"], got["logprobs"]))
    assert identical >= len(prompts) - 2
