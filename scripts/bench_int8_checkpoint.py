"""Loading int8 weights from a float checkpoint (quantized at load) against from an int8 checkpoint
(``llm-serving quantize``): disk bytes, load time and the host memory a rank peaks at, side by side in one run.

    python scripts/bench_int8_checkpoint.py [--model bench|trained|large|moe] [--rounds 3] [--work-dir DIR]

Each case runs in its own process (its peak resident memory above its start, VmHWM after a reset, is its own) and
holds what the model is then built from: the rank's weights with the projections as int8 and scales (at tp 1 from a
float checkpoint the model quantizes while packing; here ``quantize_rows`` stands in for that step, its float32 copy
included). Cases alternate within a round; medians over rounds. ``large``: a random 0.5 B-parameter Llama (hidden
2048, 8 layers), where the projections dominate the bytes as they do in a 7B-70B model. ``moe``: a random
Qwen2-MoE (transformers' own initialisation; hidden 512, 4 layers of 16 experts, top 4, and a shared expert), where
the routed and shared experts are int8 in the checkpoint too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CASES = {"float, quantized at load": "float", "int8 checkpoint": "int8"}


def build(model: str, work: Path) -> Path:
    """The float model directory of ``model``."""
    from llm_serving.models.random_model import build_random_model
    from llm_serving.protocol.model_config import LlamaConfig

    if model == "trained":
        from llm_serving.models.default_model import TRAINED_MODEL

        return TRAINED_MODEL
    if model == "moe":
        return build_moe(work / model)
    if model == "bench":
        from bench_model import BENCH_MODEL

        config, std = BENCH_MODEL, 0.05
    else:
        config, std = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                                  num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048), 0.02
    out = work / model
    if not (out / "config.json").is_file():
        build_random_model(out, config, seed=0, std=std)
    return out


def build_moe(out: Path) -> Path:
    """A random Qwen2-MoE directory as transformers writes it (its per-expert tensors), float32."""
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    config = transformers.Qwen2MoeConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                         num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512,
                                         shared_expert_intermediate_size=1024, max_position_embeddings=2048)
    torch.manual_seed(0)
    transformers.Qwen2MoeForCausalLM(config).save_pretrained(out)
    return out


def status_kib(field: str) -> int:
    """A memory figure of /proc/self/status, in KiB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def child(model_dir: str, tp: int) -> dict:
    """Load rank 0's weights as the w8a16 model is built from them; time and peak memory."""
    from agents.weights import packed
    from agents.weights.sharded import EXPERT_KINDS, QUANTIZED_KINDS, SHARED_EXPERT_KINDS, load_rank_weights
    from llm_serving.protocol.model_config import LlamaConfig
    from llm_serving.protocol.parallel import ShardPlan

    config = LlamaConfig.from_model_dir(model_dir)
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the present resident size
    before = status_kib("VmRSS")
    start = time.perf_counter()
    weights = load_rank_weights(model_dir, config, ShardPlan(config, tp, 0), "float32", quantize=True)
    kinds = (*QUANTIZED_KINDS, *EXPERT_KINDS, *SHARED_EXPERT_KINDS)
    for key in [k for k in weights if k.rsplit(".", 1)[-1] in kinds and f"{k}.scale" not in weights]:
        value = weights[key]  # the tp 1 model's pack step (an expert stack per expert and row)
        q, scale = packed.quantize_rows(value.reshape(-1, value.shape[-1]))
        weights[key], weights[f"{key}.scale"] = q.reshape(value.shape), scale.reshape(value.shape[:-1])
    seconds = time.perf_counter() - start
    held = sum(v.nbytes for v in weights.values())
    return {"seconds": seconds, "peak_mib": (status_kib("VmHWM") - before) / 1024, "held_mib": held / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("bench", "trained", "large", "moe"), default="bench")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/llm-serving-int8-checkpoint"))
    p.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "TP"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return
    from agents.weights.quantize_checkpoint import quantize_checkpoint

    args.work_dir.mkdir(parents=True, exist_ok=True)
    src = build(args.model, args.work_dir)
    start = time.perf_counter()
    int8 = quantize_checkpoint(src, args.work_dir / f"{args.model}-int8")
    written = time.perf_counter() - start
    dirs = {"float": src, "int8": int8}
    disk = {k: sum(f.stat().st_size for f in d.glob("*.safetensors")) / 2**20 for k, d in dirs.items()}
    print(f"{args.model}: float safetensors {disk['float']:.1f} MiB, int8 {disk['int8']:.1f} MiB "
          f"({disk['float'] / disk['int8']:.2f}x smaller), written in {written:.2f} s")
    results: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.rounds):
        for tp in (1, 2):
            for name, kind in CASES.items():
                out = subprocess.run([sys.executable, __file__, "--child", str(dirs[kind]), str(tp)], check=True,
                                     capture_output=True, text=True).stdout
                results.setdefault((name, tp), []).append(json.loads(out.strip().splitlines()[-1]))
    print(f"\nrank 0's weights ready for the w8a16 model, medians of {args.rounds} rounds:")
    print(f"{'case':<28} {'tp':>2} {'load s':>8} {'peak MiB':>9} {'held MiB':>9}")
    for (name, tp), runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{name:<28} {tp:>2} {med['seconds']:>8.2f} {med['peak_mib']:>9.0f} {med['held_mib']:>9.0f}")


if __name__ == "__main__":
    main()
