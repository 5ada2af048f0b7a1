"""CTranslate2 peer: runs INSIDE its venv (scripts/peer_env.sh ctranslate2), never in the project's.

    python run_ctranslate2.py --requests REQ.json --out OUT.json --ct2-dir DIR

Converts the HF directory once with ``ct2-transformers-converter --quantization float32`` (cached in --ct2-dir)
and runs each concurrency level with the Generator, greedy (sampling_topk 1), EOS ignored (no end token). The
Generator has no continuous batching: at saturation every request goes to one generate_batch call (max batch
128, its own length-sorted batching); at level 1 each request is streamed with generate_tokens (first-token
time measured); at other levels consecutive groups of that many requests run as one generate_batch each (a
request's tokens arrive at its batch's end, so no TTFT there).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from peer_io import (
    LevelRun,
    PeerRequest,
    PeerResult,
    RequestFile,
    Timing,
    batches,
    one_at_a_time,
    read_requests,
    runner_parser,
    write_results,
)

MAX_BATCH = 128


def convert(model_dir: str, ct2_dir: Path) -> float | None:
    """Seconds the conversion took, or None when this model's converted directory is already there."""
    stamp = ct2_dir / "llm-serving-source.txt"
    if (ct2_dir / "model.bin").exists() and stamp.exists() and stamp.read_text() == model_dir:
        return None
    t0 = time.perf_counter()
    exe = Path(sys.executable).parent / "ct2-transformers-converter"
    cmd = [str(exe), "--model", model_dir, "--output_dir", str(ct2_dir), "--quantization", "float32", "--force"]
    print("[ctranslate2] " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    stamp.write_text(model_dir)
    return time.perf_counter() - t0


def options(max_new_tokens: int) -> dict:
    """Greedy, exactly max_new_tokens new ids, EOS not an end token (generate_batch also takes
    include_prompt_in_result=False: the prompt goes through the decoder at once)."""
    return {"max_length": max_new_tokens, "sampling_topk": 1, "end_token": [], "min_length": 0}


def vocabulary(ct2_dir: Path) -> list[str]:
    """Token strings by id: the Generator takes prompts as strings, which are exactly the ids' vocabulary
    entries (the converter writes the HF vocabulary in id order, every entry distinct)."""
    vocab = json.loads((ct2_dir / "vocabulary.json").read_text())
    if len(set(vocab)) != len(vocab):
        raise SystemExit(f"{ct2_dir}/vocabulary.json has repeated entries: ids cannot be sent as strings")
    return vocab


def run_batches(gen, vocab: list[str], rf: RequestFile, level: int) -> LevelRun:
    reqs = rf.level_requests(level)
    timings: list[Timing | None] = [None] * len(reqs)
    t0 = time.perf_counter()
    # One call per group; a call's max_length is its longest request's, shorter ones are cut after it.
    for group in batches(len(reqs), level):
        start = time.perf_counter() - t0
        rs = [reqs[i] for i in group]
        res = gen.generate_batch([[vocab[i] for i in r.prompt_ids] for r in rs], max_batch_size=MAX_BATCH,
                                 include_prompt_in_result=False, **options(max(r.max_new_tokens for r in rs)))
        end = time.perf_counter() - t0
        for i, r, out in zip(group, rs, res):
            timings[i] = Timing(r.index, list(out.sequences_ids[0][: r.max_new_tokens]), start, end)
    return LevelRun(level, time.perf_counter() - t0, timings)


def run_streamed(gen, vocab: list[str], rf: RequestFile) -> LevelRun:
    """One request at a time through generate_tokens: each token is timed as it comes."""

    def generate(r: PeerRequest) -> tuple[list[int], float]:
        ids, first = [], None
        for step in gen.generate_tokens([vocab[i] for i in r.prompt_ids], **options(r.max_new_tokens)):
            ids.append(step.token_id)
            if first is None:
                first = time.perf_counter()
        return ids, first if first is not None else time.perf_counter()

    return one_at_a_time(rf, generate)


def main() -> int:
    p = runner_parser(__doc__, "--ct2-dir", "where the converted model is cached")
    # 1 thread: on this shared 2-core machine under load (average ~7), 16 requests in one batch took 4.1 s on 1
    # thread, 105 s on 2 and 19.8 s with CTranslate2's default (its OpenMP threads spin against other jobs)
    p.add_argument("--threads", type=int, default=1, help="intra_threads (default 1; 0: CTranslate2's default)")
    args = p.parse_args()
    import ctranslate2

    rf = read_requests(args.requests)
    convert_s = convert(rf.model_dir, args.ct2_dir)
    vocab = vocabulary(args.ct2_dir)
    t0 = time.perf_counter()
    gen = ctranslate2.Generator(str(args.ct2_dir), device="cpu", compute_type="float32",
                                intra_threads=args.threads)
    gen.generate_batch([[vocab[i] for i in rf.requests[0].prompt_ids]], include_prompt_in_result=False,
                       **options(2))  # warm-up
    load_s = time.perf_counter() - t0
    runs = []
    for level in rf.levels:
        runs.append(run_streamed(gen, vocab, rf) if level == 1 else run_batches(gen, vocab, rf, level))
        print(f"[ctranslate2] level {level or 'all'}: {runs[-1].wall_s:.2f}s, {runs[-1].output_tokens} tokens",
              file=sys.stderr, flush=True)
    settings = (f"Generator, compute_type float32, intra_threads {args.threads}, generate_batch max_batch_size "
                f"{MAX_BATCH}")
    write_results(args.out, PeerResult("ctranslate2", ctranslate2.__version__, settings, convert_s, load_s, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
