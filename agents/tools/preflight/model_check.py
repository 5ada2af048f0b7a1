"""A one-layer and a whole (two-layer) seeded random Llama (``preflight_llama``, written by the master) served by
the Ascend backend, held to an independent reference: a prompt prefill (FlashAttentionScore), its second half
again as chunks over the cached first half (PagedAttention's multi-token path) and a decode step (PagedAttention),
each step's last-token logits; then the graph-call path the agents serve by (``agents.runtime.graph_call``: a
warmed shape through MindSpore's private ``_exec_pip``) against ``Cell.__call__`` on the same step.

The reference is Hugging Face transformers (float32) when importable (the test extra), else a numpy forward of the
same weights from the op references alone (``agents.tools.preflight.references``). Never our portable CPU
graph: on CPU the model under test runs that same Llama graph, so it would be checked against itself.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import numpy as np

from agents.model.backends import select_backend
from agents.model.backends.ascend import AscendBackend
from agents.model.backends.ascend_reference import ReferenceOps
from agents.runtime.graph_call import CompiledCell
from agents.runtime.runner import ModelRunner, RunnerConfig
from agents.tools.preflight import references as ref
from agents.weights.checkpoints import load_weights
from llm_serving.protocol.batch import StepBatch
from llm_serving.protocol.model_config import LlamaConfig
from llm_serving.protocol.preflight_verdict import CheckResult

# float16 serving against a float32 reference, on a model of std 0.2 weights (logits of a few units): the CPU
# stand-ins, which round where the NPU's kernels do, came within 0.08; a wrong mask, length or layout is off by units
LOGITS_ATOL = 0.15
BLOCK_SIZE, BLOCKS_PER_SEQ = 16, 4
PROMPT_LENS = (5, 40, 17)
CAUSAL = np.triu(np.ones((128, 128)), 1) * -10000.0  # the float16 mask flash_attention_th takes


def reference_name() -> str:
    return "transformers" if importlib.util.find_spec("transformers") is not None else "numpy"


def numpy_logits(weights: dict[str, np.ndarray], config: LlamaConfig, ids: list[int]) -> np.ndarray:
    """float64 logits of the last of ``ids`` by the op references alone: the whole prompt at once, causal."""
    heads, d, hidden, kv_dim = config.num_attention_heads, config.head_dim, config.hidden_size, config.kv_dim
    angles = np.outer(np.arange(len(ids)), 1.0 / config.rope_theta ** (np.arange(0, d, 2) / d))
    cos, sin = np.cos(np.concatenate([angles, angles], 1)), np.sin(np.concatenate([angles, angles], 1))
    lengths = np.array([len(ids)])
    x = weights["embed_tokens"][ids].astype(np.float64)
    for i in range(config.num_hidden_layers):
        w = {k.split(".", 2)[2]: v for k, v in weights.items() if k.startswith(f"layers.{i}.")}
        qkv = ref.rms_norm(x, w["attention_norm"], config.rms_norm_eps)[0] @ w["w_qkv"].T
        q, k, v = qkv[:, :hidden], qkv[:, hidden:hidden + kv_dim], qkv[:, hidden + kv_dim:]
        q, k = ref.rope(q, cos, sin, d), ref.rope(k, cos, sin, d)
        x = x + ref.flash_attention_th(q, k, v, CAUSAL, "float16", lengths, lengths, heads, d ** -0.5) @ w["wo"].T
        x = x + ref.swiglu(ref.rms_norm(x, w["ffn_norm"], config.rms_norm_eps)[0] @ w["w_gate_up"].T) @ w["w_down"].T
    return ref.rms_norm(x[-1:], weights["norm"], config.rms_norm_eps)[0][0] @ weights["lm_head"].T


def reference_logits(model_dir: Path, config: LlamaConfig, weights: dict[str, np.ndarray],
                     ) -> Callable[[list[int]], np.ndarray]:
    """Last-token logits of a token list by ``reference_name()``'s reference."""
    if reference_name() == "numpy":
        return lambda ids: numpy_logits(weights, config, ids)
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def logits(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1].double().numpy()
    return logits


def step(prompts: list[list[int]], start: list[int], stop: list[int]) -> StepBatch:
    """Each prompt's tokens ``start[i]:stop[i]`` over its cached ``:start[i]``, sequence ``i`` in blocks ``1 + i *
    BLOCKS_PER_SEQ ...`` (block 0 is the dummy block)."""
    tables = np.array([[1 + i * BLOCKS_PER_SEQ + j for j in range(BLOCKS_PER_SEQ)] for i in range(len(prompts))],
                      np.int32)
    positions = [np.arange(a, b) for a, b in zip(start, stop)]
    slots = [tables[i, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for i, p in enumerate(positions)]
    return StepBatch(np.concatenate([np.array(p[a:b]) for p, a, b in zip(prompts, start, stop)]).astype(np.int32),
                     np.concatenate(positions).astype(np.int32), np.concatenate(slots).astype(np.int32),
                     np.array([b - a for a, b in zip(start, stop)], np.int32), np.array(stop, np.int32), tables)


def served_runner(config: LlamaConfig, weights: dict[str, np.ndarray], device: str) -> ModelRunner:
    """The Ascend backend as the agents build it by default (its fused kernels, on CPU their stand-ins; float16;
    one dynamic-shape graph per step family, ``model_config.dynamic_shapes``' Ascend default)."""
    rc = RunnerConfig(num_blocks=1 + BLOCKS_PER_SEQ * len(PROMPT_LENS), block_size=BLOCK_SIZE, max_model_len=64,
                      prefill_batch_sizes=(4,), prefill_seq_lengths=(64,), decode_batch_sizes=(4,),
                      decode_block_widths=(BLOCKS_PER_SEQ,), dtype="float16", device_target=device, kernels="native",
                      mixed_steps=True, max_num_batched_tokens=64, dynamic_shapes=True)
    backend = (select_backend("native", device, "float16", config.hidden_size) if device == "Ascend"
               else AscendBackend(ReferenceOps(config.head_dim)))
    runner = ModelRunner(config, weights, rc, backend)
    runner.warmup()
    return runner


def model_results(device: str, model_dir: Path, seed: int = 7) -> list[CheckResult]:
    """The three steps' logits against the reference (one result per step), then the graph-call path's;
    ``model_dir``: a random Llama the master wrote (``preflight_llama``)."""
    config = LlamaConfig.from_model_dir(model_dir)
    scope = f"{config.num_hidden_layers}-layer"
    weights = load_weights(model_dir, config)
    want = reference_logits(model_dir, config, weights)
    rng = np.random.default_rng(seed)
    prompts = [[1] + rng.integers(3, config.vocab_size, n - 1).tolist() for n in PROMPT_LENS]
    try:
        runner = served_runner(config, weights, device)
    except (RuntimeError, TypeError, ValueError) as exc:
        detail = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return [CheckResult(f"{scope} model: build and warm-up", False, None, "-", detail)]
    half = [n // 2 for n in PROMPT_LENS]
    lens = list(PROMPT_LENS)
    results = []
    steps = (("prefill (FlashAttention)", [0] * len(prompts), half, half),
             ("chunks (PagedAttention q_seq_lens)", half, lens, lens))
    for name, start, stop, seen in steps:
        got = runner.step_logits(step(prompts, start, stop))
        results.append(logits_result(f"{scope} {name}", got, [want(p[:n]) for p, n in zip(prompts, seen)]))
    picks = [int(np.argmax(row)) for row in got]
    extended = [p + [t] for p, t in zip(prompts, picks)]
    decode = step(extended, lens, [n + 1 for n in lens])
    got = runner.step_logits(decode)
    results.append(logits_result(f"{scope} decode (PagedAttention)", got, [want(p) for p in extended]))
    results.append(graph_call_result(runner, decode, got, scope))
    return results


def logits_result(name: str, got: np.ndarray, want: list[np.ndarray]) -> CheckResult:
    diff = np.abs(got.astype(np.float64) - np.stack(want))
    worst = float(np.nanmax(diff)) if not np.isnan(diff).all() else float("nan")
    passed = bool(np.isfinite(diff).all() and worst <= LOGITS_ATOL)
    return CheckResult(name, passed, worst, f"{LOGITS_ATOL:g}", "NaN logits" if np.isnan(diff).any() else "")


def graph_call_result(runner: ModelRunner, batch: StepBatch, served: np.ndarray, scope: str) -> CheckResult:
    """The step just served (warmed shapes: ``CompiledCell``'s direct ``_exec_pip`` call) against the same step
    through ``Cell.__call__``. The decode step rewrites the same K/V at the same slots, so both read one cache."""
    cells = [g for g in runner.graphs.values() if isinstance(g, CompiledCell)]
    name = f"{scope} graph call (_exec_pip)"
    if not all(c._direct for c in cells):
        return CheckResult(name, False, None, "0", "MindSpore's _cell_graph_executor._exec_pip is missing: every "
                           "step takes Cell.__call__ (about 1 ms more a call)")
    for c in cells:
        c._direct = False
    try:
        public = runner.step_logits(batch)
    finally:
        for c in cells:
            c._direct = True
    worst = float(np.abs(served.astype(np.float64) - public).max())
    return CheckResult(name, bool(np.isfinite(worst) and worst <= 1e-3), worst, "1e-3 (vs Cell.__call__)")
