"""OpenVINO's per-op times for batch-1 greedy decode of an exported model: runs INSIDE its venv.

    ~/.cache/llm-serving/peers/openvino-*/bin/python scripts/peers/profile_openvino.py \
        --ir-dir /tmp/llm-serving-benchmark/peer-openvino-ir [--context 256] [--steps 100]

Why: to set our kernels' times (scripts/bench_decode_kernels.cc) beside the peer's op by op. The IR is the one
scripts/benchmark.py exports (its stateful HF form, run here by the plain runtime with PERF_COUNT, float32, one
infer request, LATENCY hint); GenAI's pipeline swaps its SDPA for paged attention, the matmuls are the same.
Prints per op type the median over decode steps of its summed time (OpenVINO's "cpu" time is its wall time
too), and of infer()'s wall and process CPU time: on a shared machine only the last compares with ours (run
with --threads 1 beside ``LLM_SERVING_KERNEL_THREADS=1`` scripts/bench_decode_kernels.cc).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np
import openvino as ov


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ir-dir", required=True)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the timed decode steps")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=0, help="INFERENCE_NUM_THREADS (0: the plugin's choice)")
    args = ap.parse_args()
    core = ov.Core()
    model = core.read_model(f"{args.ir_dir}/openvino_model.xml")
    compiled = core.compile_model(model, "CPU", {"PERF_COUNT": "YES", "INFERENCE_PRECISION_HINT": "f32",
                                                 "KV_CACHE_PRECISION": "f32", "PERFORMANCE_HINT": "LATENCY",
                                                 **({"INFERENCE_NUM_THREADS": args.threads} if args.threads else {})})
    print("threads:", compiled.get_property("INFERENCE_NUM_THREADS"))
    req = compiled.create_infer_request()
    req.reset_state()
    prompt = np.arange(1, args.context + 1, dtype=np.int64)[None, :] % 7000 + 3
    feed = {"input_ids": prompt, "attention_mask": np.ones_like(prompt),
            "position_ids": np.arange(args.context, dtype=np.int64)[None, :], "beam_idx": np.zeros(1, np.int32)}
    req.infer(feed)
    token = int(req.get_tensor("logits").data[0, -1].argmax())
    by_type_real: dict[str, list[float]] = defaultdict(list)
    by_type_cpu: dict[str, list[float]] = defaultdict(list)
    walls, cpus, totals = [], [], []
    for step in range(args.steps + 5):
        pos = args.context + step
        feed = {"input_ids": np.array([[token]], np.int64), "attention_mask": np.ones((1, pos + 1), np.int64),
                "position_ids": np.array([[pos]], np.int64), "beam_idx": np.zeros(1, np.int32)}
        t0, c0 = time.perf_counter(), time.process_time()
        req.infer(feed)
        wall, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        token = int(req.get_tensor("logits").data[0, -1].argmax())
        if step < 5:
            continue
        walls.append(wall)
        cpus.append(cpu_s)
        real: dict[str, float] = defaultdict(float)
        cpu: dict[str, float] = defaultdict(float)
        for info in req.profiling_info:
            if info.status != info.Status.EXECUTED:
                continue
            key = f"{info.node_type} ({info.exec_type})"
            real[key] += info.real_time.total_seconds()
            cpu[key] += info.cpu_time.total_seconds()
        totals.append(sum(real.values()))
        for key, seconds in real.items():
            by_type_real[key].append(seconds)
            by_type_cpu[key].append(cpu[key])
    rows = [k for k in sorted(by_type_real, key=lambda k: -statistics.median(by_type_real[k]))
            if statistics.median(by_type_real[k]) >= 5e-6]  # the rest: a few microseconds in all
    print(f"{'op type (exec)':48} {'real us':>9} {'cpu us':>9}")
    for key in rows:
        real_us, cpu_us = statistics.median(by_type_real[key]) * 1e6, statistics.median(by_type_cpu[key]) * 1e6
        print(f"{key:48} {real_us:9.0f} {cpu_us:9.0f}")
    print(f"{'sum of ops':48} {statistics.median(totals) * 1e6:9.0f}")
    print(f"{'infer() wall':48} {statistics.median(walls) * 1e6:9.0f}   (context {args.context}, {args.steps} steps)")
    print(f"{'infer() process CPU':48} {statistics.median(cpus) * 1e6:9.0f}")


if __name__ == "__main__":
    main()
