"""The training loop: tokenized corpus windows, AdamW with warm-up and cosine decay, held-out perplexity.

Reproducible from its seed on a given Python (the corpus) and MindSpore CPU build: the initial weights and the
window order come from numpy generators, and CPU kernels are deterministic for a fixed thread count.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from agents.training.llama_train import TrainLlama, TrainStep
from llm_serving.protocol.model_config import LlamaConfig


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch_size: int = 16
    seq_len: int = 256
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    seed: int = 0
    eval_every: int = 200


def token_stream(docs: list[list[int]], bos: int, eos: int) -> np.ndarray:
    """Documents as one stream, each ``<s> ... </s>``, so the model learns where texts start and end."""
    return np.concatenate([np.asarray([bos, *doc, eos], np.int32) for doc in docs])


def learning_rates(s: TrainSettings) -> np.ndarray:
    step = np.arange(s.steps, dtype=np.float64)
    warm = (step + 1) / s.warmup_steps
    progress = np.clip((step - s.warmup_steps) / max(1, s.steps - s.warmup_steps), 0, 1)
    cosine = s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + np.cos(math.pi * progress))
    return (s.peak_lr * np.where(step < s.warmup_steps, warm, cosine)).astype(np.float32)


def unigram_perplexity(train: np.ndarray, held_out: np.ndarray, vocab_size: int) -> float:
    """The baseline a model must beat: next token from train-set frequencies alone (add-one smoothed)."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[held_out[1:]].mean()))


def _windows(stream: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    n = (len(stream) - 1) // seq_len
    ids = stream[: n * seq_len].reshape(n, seq_len)
    labels = stream[1: n * seq_len + 1].reshape(n, seq_len)
    return ids, labels


def evaluate(net: TrainLlama, stream: np.ndarray, s: TrainSettings) -> float:
    """Perplexity over the held-out stream cut into consecutive windows (whole batches only)."""
    ids, labels = _windows(stream, s.seq_len)
    usable = len(ids) // s.batch_size * s.batch_size
    if usable == 0:
        raise ValueError(f"held-out text holds fewer than {s.batch_size} windows of {s.seq_len} tokens")
    net.set_train(False)
    losses = [float(net(Tensor(ids[i:i + s.batch_size]), Tensor(labels[i:i + s.batch_size])).asnumpy())
              for i in range(0, usable, s.batch_size)]
    net.set_train(True)
    return float(math.exp(np.mean(losses)))


def train(config: LlamaConfig, s: TrainSettings, train_stream: np.ndarray, held_out: np.ndarray,
          log: Callable[[str], None] = print) -> tuple[TrainLlama, dict]:
    """Train from scratch; return the net and a report (settings, held-out perplexity over time, duration)."""
    ms.set_seed(s.seed)
    net = TrainLlama(config, s.seq_len, s.seed)
    decayed = [p for p in net.trainable_params() if p.ndim == 2]  # no decay on norm weights
    rest = [p for p in net.trainable_params() if p.ndim != 2]
    groups = [{"params": decayed, "weight_decay": s.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    optimizer = nn.AdamWeightDecay(groups, learning_rate=Tensor(learning_rates(s)), beta2=0.95)
    step_cell = TrainStep(net, optimizer)
    rng = np.random.default_rng(s.seed)
    history, started, recent = [], time.monotonic(), []
    for step in range(s.steps):
        starts = rng.integers(0, len(train_stream) - s.seq_len - 1, s.batch_size)
        window = np.stack([train_stream[a:a + s.seq_len + 1] for a in starts])
        loss = float(step_cell(Tensor(window[:, :-1]), Tensor(window[:, 1:])).asnumpy())
        recent.append(loss)
        if (step + 1) % s.eval_every == 0 or step + 1 == s.steps:
            ppl = evaluate(net, held_out, s)
            history.append({"step": step + 1, "train_loss": round(float(np.mean(recent)), 4),
                            "held_out_perplexity": round(ppl, 3)})
            log(f"step {step + 1}/{s.steps}: train loss {np.mean(recent):.3f}, held-out perplexity {ppl:.2f} "
                f"({time.monotonic() - started:.0f} s)")
            recent = []
    params = sum(int(np.prod(p.shape)) for p in net.trainable_params())
    report = {"settings": asdict(s), "parameters": params, "train_tokens_seen": s.steps * s.batch_size * s.seq_len,
              "seconds": round(time.monotonic() - started, 1), "history": history,
              "held_out_perplexity": history[-1]["held_out_perplexity"]}
    return net, report
