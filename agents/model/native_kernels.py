"""CPU kernels written in C++ and run as MindSpore AOT ``ops.Custom`` ops, compiled on first use.

Why: MindSpore's CPU backend has no fused paged-attention op, and the portable gather + batched-matmul decode
attention copies every sequence's K/V context before reading it again (see docs/model.md). The kernel sources
live in ``agents/model/kernels/``, built together into one library (so that all ops share one pool of helper threads,
``kernels/common.h``) once per source hash and compiler flags into a cache directory (``$LLM_SERVING_KERNEL_DIR``,
default ``kernels/`` under the cache root, ``llm_serving.protocol.paths``) with the machine's ``g++``, written to a
temporary name and renamed so that several agent processes may build at once. The cache key includes the CPU's
model and flags, since the code is compiled for the machine's own instruction set.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mindspore import dtype as mstype
from mindspore import ops

from llm_serving.protocol.paths import cache_root

KERNEL_SOURCES = Path(__file__).resolve().parent / "kernels"
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-pthread", "-shared", "-fPIC", "-std=c++17")


class KernelBuildError(RuntimeError):
    """No C++ compiler, or the kernel did not compile (the message carries the compiler's output)."""


def kernel_dir() -> Path:
    return Path(os.environ.get("LLM_SERVING_KERNEL_DIR") or cache_root() / "kernels")


def compiler() -> str | None:
    """The C++ compiler to use (``$CXX`` or ``g++``), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _cpu_identity() -> str:
    """The CPU's model and feature flags: ``-march=native`` code must not be reused on another CPU (a home
    directory shared between machines would otherwise hand it an illegal instruction)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return platform.machine() + "".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def build() -> Path:
    """Compile every ``agents/model/kernels/*.cc`` into one shared library (cached) and return its path."""
    sources = sorted(KERNEL_SOURCES.glob("*.cc"))
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError(f"no C++ compiler found (looked for {os.environ.get('CXX', 'g++')!r}); "
                               "install g++ or set model_config.kernels: portable")
    headers = b"".join(h.read_bytes() for h in sorted(KERNEL_SOURCES.glob("*.h")))
    key = b"".join(s.name.encode() + s.read_bytes() for s in sources) + headers
    digest = hashlib.sha256(key + " ".join((cxx, *CXX_FLAGS, _cpu_identity())).encode()).hexdigest()[:16]
    target = kernel_dir() / f"kernels-{digest}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    except OSError as exc:
        raise KernelBuildError(f"cannot write kernels to {target.parent} ({exc}); set LLM_SERVING_KERNEL_DIR "
                               "to a writable directory") from exc
    os.close(fd)
    try:
        result = subprocess.run([cxx, *CXX_FLAGS, "-o", tmp, *map(str, sources)], check=False,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(f"compiling {KERNEL_SOURCES} failed:\n{result.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _custom(library: Path, entry: str, out_shape, out_dtype) -> ops.Custom:
    return ops.Custom(f"{library}:{entry}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot")


def _same(x, *_):
    return x


@dataclass(frozen=True)
class NativeOps:
    """The native ops (built from ``agents/model/kernels/``).

    Attention (``paged_attention.cc``): ``decode(qkv, cos, sin, slot_mapping, block_tables, context_lens,
    block_offsets, kv_cache)`` and ``prefill(qkv, cos, sin, slot_mapping, query_lens, kv_cache)`` (ragged: the
    prompts back to back) and ``chunked(qkv, cos, sin, slot_mapping, query_lens, context_lens, block_tables,
    block_offsets, kv_cache)`` (ragged chunks over cached context, ``agents.runtime.mixed_steps``) return ``[tokens,
    hidden_size]`` and write the step's K/V into the layer's ``kv_cache`` ``[2 * kv_heads, slots, head_dim]`` in
    place. ``greedy(logits) -> (token ids, log-probabilities)``
    (``greedy_pick.cc``). The projections (``linear.cc``, weights packed by ``agents.weights.packed``) are made
    per output width by the methods below; the native CPU backend (``agents.model.backends.native_cpu``) uses them
    where ``projections`` is true. Each projection takes its packed weight as float32 panels (exact), float16
    panels (precision ``half``) or int32 bfloat16 pairs (``agents.weights.packed.pack_bf16``: precision ``fast``, where
    ``bf16`` says the CPU has the instruction for it).
    """

    decode: ops.Custom
    prefill: ops.Custom
    chunked: ops.Custom
    greedy: ops.Custom
    library: Path
    projections: bool  # the projections' kernel is vectorized (AVX-512); else the backend keeps MindSpore's MatMul
    bf16: bool = False  # its bfloat16 tiles use AVX512_BF16 (precision fast; int32-packed weights)

    def poll_helpers(self, on: bool) -> None:
        """Turns the kernel helper threads' polling for the next op on or off (``kernels/common.h``): on for a
        small step (its ops are short next to a helper's wake-up), off after each step (the master wants the
        core until the next one)."""
        _loaded(self.library).KernelHelpersPoll(int(on))

    def linear(self, out_dim: int) -> ops.Custom:
        """``(x, packed w) -> x @ W^T`` of width ``out_dim`` (the benchmarks' reference matmul)."""
        return _custom(self.library, "Linear", lambda x, *_: [x[0], out_dim], _same)

    # The fused projections take ``rows`` [1] int32 last: the leading rows of x that are real tokens; the
    # bucket's padding rows after them are not computed and come out as zeros.
    def norm_linear(self, out_dim: int) -> ops.Custom:
        """``(x, norm_weight, eps [1], packed w, rows) -> rmsnorm(x) @ W^T`` of width ``out_dim``."""
        return _custom(self.library, "NormLinear", lambda x, *_: [x[0], out_dim], _same)

    def norm_swiglu(self, ffn_dim: int) -> ops.Custom:
        """``(x, norm_weight, eps [1], packed [gate; up], rows) -> silu(g) * u`` of width ``ffn_dim``."""
        return _custom(self.library, "NormSwiGlu", lambda x, *_: [x[0], ffn_dim], _same)

    def partial_linear(self, out_dim: int) -> ops.Custom:
        """``(x, packed w, rows) -> x @ W^T`` of width ``out_dim``: a tensor-parallel rank's partial sum of a
        row-parallel projection (``agents.model.parallel``)."""
        return _custom(self.library, "PartialLinear", lambda x, *_: [x[0], out_dim], _same)

    # The same projections adding each row's LoRA update (``agents.model.lora``) in the same call: their inputs,
    # then every slot's ``a`` and ``b`` (``LoraCall`` in ``kernels/linear.cc`` gives the layouts) and ``slots``
    # [rows] int32 (each row's slot; < 0: none).
    def lora_norm_linear(self, out_dim: int) -> ops.Custom:
        """``(x, norm_weight, eps, packed w, rows, a, b, slots) -> rmsnorm(x) @ W^T + update``."""
        return _custom(self.library, "NormLinearLora", lambda x, *_: [x[0], out_dim], _same)

    def lora_norm_swiglu(self, ffn_dim: int) -> ops.Custom:
        """``(x, norm_weight, eps, packed [gate; up], rows, a, b, slots) -> silu(g) * u`` of the updated gate
        and up."""
        return _custom(self.library, "NormSwiGluLora", lambda x, *_: [x[0], ffn_dim], _same)

    def lora_partial_linear(self, out_dim: int) -> ops.Custom:
        """``(x, packed w, rows, a, b, slots) -> x @ W^T + update``."""
        return _custom(self.library, "PartialLinearLora", lambda x, *_: [x[0], out_dim], _same)

    def lora_residual_linear(self) -> ops.Custom:
        """``(x, packed w, residual, rows, a, b, slots) -> residual + x @ W^T + update``."""
        return _custom(self.library, "ResidualLinearLora", lambda x, w, residual, *_: residual, _same)

    def moe_experts(self) -> ops.Custom:
        """``(x, ids [m, k] int32, weights [m, k], gate_up [E, 2f, h], down [E, h, f], rows) -> y [m, h]``: a
        MoE layer's picked experts, read in place (``kernels/moe_experts.cc``)."""
        return _custom(self.library, "MoeExperts", lambda x, *_: x, _same)

    def moe_experts_int8(self) -> ops.Custom:
        """``(x, ids, weights, gate_up int8 [E, 2f, h], gate_up_scale [E, 2f], down int8 [E, h, f],
        down_scale [E, h], rows) -> y [m, h]``: ``moe_experts`` over w8a16 experts, each row float(q) * scale."""
        return _custom(self.library, "MoeExpertsInt8", lambda x, *_: x, _same)

    def moe_layer(self, int8: bool) -> ops.Custom:
        """``(x, norm_weight, eps [1], router [n, h], routing [4] int32, gate_up, [gate_up_scale,] down,
        [down_scale,] rows) -> y [m, h]``: a sparse layer's MLP slot but a shared expert (norm, routing, routed
        experts, residual where ``routing`` says), int8 experts with their scales where ``int8``
        (``kernels/moe_experts.cc`` MoeLayer)."""
        entry = "MoeLayer" + ("Int8" if int8 else "")
        return _custom(self.library, entry, lambda x, *_: x, _same)

    def residual_linear(self) -> ops.Custom:
        """``(x, packed w, residual, rows) -> residual + x @ W^T``."""
        return _custom(self.library, "ResidualLinear", lambda x, w, residual, rows: residual, _same)


@functools.cache
def _loaded(library: Path) -> ctypes.CDLL:
    """The library as MindSpore's Custom ops load it (the same path: the same loaded object and helper pool)."""
    return ctypes.CDLL(str(library))


def native_ops(hidden_size: int) -> NativeOps:
    """Build (or reuse) the kernel library and wrap its entry points as Custom ops."""
    kernels = build()

    def rows_by_hidden(qkv, *_):
        return [qkv[0], hidden_size]

    return NativeOps(
        decode=_custom(kernels, "PagedDecodeAttention", rows_by_hidden, _same),
        prefill=_custom(kernels, "PackedPrefillAttention", rows_by_hidden, _same),
        chunked=_custom(kernels, "ChunkedPrefillAttention", rows_by_hidden, _same),
        greedy=_custom(kernels, "GreedyPick", lambda logits: ([logits[0]], [logits[0]]),
                       lambda logits: (mstype.int32, mstype.float32)),
        library=kernels,
        projections=bool(_loaded(kernels).LinearIsVectorized()),
        bf16=bool(_loaded(kernels).LinearHasBf16()),
    )
