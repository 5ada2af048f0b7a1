"""When each request of a load test is sent: Poisson, gamma or constant gaps at a mean rate, or all at once."""

from __future__ import annotations

import math

import numpy as np

from llm_serving.bench import BenchError

ARRIVALS = ("poisson", "gamma", "constant")


def arrival_offsets(n: int, qps: float, process: str = "poisson", burstiness: float = 1.0,
                    seed: int = 0) -> np.ndarray:
    """Send times in seconds after the first request (which goes at 0).

    poisson: exponential gaps of mean 1/qps; gamma: gaps of mean 1/qps with shape ``burstiness`` (< 1 is
    burstier, 1 is Poisson); constant: exactly 1/qps apart; qps = inf sends everything at once.
    """
    if process not in ARRIVALS:
        raise BenchError(f"arrival process must be one of {ARRIVALS}, got {process!r}")
    if not qps > 0:
        raise BenchError(f"-X/--qps must be > 0, got {qps}")
    if not burstiness > 0:
        raise BenchError(f"--burstiness must be > 0, got {burstiness}")
    if n <= 1 or math.isinf(qps):
        return np.zeros(max(n, 0))
    rng = np.random.default_rng(seed)
    mean = 1.0 / qps
    if process == "poisson":
        gaps = rng.exponential(mean, n - 1)
    elif process == "gamma":
        gaps = rng.gamma(burstiness, mean / burstiness, n - 1)
    else:
        gaps = np.full(n - 1, mean)
    return np.concatenate([[0.0], np.cumsum(gaps)])
