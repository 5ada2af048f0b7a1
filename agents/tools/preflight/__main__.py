"""``python -m agents.tools.preflight``: one kernel selection's checks in this process, as JSON (``llm-serving
preflight`` starts one per selection and writes the verdict). The selection's
``MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST`` is set here, before MindSpore is set up, overriding the caller's: it
must be in place before MindSpore selects kernels, which is why each selection needs a process of its own.

Usage: python -m agents.tools.preflight --device Ascend|CPU --selection NAME --out JSON [--models DIR]
       [--graphs] [--spec AGENT_SPEC_JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from llm_serving.protocol.preflight_verdict import SELECTIONS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one kernel selection's preflight checks")
    parser.add_argument("--device", choices=("Ascend", "CPU"), required=True)
    parser.add_argument("--selection", choices=[s.name for s in SELECTIONS], required=True)
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--models", type=Path, help="also the one-layer and whole-model steps, on the random Llamas "
                        "llama-1 and llama-2 in this directory (llm-serving preflight writes them)")
    parser.add_argument("--graphs", action="store_true", help="also time each graph family's first compile")
    parser.add_argument("--spec", help="AgentSpec JSON whose graphs --graphs compiles (default: --models' llama-2)")
    args = parser.parse_args(argv)
    selection = next(s for s in SELECTIONS if s.name == args.selection)
    os.environ["MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST"] = selection.disable_custom_kernels

    import mindspore as ms

    from agents.tools.preflight.model_check import model_results, reference_name
    from agents.tools.preflight.op_checks import int8_direction, op_results
    from agents.tools.preflight.ops import run_ops

    got = run_ops(args.device)
    checks = op_results(got)
    direction, int8_checks = int8_direction(got)
    result: dict = {"selection": selection.name, "mindspore": ms.__version__, "int8_kv_direction": direction,
                    "int8_checks": [c.__dict__ for c in int8_checks]}
    if args.models:
        result["model_reference"] = reference_name()
        for layers in (1, 2):
            checks += model_results(args.device, args.models / f"llama-{layers}")
    result["checks"] = [c.__dict__ for c in checks]
    if args.graphs:
        from agents.tools.preflight.graphs import compile_seconds

        result["compile_seconds"], result["graphs"] = compile_seconds(args.device, args.spec, args.models / "llama-2")
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
