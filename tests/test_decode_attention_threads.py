"""PagedDecodeAttention (agents/model/kernels/paged_attention.cc) at batch 1 over a long context, where its kv heads are
shared with a helper thread: the same output bit for bit with one thread and with two, and numpy's attention.

The op is called through ctypes on the built library (no MindSpore graph), in a subprocess per thread count: the
kernels' helper pool is sized once per process ($LLM_SERVING_KERNEL_THREADS)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agents.model import native_kernels

N_KV, REP, DIM, BLOCK, LEN, BLOCKS = 4, 2, 64, 16, 700, 64

CHILD = """
import ctypes, sys
import numpy as np

library, out_path = sys.argv[1], sys.argv[2]
N_KV, REP, DIM, BLOCK, LEN, BLOCKS = {consts}
rng = np.random.default_rng(7)
heads = N_KV * REP
qkv = rng.standard_normal((1, (heads + 2 * N_KV) * DIM)).astype(np.float32)
inv = 1.0 / 10000 ** (np.arange(0, DIM, 2) / DIM)
angles = np.concatenate([(LEN - 1) * inv] * 2)[None, :]
cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
table = rng.permutation(np.arange(1, BLOCKS)).astype(np.int32)[None, :]  # scattered blocks, 0 unused
cache = rng.standard_normal((2 * N_KV, BLOCKS * BLOCK, DIM)).astype(np.float32)
slot = np.array([table[0, (LEN - 1) // BLOCK] * BLOCK + (LEN - 1) % BLOCK], np.int32)
lens, offsets = np.array([LEN], np.int32), np.arange(BLOCK, dtype=np.int32)
out = np.zeros((1, heads * DIM), np.float32)
arrays = [qkv, cos, sin, slot, table, lens, offsets, cache, out]
lib = ctypes.CDLL(library)
n = len(arrays)
params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
shape_arrays = [(ctypes.c_int64 * a.ndim)(*a.shape) for a in arrays]
shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shape_arrays])
dtypes = (ctypes.c_char_p * n)(*[str(a.dtype).encode() for a in arrays])
outs = []
lib.KernelHelpersPoll(1)
for _ in range(30):  # a helper that polls takes its share of some of these calls at least
    rc = lib.PagedDecodeAttention(n, params, ndims, shapes, dtypes, None, None)
    assert rc == 0, rc
    outs.append(out.copy())
assert all(np.array_equal(o, outs[0]) for o in outs), "calls differ"
np.savez(out_path, out=outs[0], qkv=qkv, cos=cos, sin=sin, table=table, cache=cache)
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    if native_kernels.compiler() is None:
        pytest.skip("no C++ compiler")
    os.environ["LLM_SERVING_KERNEL_DIR"] = str(tmp_path_factory.mktemp("kernels"))
    try:
        return native_kernels.build()
    finally:
        os.environ.pop("LLM_SERVING_KERNEL_DIR")


def run_child(library: Path, tmp_path: Path, threads: int) -> dict[str, np.ndarray]:
    script = tmp_path / "child.py"
    script.write_text(CHILD.replace("{consts}", repr((N_KV, REP, DIM, BLOCK, LEN, BLOCKS))))
    out = tmp_path / f"out{threads}.npz"
    env = {**os.environ, "LLM_SERVING_KERNEL_THREADS": str(threads)}
    result = subprocess.run([sys.executable, str(script), str(library), str(out)], check=False, capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return dict(np.load(out))


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[half:], x[:half]]) * sin


def test_one_long_sequence_gives_the_same_output_with_a_helper_and_numpys_attention(library, tmp_path):
    one, two = run_child(library, tmp_path, 1), run_child(library, tmp_path, 2)
    np.testing.assert_array_equal(one["out"], two["out"])
    qkv, cos, sin = one["qkv"][0].astype(np.float64), one["cos"][0], one["sin"][0]
    slots = (one["table"][0][:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)[:LEN]
    cache = one["cache"].astype(np.float64)  # after the op's write
    heads = N_KV * REP
    want = np.zeros((heads, DIM))
    for h in range(heads):
        kv = h // REP
        keys, values = cache[kv, slots].copy(), cache[N_KV + kv, slots].copy()
        # the step's own key (roped) and value, written into the cache at its slot before attention read them
        np.testing.assert_allclose(keys[-1], rope(qkv[(heads + kv) * DIM:(heads + kv + 1) * DIM], cos, sin),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(values[-1], qkv[(heads + N_KV + kv) * DIM:(heads + N_KV + kv + 1) * DIM])
        scores = keys @ rope(qkv[h * DIM:(h + 1) * DIM], cos, sin) / np.sqrt(DIM)
        p = np.exp(scores - scores.max())
        want[h] = (p / p.sum()) @ values
    np.testing.assert_allclose(one["out"][0], want.reshape(-1), rtol=1e-4, atol=1e-5)
