"""The ``preflight`` subcommand: ``llm-serving preflight [--config YAML] [--device Ascend|CPU] [--out FILE]
[--graphs]``.

The first minutes on an NPU decide what no source settles (docs/ascend.md, "The first hour"): under each kernel
selection (``MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST``, ``preflight_verdict.SELECTIONS``), each fused op against its
numpy reference, the int8 PagedAttention antiquant in both directions, a one-layer and a whole-model step against
an independent reference and the served graph-call path; with ``--graphs`` the first compile of each graph family.
One line per check, a summary, and the verdict file the agents follow (``model_config.ascend_preflight``).

The master never imports MindSpore, and the variable must be set before MindSpore selects kernels: each selection
runs in a child process (``python -m agents.tools.preflight``), one after another (they share the device).
``--device CPU`` runs the same checks on the CPU stand-ins of the kernels, as CI does (they read no selection).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llm_serving.cli.options import CliError, Command
from llm_serving.models.random_model import build_random_model
from llm_serving.protocol.preflight_verdict import (
    SELECTIONS,
    CheckResult,
    Selection,
    Verdict,
    preflight_llama,
    selection_passed,
)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="YAML", help="launch configuration whose model's graphs --graphs compiles "
                   "(default: a small random Llama's)")
    p.add_argument("--model", metavar="PATH", help="model directory (overrides model_config.model_path)")
    p.add_argument("--device", choices=("Ascend", "CPU"), default="Ascend", help="Ascend (default): the NPU's "
                   "kernels; CPU: their stand-ins (agents.model.backends.ascend_reference), as CI runs them")
    p.add_argument("--out", default="ascend-preflight.json", metavar="FILE", help="the verdict file (default "
                   "%(default)s; point model_config.ascend_preflight at it); the children's output goes to FILE.log")
    p.add_argument("--graphs", action="store_true", help="also time the first compile of each graph family of the "
                   "configured model (the small model's without --config)")
    p.add_argument("--selections", metavar="NAMES", help="comma-separated kernel selections to check (default: "
                   f"all, {','.join(s.name for s in SELECTIONS)}): e.g. one again after a CANN upgrade; the verdict "
                   "counts the others as failed")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S", help="seconds each selection's process "
                   "may take (default %(default)s)")


def child_argv(device: str, selection: Selection, out: Path, models: Path, spec_json: str | None,
               graphs: bool) -> list[str]:
    argv = [sys.executable, "-m", "agents.tools.preflight", "--device", device, "--selection", selection.name,
            "--out", str(out), "--models", str(models)]
    if graphs:
        argv.append("--graphs")
        if spec_json is not None:
            argv += ["--spec", spec_json]
    return argv


def run_selection(argv: list[str], out: Path, log: Any, timeout: float) -> dict[str, Any]:
    """One child's results; a child that failed or timed out is one failed check saying so."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    try:
        res = subprocess.run(argv, stdout=log, stderr=log, env=env, timeout=timeout, check=False)
        failure = None if res.returncode == 0 else f"the process exited with status {res.returncode}"
    except subprocess.TimeoutExpired:
        failure = f"the process took more than {timeout:g} s"
    if failure is None and out.is_file():
        return json.loads(out.read_text())
    detail = f"{failure or 'no results written'}: see {log.name}"
    return {"checks": [CheckResult("preflight process", False, None, "-", detail).__dict__], "int8_checks": [],
            "int8_kv_direction": None}


def configured_spec(args: argparse.Namespace) -> str | None:
    """The configured model's ``AgentSpec`` (JSON) whose graphs ``--graphs`` times; None without ``--config``."""
    if args.config is None:
        return None
    from llm_serving.cli.options import config_from_args
    from llm_serving.engine.wiring import agent_spec, resolve_model

    ns = argparse.Namespace(config=args.config, model=args.model, policy=None, decode_batch_size=None,
                            prefill_batch_size=None, agents=None, device_target=None, reasoning_parser=None)
    config = config_from_args(ns)
    if config.model_config.device_target != "Ascend":
        raise CliError(f"--config {args.config}: model_config.device_target is {config.model_config.device_target}:"
                       " preflight times the graphs of an Ascend config")
    # the preflight follows no verdict (it writes one: the file may not exist yet); an int8 cache's direction
    # changes a scale's values, not the graphs
    m = config.model_config
    int8 = m.device_target == "Ascend" and m.kv_cache_dtype == "int8" and m.ascend_int8_kv_direction is None
    config = config.with_values({"model_config.ascend_preflight": None,
                                 **({"model_config.ascend_int8_kv_direction": "multiply"} if int8 else {})})
    return agent_spec(config, resolve_model(config, lambda line: print(line, file=sys.stderr), tokenizer=False)
                      ).to_json()


def random_models(root: Path) -> Path:
    """The seeded random Llamas of the model checks, one layer and two, in ``root``/llama-N (the agents' side may
    not import the master's model writer)."""
    for layers in (1, 2):
        build_random_model(root / f"llama-{layers}", preflight_llama(layers), seed=7, std=0.2)
    return root


def print_results(name: str, results: dict[str, Any]) -> bool:
    """Each check's line; whether the selection passed (``selection_passed``)."""
    checks = [CheckResult.from_dict(c) for c in results["checks"]]
    for check in checks:
        print(check.line(name), flush=True)
    for check in (CheckResult.from_dict(c) for c in results.get("int8_checks", [])):  # exactly one should match
        print(("SAME" if check.passed else "DIFF") + check.line(name)[4:], flush=True)
    print(f"----  {name:<12} int8 KV direction: {results.get('int8_kv_direction') or 'neither matched'}", flush=True)
    return selection_passed(checks)


def chosen_selections(names: str | None) -> list[Selection]:
    """``--selections``' kernel selections in ``SELECTIONS`` order (all without it); CliError naming an unknown one."""
    if names is None:
        return list(SELECTIONS)
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    known = {s.name for s in SELECTIONS}
    if not wanted or wanted - known:
        raise CliError(f"--selections {names!r}: each must be one of {', '.join(sorted(known))}")
    return [s for s in SELECTIONS if s.name in wanted]


def _run(args: argparse.Namespace) -> int:
    chosen = chosen_selections(args.selections)
    spec_json = configured_spec(args) if args.graphs else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    selections: dict[str, dict[str, Any]] = {}
    mindspore, reference, graphs = "unknown", "none", 0
    compile_seconds: dict[str, float] = {}
    with open(f"{out}.log", "w") as log, tempfile.TemporaryDirectory(prefix="preflight-") as tmp:
        models = random_models(Path(tmp))
        for i, selection in enumerate(chosen):
            part = Path(tmp) / f"{selection.name}.json"
            print(f"== {selection.name}: MS_INTERNAL_DISABLE_CUSTOM_KERNEL_LIST={selection.disable_custom_kernels!r} "
                  f"({selection.source}; PagedAttention {selection.paged_attention}, FlashAttentionScore "
                  f"{selection.flash_attention})", flush=True)
            argv = child_argv(args.device, selection, part, models, spec_json, args.graphs and i == 0)
            results = run_selection(argv, part, log, args.timeout)
            passed = print_results(selection.name, results)
            mindspore = results.get("mindspore", mindspore)
            reference = results.get("model_reference", reference)
            compile_seconds = results.get("compile_seconds", compile_seconds)
            graphs = results.get("graphs", graphs)
            selections[selection.name] = {"disable_custom_kernels": selection.disable_custom_kernels,
                                          "passed": passed, "int8_kv_direction": results.get("int8_kv_direction"),
                                          "checks": results["checks"], "int8_checks": results.get("int8_checks", [])}
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    verdict = Verdict(mindspore=mindspore, device=args.device, date=date, model_reference=reference,
                      selections=selections, compile_seconds=compile_seconds)
    verdict.write(out)
    summary(verdict, graphs, out)
    return 0 if verdict.paged_attention else 1


def summary(verdict: Verdict, graphs: int, out: Path) -> None:
    print("== summary", flush=True)
    for name, selection in verdict.selections.items():
        failed = sum(not c["passed"] for c in selection["checks"])
        print(f"selection {name:<13} {'PASSED' if selection['passed'] else f'FAILED ({failed} checks)'}")
    passed = verdict.paged_attention
    print(f"model steps checked against: {verdict.model_reference}")
    print(f"agents will serve on: {passed[0] if passed else 'nothing (every selection failed: serving is refused)'}")
    print(f"int8 KV direction: {verdict.int8_kv_direction or 'none (int8 KV refused)'}")
    if verdict.compile_seconds:
        times = ", ".join(f"{k} {v:.1f} s" for k, v in verdict.compile_seconds.items())
        print(f"first compile per graph family: {times} ({graphs} graphs compiled at warm-up)")
    print(f"verdict written to {out}: set model_config.ascend_preflight: {out.resolve()}")


COMMAND = Command("preflight", "check the NPU's fused kernels, int8 KV direction, model steps and graph compile "
                  "under each kernel selection and write the verdict the agents follow (docs/ascend.md)",
                  _add_arguments, _run)
