"""OpenVINO GenAI peer: runs INSIDE its venv (scripts/peer_env.sh openvino), never in the project's.

    python run_openvino.py --requests REQ.json --out OUT.json --ir-dir DIR [--precision f32|default]

Exports the HF directory once with ``optimum-cli export openvino --weight-format fp32`` (cached in --ir-dir),
loads it in a ContinuousBatchingPipeline (max_num_batched_tokens 512, its serving engine) and, for each
concurrency level of the request file, keeps at most that many requests in flight through add_request/step,
reading each request's new ids after every step (its first-token time). ``--precision f32`` sets
INFERENCE_PRECISION_HINT=f32 and KV_CACHE_PRECISION=f32 (exact float32, the comparison with ours);
``default`` keeps the CPU plugin's defaults (bf16 compute and a u8 KV cache on CPUs with bf16 support).
EOS is ignored and decoding is greedy, so every request generates its max_new_tokens.

``--weight-format int8`` exports with optimum's int8 weight compression instead (weights int8 per output channel,
activations as ``--precision`` says): the peer of our ``model_config.quantization: w8a16``.

``--speculative prompt_lookup`` (the pipeline's ``prompt_lookup`` property, n-grams up to 4) or ``draft`` (a draft
model exported the same way from ``--draft-model`` into ``--draft-ir-dir``, the ``draft_model`` property) proposes
``--assistant-tokens`` tokens a step, as scripts/bench_speculative.py compares with ours.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from peer_io import (
    ClosedLoop,
    LevelRun,
    PeerResult,
    RequestFile,
    Timing,
    read_requests,
    runner_parser,
    write_results,
)

MAX_BATCHED_TOKENS = 512


def export(model_dir: str, ir_dir: Path, weight_format: str = "fp32") -> float | None:
    """Seconds the export took, or None when the IR of this model in this weight format is already there."""
    stamp = ir_dir / "llm-serving-source.txt"
    source = model_dir if weight_format == "fp32" else f"{model_dir} {weight_format}"
    if (ir_dir / "openvino_model.xml").exists() and stamp.exists() and stamp.read_text() == source:
        return None
    t0 = time.perf_counter()
    exe = Path(sys.executable).parent / "optimum-cli"
    cmd = [str(exe), "export", "openvino", "--model", model_dir, "--task", "text-generation-with-past",
           "--weight-format", weight_format, str(ir_dir)]
    print("[openvino] " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    stamp.write_text(source)
    return time.perf_counter() - t0


ASSISTANT = [0]  # tokens proposed a step (--assistant-tokens with --speculative; 0: none)
NGRAM = 4  # prompt lookup's longest n-gram, as ours (speculative.prompt_lookup_max)


def load(ir_dir: Path, precision: str, speculative: str = "none", draft_ir: Path | None = None):
    import openvino_genai as ov_genai

    sched = ov_genai.SchedulerConfig()
    sched.max_num_batched_tokens = MAX_BATCHED_TOKENS
    sched.cache_size = 1  # GB of KV cache: the whole workload at once needs ~0.4
    sched.dynamic_split_fuse = True
    props = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"} if precision == "f32" else {}
    if speculative == "prompt_lookup":
        props["prompt_lookup"] = True
    elif speculative == "draft":
        props["draft_model"] = ov_genai.draft_model(str(draft_ir), "CPU", **props)
    return ov_genai.ContinuousBatchingPipeline(str(ir_dir), sched, "CPU", props)


def gen_config(max_new_tokens: int, eos: int, assistant_tokens: int = 0):
    import openvino_genai as ov_genai

    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = max_new_tokens
    cfg.ignore_eos = True
    cfg.do_sample = False
    cfg.eos_token_id = eos
    if assistant_tokens:
        cfg.num_assistant_tokens = assistant_tokens
        cfg.max_ngram_size = NGRAM
    return cfg


def run_level(pipe, rf: RequestFile, level: int, next_id: list[int]) -> LevelRun:
    """Closed loop: at most ``level`` requests in flight (all at 0), new ones added between engine steps."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    running = ov_genai.GenerationStatus.RUNNING
    reqs = rf.level_requests(level)
    loop = ClosedLoop(len(reqs), level)
    handles: dict[int, object] = {}
    ids: dict[int, list[int]] = {}
    start: dict[int, float] = {}
    first: dict[int, float] = {}
    timings: dict[int, Timing] = {}
    t0 = time.perf_counter()
    while not loop.done:
        for pos in loop.to_start():
            r = reqs[pos]
            tensor = ov.Tensor(np.array([r.prompt_ids], dtype=np.int64))
            handles[pos] = pipe.add_request(next_id[0], tensor, gen_config(r.max_new_tokens, rf.eos_token_id,
                                                                           ASSISTANT[0]))
            next_id[0] += 1
            ids[pos] = []
            start[pos] = time.perf_counter() - t0
        pipe.step()
        now = time.perf_counter() - t0
        for pos in list(loop.in_flight):
            h = handles[pos]
            finished = h.get_status() != running  # read before the ids, so none come after the last read
            if h.can_read():
                for out in h.read().values():
                    ids[pos].extend(out.generated_ids)
                if ids[pos] and pos not in first:
                    first[pos] = now
            if finished:
                timings[pos] = Timing(reqs[pos].index, ids[pos], start[pos], now, first.get(pos, now))
                loop.finish(pos)
                del handles[pos]
    wall = time.perf_counter() - t0
    return LevelRun(level, wall, [timings[p] for p in range(len(reqs))])


def main() -> int:
    p = runner_parser(__doc__, "--ir-dir", "where the exported IR is cached")
    p.add_argument("--precision", choices=("f32", "default"), default="f32")
    p.add_argument("--weight-format", choices=("fp32", "int8"), default="fp32",
                   help="optimum-cli's weight format: int8 = its int8 weight compression (per output channel)")
    p.add_argument("--speculative", choices=("none", "prompt_lookup", "draft"), default="none")
    p.add_argument("--assistant-tokens", type=int, default=4)
    p.add_argument("--draft-model", help="HF directory of the draft (--speculative draft)")
    p.add_argument("--draft-ir-dir", type=Path, help="where the draft's exported IR is cached")
    args = p.parse_args()
    import openvino_genai as ov_genai

    rf = read_requests(args.requests)
    convert_s = export(rf.model_dir, args.ir_dir, args.weight_format)
    if args.speculative == "draft":
        export(args.draft_model, args.draft_ir_dir)
    ASSISTANT[0] = args.assistant_tokens if args.speculative != "none" else 0
    t0 = time.perf_counter()
    pipe = load(args.ir_dir, args.precision, args.speculative, args.draft_ir_dir)
    next_id = [0]
    run_level(pipe, RequestFile(rf.model_dir, rf.eos_token_id, [1], 1, rf.requests[:1]), 1, next_id)  # warm-up
    load_s = time.perf_counter() - t0
    runs = []
    for level in rf.levels:
        runs.append(run_level(pipe, rf, level, next_id))
        print(f"[openvino {args.precision}] level {level or 'all'}: {runs[-1].wall_s:.2f}s, "
              f"{runs[-1].output_tokens} tokens", file=sys.stderr, flush=True)
    settings = (f"ContinuousBatchingPipeline, max_num_batched_tokens {MAX_BATCHED_TOKENS}, "
                + ("INFERENCE_PRECISION_HINT=f32, KV_CACHE_PRECISION=f32" if args.precision == "f32"
                   else "CPU plugin defaults (bf16 compute, u8 KV cache where the CPU has bf16)"))
    if args.weight_format != "fp32":
        settings += f", weights exported --weight-format {args.weight_format}"
    if args.speculative != "none":
        settings += f", {args.speculative} with {args.assistant_tokens} assistant tokens"
    name = f"openvino-{args.precision}" + ("" if args.weight_format == "fp32" else f"-{args.weight_format}") \
        + ("" if args.speculative == "none" else f"-{args.speculative}")
    write_results(args.out, PeerResult(name, ov_genai.__version__, settings, convert_s, load_s, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
