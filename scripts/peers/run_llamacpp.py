"""llama.cpp peer (llama-cpp-python): runs INSIDE its venv (scripts/peer_env.sh llamacpp), never in the project's.

    python run_llamacpp.py --requests REQ.json --out OUT.json --gguf-dir DIR [--threads N]

Converts the HF directory once with llama.cpp's ``convert_hf_to_gguf.py --outtype f32`` (the copy peer_env.sh
took from the llama-cpp-python sdist; cached in --gguf-dir) and loads it with llama_cpp.Llama: F32 weights, F32
KV cache, flash attention off, n_threads = n_threads_batch = --threads. Each request runs alone: its prompt ids
in one decode, then one decode per new token, each token picked by llama.cpp's greedy sampler (the argmax of
the logits) with no end-of-generation check, so EOS cannot stop it and every request makes exactly its
max_new_tokens. The prompt ids already start with BOS and go in as ids (nothing is tokenized, so no second BOS).

llama-cpp-python serves one sequence at a time (one context, one KV sequence, no batching of requests): level
1 is run; other levels are not run, and the result says so, rather than running the requests one after
another under a concurrency level's name.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from peer_io import (
    LevelRun,
    PeerRequest,
    PeerResult,
    RequestFile,
    one_at_a_time,
    read_requests,
    runner_parser,
    write_results,
)

GGUF_NAME = "model-f32.gguf"
NOT_RUN = "llama-cpp-python serves one sequence at a time"


def converter() -> Path:
    """llama.cpp's HF -> GGUF converter inside this venv (scripts/peer_env.sh put it there)."""
    return Path(sys.prefix) / "share" / "llama.cpp" / "convert_hf_to_gguf.py"


def convert(model_dir: str, gguf_dir: Path) -> float | None:
    """Seconds the conversion took, or None when this model's GGUF is already there."""
    out, stamp = gguf_dir / GGUF_NAME, gguf_dir / "llm-serving-source.txt"
    if out.exists() and stamp.exists() and stamp.read_text() == model_dir:
        return None
    gguf_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cmd = [sys.executable, str(converter()), model_dir, "--outfile", str(out), "--outtype", "f32"]
    print("[llamacpp] " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    stamp.write_text(model_dir)
    return time.perf_counter() - t0


def context_size(rf: RequestFile) -> int:
    """Tokens of the longest request (prompt + new), the KV cache's length: every request fits whole."""
    return max(len(r.prompt_ids) + r.max_new_tokens for r in rf.requests)


def greedy(evaluate: Callable[[Sequence[int]], None], pick: Callable[[], int], prompt: Sequence[int], n: int,
           clock: Callable[[], float] = time.perf_counter) -> tuple[list[int], float]:
    """Exactly ``n`` new ids and the clock when the first was picked: evaluate the prompt, then pick a token and
    evaluate it, until n are picked (the last one needs no evaluation). No id ends the loop early: EOS is
    ignored by construction."""
    evaluate(prompt)
    out = [pick()]
    first = clock()
    while len(out) < n:
        evaluate(out[-1:])
        out.append(pick())
    return out, first


def run_level1(llm, pick: Callable[[], int], rf: RequestFile) -> LevelRun:
    """One request at a time, each token timed as it comes."""

    def generate(r: PeerRequest) -> tuple[list[int], float]:
        llm.reset()  # the next eval drops the previous request's KV cache
        return greedy(llm.eval, pick, r.prompt_ids, r.max_new_tokens)

    return one_at_a_time(rf, generate)


def main() -> int:
    p = runner_parser(__doc__, "--gguf-dir", "where the converted GGUF is cached")
    p.add_argument("--threads", type=int, default=1, help="n_threads and n_threads_batch (default 1)")
    args = p.parse_args()
    import llama_cpp

    rf = read_requests(args.requests)
    convert_s = convert(rf.model_dir, args.gguf_dir)
    n_ctx = context_size(rf)
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(str(args.gguf_dir / GGUF_NAME), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                          n_threads=args.threads, n_threads_batch=args.threads, flash_attn=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, n_gpu_layers=0,
                          logits_all=False, verbose=False)
    ftype = llm.metadata.get("general.file_type")
    if ftype != str(llama_cpp.LLAMA_FTYPE_ALL_F32):
        raise SystemExit(f"{args.gguf_dir / GGUF_NAME}: general.file_type {ftype}, not all F32")
    sampler = llama_cpp.llama_sampler_init_greedy()

    def pick() -> int:
        """The argmax of the last evaluated position's logits (llama.cpp's greedy sampler; no sampling)."""
        return llama_cpp.llama_sampler_sample(sampler, llm.ctx, -1)

    llm.reset()
    greedy(llm.eval, pick, rf.requests[0].prompt_ids, 2)  # warm-up
    load_s = time.perf_counter() - t0
    print(f"[llamacpp] {llama_cpp.llama_print_system_info().decode().strip()}", file=sys.stderr, flush=True)
    runs = []
    for level in rf.levels:
        if level != 1:
            print(f"[llamacpp] level {level or 'all'}: not run ({NOT_RUN})", file=sys.stderr, flush=True)
            continue
        runs.append(run_level1(llm, pick, rf))
        print(f"[llamacpp] level 1: {runs[-1].wall_s:.2f}s, {runs[-1].output_tokens} tokens", file=sys.stderr,
              flush=True)
    llama_cpp.llama_sampler_free(sampler)
    settings = (f"Llama, GGUF F32 (convert_hf_to_gguf.py --outtype f32), KV cache f32, n_threads {args.threads}, "
                f"flash attention off, n_ctx {llm.n_ctx()}, greedy sampler; built for this CPU (GGML_NATIVE, "
                f"no BLAS); one sequence at a time: only 1 in flight is run")
    write_results(args.out, PeerResult("llamacpp", llama_cpp.__version__, settings, convert_s, load_s, runs,
                                       not_run=NOT_RUN))
    return 0


if __name__ == "__main__":
    sys.exit(main())
