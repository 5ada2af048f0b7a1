"""The native CPU backend (agents/model/backends/native_cpu.py, agents/model/native_kernels.py) against the portable
graph ops and transformers, and the choice of backend."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from mindspore import Tensor

from agents.model import native_kernels
from agents.model.backends import select_backend
from agents.model.backends.native_cpu import NativeResidualLinear
from agents.model.native_kernels import native_ops
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.weights.checkpoints import load_weights
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import LlamaConfig
from tests.hf_reference import hf_greedy, load_hf
from tests.op_cell import OpCell
from tests.paged_driver import PagedDriver
from tests.script_runner import run_script

RC = RunnerConfig(num_blocks=200, block_size=8, max_model_len=96, prefill_batch_sizes=(8,),
                  prefill_seq_lengths=(32,), decode_batch_sizes=(4, 8), decode_block_widths=(12,))


def prompts(config: LlamaConfig, lens: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[config.bos_token_id] + rng.integers(3, config.vocab_size, n - 1).tolist() for n in lens]


# head_dim 64 and 128 take the kernel's unrolled paths (Llama-2 uses 128); 128 with 2 query heads per kv head.
# "generic" builds the kernels without AVX-512, so the plain C++ loops (other CPUs, Arm hosts) are checked too.
@pytest.mark.parametrize("heads,kv_heads,hidden,extra_flags", [
    (4, 2, 256, ()), (2, 1, 256, ()), (4, 2, 256, ("-mno-avx512f",))], ids=["dim64-gqa", "dim128-gqa", "generic"])
def test_native_equals_portable_and_transformers(tmp_path, monkeypatch, heads, kv_heads, hidden, extra_flags):
    if extra_flags:
        monkeypatch.setattr(native_kernels, "CXX_FLAGS", native_kernels.CXX_FLAGS + extra_flags)
        monkeypatch.setenv("LLM_SERVING_KERNEL_DIR", str(tmp_path / "kernels"))
    config = LlamaConfig(vocab_size=300, hidden_size=hidden, intermediate_size=320, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128)
    model_dir = build_random_model(tmp_path, config, seed=3, std=0.1)
    weights = load_weights(model_dir, config)
    runs = {}
    for kind in ("native", "portable"):
        runner = ModelRunner(config, weights, dataclasses.replace(RC, kernels=kind))
        runner.warmup()
        assert runner.kernels == kind
        # AVX-512 builds run the projections natively too; a build without it keeps MindSpore's MatMul
        native_projections = isinstance(runner.model.layers[0].residual_linear, NativeResidualLinear)
        assert native_projections == runner.skips_padding == (kind == "native" and not extra_flags)
        # 6 prompts in a decode bucket of 8 (padding rows), contexts crossing block borders, shuffled blocks
        runs[kind] = PagedDriver(runner, seed=5).generate(prompts(config, (3, 8, 9, 17, 30, 1), seed=2), 40)
    (native_ids, native_lp), (portable_ids, portable_lp) = runs["native"], runs["portable"]
    assert native_ids == portable_ids
    np.testing.assert_allclose(native_lp, portable_lp, atol=5e-5)  # float32 summation order differs
    hf = load_hf(model_dir)
    for prompt, got, got_lp in zip(prompts(config, (3, 8, 9, 17, 30, 1), seed=2), native_ids, native_lp):
        ref, ref_lp = hf_greedy(hf, prompt, 40)
        assert got == ref
        np.testing.assert_allclose(got_lp, ref_lp, atol=1e-4)


@pytest.fixture(scope="module")
def native_runner(tmp_path_factory):
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model_dir = build_random_model(tmp_path_factory.mktemp("tiny"), config, seed=1)
    runner = ModelRunner(config, load_weights(model_dir, config), dataclasses.replace(RC, kernels="native"))
    runner.warmup()
    return runner


def backend_for(rc: RunnerConfig):
    return select_backend(rc.kernels, rc.device_target, rc.dtype, 64)


def decode(block: int, context: int = 5) -> StepBatch:
    return StepBatch(np.ones(1, np.int32), np.array([context - 1], np.int32), np.array([8], np.int32),
                     np.ones(1, np.int32), np.array([context], np.int32), np.array([[block]], np.int32))


@pytest.mark.parametrize("batch,message", [
    (decode(block=RC.num_blocks), "blocks outside the KV cache"),
    (decode(block=-1), "blocks outside the KV cache"),
    (decode(block=1, context=RC.block_size + 1), "covered by the block tables"),
    (decode(block=1, context=0), "must be >= 1"),
    (dataclasses.replace(decode(block=1), slot_mapping=np.array([RC.num_blocks * RC.block_size], np.int32)),
     "slots outside the KV cache"),
])
def test_out_of_range_cache_indices_are_refused_before_any_write(native_runner, batch, message):
    cache = native_runner.model.layers[0].attention.caches()[0]
    before = cache.asnumpy().copy()
    with pytest.raises(ValueError, match=message):
        native_runner.step(batch)
    np.testing.assert_array_equal(cache.asnumpy(), before)
    assert native_runner.step(decode(block=1)).token_ids.shape == (1,)  # the runner still works afterwards


def test_auto_falls_back_to_portable_without_a_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("LLM_SERVING_KERNEL_DIR", str(tmp_path))
    assert backend_for(dataclasses.replace(RC, kernels="auto")).kernels == "portable"
    with pytest.raises(native_kernels.KernelBuildError, match="no C\\+\\+ compiler found"):
        backend_for(dataclasses.replace(RC, kernels="native"))


def test_auto_is_portable_where_the_kernel_does_not_apply():
    assert backend_for(dataclasses.replace(RC, dtype="float16")).kernels == "portable"
    with pytest.raises(ValueError, match="native kernels run on CPU with float32 only"):
        backend_for(dataclasses.replace(RC, dtype="bfloat16", kernels="native"))
    ascend = dataclasses.replace(RC, device_target="Ascend", dtype="float16")
    assert backend_for(ascend).name == "ascend"  # auto takes the device's own backend (its fused ops)
    assert backend_for(dataclasses.replace(ascend, kernels="native")).name == "ascend"
    with pytest.raises(ValueError, match="float32 is not served on Ascend"):
        dataclasses.replace(RC, device_target="Ascend")
    with pytest.raises(ValueError, match="kernels 'fast' is not one of"):
        dataclasses.replace(RC, kernels="fast")


def test_an_unwritable_kernel_dir_is_a_build_error(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LLM_SERVING_KERNEL_DIR", str(blocker / "kernels"))  # a directory below a regular file
    with pytest.raises(native_kernels.KernelBuildError, match="set LLM_SERVING_KERNEL_DIR"):
        native_kernels.build()
    assert backend_for(dataclasses.replace(RC, kernels="auto")).kernels == "portable"  # auto falls back


def test_compile_errors_carry_the_compiler_output(monkeypatch, tmp_path):
    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "broken.cc").write_text("int f( {\n")
    monkeypatch.setattr(native_kernels, "KERNEL_SOURCES", sources)
    monkeypatch.setenv("LLM_SERVING_KERNEL_DIR", str(tmp_path / "out"))
    with pytest.raises(native_kernels.KernelBuildError, match="broken.cc"):
        native_kernels.build()
    assert list((tmp_path / "out").iterdir()) == []  # no half-written library is left behind


def test_built_library_is_cached_by_source(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_SERVING_KERNEL_DIR", str(tmp_path))
    first = native_kernels.build()
    mtime = first.stat().st_mtime_ns
    assert native_kernels.build() == first
    assert first.stat().st_mtime_ns == mtime


def task_pool_driver(tmp_path: Path) -> Path:
    """tests/task_pool_check.cc compiled against the kernels' common.h."""
    cxx = native_kernels.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    flags = [f for f in native_kernels.CXX_FLAGS if f not in ("-shared", "-fPIC")]
    driver = tmp_path / "task_pool_check"
    subprocess.run([cxx, *flags, f"-I{native_kernels.KERNEL_SOURCES}", "-o", str(driver),
                    str(Path(__file__).parent / "task_pool_check.cc")], check=True, capture_output=True)
    return driver


@pytest.mark.parametrize("threads,spin_us", [("1", "0"), ("4", "0"), ("4", "300"), ("2", None)])
def test_task_pool_runs_every_task_once_also_after_fork(tmp_path, threads, spin_us):
    """The helper pool shared by the kernels (agents/model/kernels/common.h), in a compiled driver: thousands of calls
    of 1-700 tasks, then a forked child (which has no helpers) and the parent again; with helpers that sleep at
    once, that poll for the next call (LLM_SERVING_KERNEL_SPIN_US), and with the default."""
    env = {**os.environ, "LLM_SERVING_KERNEL_THREADS": threads}
    env.pop("LLM_SERVING_KERNEL_SPIN_US", None)
    if spin_us is not None:
        env["LLM_SERVING_KERNEL_SPIN_US"] = spin_us
    out = subprocess.run([str(task_pool_driver(tmp_path))], check=False, capture_output=True, text=True,
                         timeout=120, env=env)
    assert (out.returncode, out.stdout.strip()) == (0, "ok")


def test_helpers_poll_only_while_polling_is_on(tmp_path):
    """A helper polling for the next call (bound: 20 s) uses a core until polling is turned off (the agent does
    after each step), none after it, and polls again once it is turned on (the agent does for a small step)."""
    env = {**os.environ, "LLM_SERVING_KERNEL_THREADS": "2", "LLM_SERVING_KERNEL_SPIN_US": "20000000"}
    out = subprocess.run([str(task_pool_driver(tmp_path)), "poll"], check=False, capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stdout


def test_all_ops_share_one_library_and_pool(native_runner):
    """Every native op and the agent's polling switch (ctypes) use one loaded library: one helper pool per
    process."""
    native = native_runner.backend.native
    library = str(native.library)
    assert all(op.func.startswith(library + ":") for op in (native.decode, native.prefill, native.chunked,
                                                             native.greedy, native.norm_linear(64)))
    native_runner.step(decode(block=1))  # MindSpore has loaded it; ctypes switches polling
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert len([line for line in maps if line.endswith(library) and " r-xp " in line]) == 1  # loaded once


KERNEL_GUARD_SCRIPT = """
import numpy as np, mindspore as ms
from mindspore import Tensor, nn
from agents.model.native_kernels import native_ops
ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")


class Attention(nn.Cell):
    def __init__(self):
        super().__init__()
        self.op = native_ops(64).decode

    def construct(self, *inputs):
        return self.op(*inputs)


dim, batch, blocks, block_size = 32, 2, 4, 4
f32 = lambda *shape: Tensor(np.zeros(shape, np.float32))
i32 = lambda values: Tensor(np.array(values, np.int32))
cache = f32(2, blocks * block_size, dim)
try:
    Attention()(f32(batch, 4 * dim), f32(batch, dim), f32(batch, dim), i32([4, 8]), i32([[1], [{block}]]),
                i32([1, 1]), i32(list(range(block_size))), cache)
    print("no error")
except RuntimeError as exc:
    print("error:", str(exc).splitlines()[0])
"""


@pytest.mark.parametrize("block,expected", [(2, "no error"), (4, "is 5")])
def test_kernel_checks_block_tables_itself(tmp_path, block, expected):
    """The kernel's own guard, behind the runner's: run in a subprocess because MindSpore refuses every later
    step of a process once a kernel failed."""
    result = run_script(tmp_path, KERNEL_GUARD_SCRIPT.replace("{block}", str(block)))
    assert expected in result.stdout, result.stdout + result.stderr[-2000:]


def test_ragged_prefill_padding_writes_nothing(native_runner):
    """Two prompts in a ragged call padded to 32 tokens and 8 sequences: only their own slots change."""
    caches = [c for layer in native_runner.model.layers for c in layer.attention.caches()]
    before = [c.asnumpy().copy() for c in caches]
    lens = np.array([5, 9], np.int32)
    slots = np.concatenate([np.arange(16, 21), np.arange(40, 49)]).astype(np.int32)
    batch = StepBatch(np.arange(3, 17, dtype=np.int32), np.concatenate([np.arange(5), np.arange(9)]).astype(
        np.int32), slots, lens, lens.copy(), np.zeros((2, 1), np.int32))
    assert native_runner.bucket_inputs(batch)[0] == ("ragged", 8, 32)
    native_runner.step(batch)
    for old, cache in zip(before, caches):
        changed = np.flatnonzero(np.any(cache.asnumpy() != old, axis=(0, 2)))  # [2 * kv heads, slots, dim]
        assert set(changed.tolist()) <= set(slots.tolist()) and len(changed) > 0


@pytest.fixture(scope="module")
def ops_():
    return native_ops(64)


def test_greedy_pick_takes_the_first_maximum_and_its_log_softmax(ops_):
    logits = np.array([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 0.0, 3.0 - 1e-6]], np.float32)
    ids, logprobs = OpCell(ops_.greedy)(Tensor(logits))
    assert ids.asnumpy().tolist() == [1, 0]  # ties go to the lowest id, as argmax in HF and MindSpore
    expected = logits.max(-1) - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) - logits.max(-1)
    np.testing.assert_allclose(logprobs.asnumpy(), expected, rtol=1e-6, atol=1e-6)
