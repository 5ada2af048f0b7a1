"""Alpaca-format load-test workloads built from the packaged corpus (no third-party data).

The contest's load script reads ``[{"instruction", "input", "output"}]`` and asks for as many new tokens as
the reference ``output`` has, so what matters for a load test is the *shape* of the data: a short instruction,
an optional input passage (about 40% of Alpaca items have one), and a long-tailed output length. Lengths are
drawn from clamped log-normal distributions (in words) and the text is cut from ``data/corpus.txt`` (beside
this module), so a workload is realistic English, deterministic for a seed, and reproducible on any machine.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
DEFAULT_WORKLOAD_FILE = "alpaca_5010.json"  # the file name the contest's load script reads from its cwd
DEFAULT_NUM = 5010

_WITH_INPUT = (
    "Summarize the following text in a few sentences.",
    "Continue the passage below.",
    "Rewrite the following passage in plain language.",
    "List the main facts mentioned in this text.",
    "Explain what the passage below describes.",
    "Give the passage below a title and describe its tone.",
)
_WITHOUT_INPUT = (
    "Write a short paragraph about {topic}.",
    "Describe a scene that involves {topic}.",
    "Tell a brief story in which {topic} plays a part.",
    "Explain why {topic} might matter to someone.",
)
_NOUN_PHRASE = re.compile(r"\b(?:the|a|an) ([a-z]{4,})\b")  # "the umbrella": cheap noun finder


class WorkloadError(ValueError):
    """The corpus or the workload parameters cannot produce a workload."""


@dataclass(frozen=True)
class LengthDist:
    """A log-normal length in words (``median``, ``sigma`` of the log), rounded and clamped to [lo, hi]."""

    median: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0 or not 1 <= self.lo <= self.hi:
            raise WorkloadError(f"bad length distribution {self}: need median > 0, sigma >= 0, 1 <= lo <= hi")

    def sample(self, rng: random.Random) -> int:
        n = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(max(n, self.lo), self.hi)


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. Defaults approximate Alpaca: ~40% with input, outputs with median ~40 words."""

    num: int = DEFAULT_NUM
    seed: int = 0
    input_fraction: float = 0.4
    qa_fraction: float = 0.1  # share of input-less items that are corpus questions (answers start the output)
    input_words: LengthDist = field(default_factory=lambda: LengthDist(30.0, 0.7, 3, 300))
    output_words: LengthDist = field(default_factory=lambda: LengthDist(40.0, 0.9, 3, 400))

    def __post_init__(self) -> None:
        if self.num < 1:
            raise WorkloadError(f"num must be >= 1, got {self.num}")
        for name in ("input_fraction", "qa_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise WorkloadError(f"{name} must be in [0, 1], got {value}")


class _Corpus:
    """The corpus as one word stream with sentence starts, plus its ``Q:``/``A:`` pairs."""

    def __init__(self, path: Path):
        try:
            lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
        except (OSError, UnicodeDecodeError) as e:
            raise WorkloadError(f"cannot read workload corpus {path}: {e}") from e
        self.words: list[str] = []
        self.starts: list[int] = []  # word index of each sentence (line) start
        self.qa: list[tuple[str, int]] = []  # (question, word index where its answer starts)
        question = None
        for line in lines:
            if not line:
                continue
            if line.startswith("Q:"):
                question = line[2:].strip()
                continue
            if line.startswith("A:"):
                line = line[2:].strip()
                if question:
                    self.qa.append((question, len(self.words)))
            question = None
            self.starts.append(len(self.words))
            self.words.extend(line.split())
        if len(self.words) < 50:
            raise WorkloadError(f"workload corpus {path} is too small ({len(self.words)} words, need >= 50)")

    def passage(self, start: int, n: int) -> str:
        """``n`` words from word ``start``, wrapping around the end of the corpus."""
        total = len(self.words)
        return " ".join(self.words[(start + i) % total] for i in range(n))


def make_workload(spec: WorkloadSpec = WorkloadSpec(),
                  corpus: str | Path | None = None) -> list[dict[str, str]]:
    """Generate ``spec.num`` Alpaca records; identical output for identical ``spec`` and corpus."""
    text = _Corpus(Path(corpus) if corpus is not None else DEFAULT_CORPUS)
    rng = random.Random(spec.seed)
    records = []
    for _ in range(spec.num):
        n_out = spec.output_words.sample(rng)
        if rng.random() < spec.input_fraction:
            n_in = spec.input_words.sample(rng)
            start = rng.choice(text.starts)
            instruction = rng.choice(_WITH_INPUT)
            inp = text.passage(start, n_in)
            # A continuation follows its input; other tasks answer from elsewhere in the corpus.
            out_start = start + n_in if instruction.startswith("Continue") else rng.choice(text.starts)
            output = text.passage(out_start, n_out)
        elif text.qa and rng.random() < spec.qa_fraction:
            instruction, out_start = rng.choice(text.qa)
            inp, output = "", text.passage(out_start, n_out)
        else:
            output = text.passage(rng.choice(text.starts), n_out)
            topics = _NOUN_PHRASE.findall(output)
            topic = f"the {rng.choice(topics)}" if topics else "the sea"
            instruction, inp = rng.choice(_WITHOUT_INPUT).format(topic=topic), ""
        records.append({"instruction": instruction, "input": inp, "output": output})
    return records


def write_workload(records: Sequence[dict[str, str]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(list(records), ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return path


def _parser() -> argparse.ArgumentParser:
    d = WorkloadSpec()
    p = argparse.ArgumentParser(
        prog="make_workload",
        description="Write an alpaca-format load-test workload cut from the packaged corpus.",
    )
    p.add_argument("-o", "--output", default=DEFAULT_WORKLOAD_FILE, help="json file to write (%(default)s)")
    p.add_argument("-n", "--num", type=int, default=d.num, help="number of records (%(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (%(default)s)")
    p.add_argument("--corpus", default=None, help="plain-text corpus (default: the packaged corpus.txt)")
    p.add_argument("--input-fraction", type=float, default=d.input_fraction,
                   help="share of records with a non-empty input (%(default)s)")
    p.add_argument("--input-words-median", type=float, default=d.input_words.median)
    p.add_argument("--input-words-sigma", type=float, default=d.input_words.sigma)
    p.add_argument("--max-input-words", type=int, default=d.input_words.hi,
                   help="cap on input words; keep prompts within the server's seq_length (%(default)s)")
    p.add_argument("--output-words-median", type=float, default=d.output_words.median)
    p.add_argument("--output-words-sigma", type=float, default=d.output_words.sigma,
                   help="sigma of log(output words); larger = longer tail (%(default)s)")
    p.add_argument("--min-output-words", type=int, default=d.output_words.lo)
    p.add_argument("--max-output-words", type=int, default=d.output_words.hi)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    d = WorkloadSpec()
    try:
        spec = WorkloadSpec(
            num=args.num,
            seed=args.seed,
            input_fraction=args.input_fraction,
            input_words=LengthDist(args.input_words_median, args.input_words_sigma, d.input_words.lo,
                                   args.max_input_words),
            output_words=LengthDist(args.output_words_median, args.output_words_sigma, args.min_output_words,
                                    args.max_output_words),
        )
        records = make_workload(spec, args.corpus)
    except WorkloadError as e:
        print(f"make_workload: error: {e}", file=sys.stderr)
        return 2
    path = write_workload(records, args.output)
    out_words = sorted(len(r["output"].split()) for r in records)
    with_input = sum(1 for r in records if r["input"])
    print(f"wrote {len(records)} records to {path} ({with_input} with input; output words: "
          f"median {out_words[len(out_words) // 2]}, max {out_words[-1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
