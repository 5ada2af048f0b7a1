"""The requests a simulation replays: when each arrives, its prompt's token ids and how many tokens it gets.

From an alpaca dataset as the load tool sends it (``llm_serving.bench``: the contest's prompt,
``max_new_tokens`` = the reference output's token count, Poisson / gamma / constant / all-at-once arrivals), or from a
load-test result file (``result_*.json``): the recorded send times, what each asked for and where the server's model
ended it, which is how a simulation is set against a measured run. Prompts become token ids through the served
tokenizer when there is one; otherwise words become ids by hashing (the same word, the same id: shared prefixes stay
shared for the prefix cache) and each word counts ``tokens_per_word`` tokens, as the load tool estimates.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from llm_serving.bench import BenchError
from llm_serving.bench.arrivals import arrival_offsets
from llm_serving.bench.dataset import contest_prompt, default_dataset, load_dataset

Encode = Callable[[str], list[int]]


class WorkloadError(ValueError):
    """A workload that cannot be built (the message names the file or value)."""


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival_s: float  # after the first request
    prompt: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int  # what the request asks for (the admission policy orders by it)
    output_tokens: int | None = None  # where the model ends it (an end-of-sequence token); None: max_new_tokens
    priority: int = 0  # under the "priority" policy lower is admitted earlier and preempted later (vLLM's)
    adapter: str | None = None  # the LoRA adapter its model names (None: the base model)

    @property
    def length(self) -> int:
        """Tokens it generates."""
        return self.max_new_tokens if self.output_tokens is None else min(self.output_tokens, self.max_new_tokens)


def word_encoder(vocab_size: int, tokens_per_word: float = 1.3, first_id: int = 3) -> Encode:
    """Ids for text without its tokenizer: ``<s>`` (1), then ``ceil(words * tokens_per_word)`` ids, each word's
    from a hash of the word (so equal prefixes give equal ids), spread over the words."""
    span = max(vocab_size - first_id, 1)

    def encode(text: str) -> list[int]:
        words = text.split()
        n = math.ceil(len(words) * tokens_per_word)
        ids = [first_id + zlib.crc32(f"{words[i * len(words) // n]}#{i}".encode()) % span for i in range(n)]
        return [1, *ids]

    return encode


def from_dataset(path: str | Path, num: int, encode: Encode, qps: float = math.inf, arrival: str = "poisson",
                 burstiness: float = 1.0, seed: int = 0, max_new_tokens: int | None = None) -> list[SimRequest]:
    """``num`` requests cycling through an alpaca dataset in order, as ``loadtest`` sends them."""
    try:
        records = load_dataset(default_dataset(path))
        offsets = arrival_offsets(num, qps, arrival, burstiness, seed)
    except BenchError as exc:
        raise WorkloadError(str(exc)) from None
    out = []
    for i in range(num):
        rec = records[i % len(records)]
        prompt = contest_prompt(rec)
        new = max(len(encode(rec["output"])) - 1, 1)  # without the <s> the encoder adds
        if max_new_tokens is not None:
            new = min(new, max_new_tokens)
        out.append(SimRequest(i, float(offsets[i]), prompt, tuple(encode(prompt)), new))
    return out


def from_results(path: str | Path, encode: Encode) -> list[SimRequest]:
    """The requests of a load-test result file at their recorded send times, asking for what they asked and ending
    where the server's model ended them (failed ones are left out: they did no work the server finished)."""
    path = Path(path)
    try:
        rows = json.loads(path.read_text())
        out = [SimRequest(int(r["index"]), float(r["send_time"]), r["input"], tuple(encode(r["input"])),
                          max(int(r["max_new_tokens"]), int(r["output_tokens"])), int(r["output_tokens"]))
               for r in rows if r.get("success") and int(r.get("output_tokens") or 0) > 0]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WorkloadError(f"cannot read load-test results {path}: {exc}") from None
    if not out:
        raise WorkloadError(f"{path} holds no successful request to replay")
    return sorted(out, key=lambda r: r.arrival_s)


def retimed(requests: Sequence[SimRequest], qps: float, arrival: str = "poisson", burstiness: float = 1.0,
            seed: int = 0) -> list[SimRequest]:
    """The same requests in index order on a fresh arrival schedule (as the load tool would send them)."""
    ordered = sorted(requests, key=lambda r: r.index)
    try:
        offsets = arrival_offsets(len(ordered), qps, arrival, burstiness, seed)
    except BenchError as exc:
        raise WorkloadError(str(exc)) from None
    return [replace(r, arrival_s=float(t)) for r, t in zip(ordered, offsets)]


def clip_to_context(requests: Sequence[SimRequest], max_model_len: int) -> list[SimRequest]:
    """Requests as admission passes them: prompt kept, ``max_new_tokens`` lowered to fit the context (the engine's
    ``clip_to_context``); a prompt that does not fit at all is an error naming the request."""
    out = []
    for r in requests:
        room = max_model_len - len(r.prompt_ids)
        if room < 1:
            raise WorkloadError(f"request {r.index}: its prompt of {len(r.prompt_ids)} tokens leaves no room in "
                                f"max_model_len {max_model_len}")
        out.append(r if r.max_new_tokens <= room else replace(r, max_new_tokens=room))
    return out
