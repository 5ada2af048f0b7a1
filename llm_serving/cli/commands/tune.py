"""The ``tune`` command: search the scheduling configuration for a workload on the simulator (the cost model of a
measured profile or a device preset) under latency constraints, and write the chosen YAML."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llm_serving.cli.options import CliError, Command
from llm_serving.cli.simulation import add_simulation_arguments, build, device_params


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_simulation_arguments(p)
    p.add_argument("--constraint", action="append", default=[], metavar="METRIC<=VALUE",
                   help="a bound the choice must meet, on any metric the load tool reports, e.g. "
                   "p90_ttft_ms<=5000 or median_tpot_ms<=40 (repeatable)")
    p.add_argument("--out", required=True, metavar="TUNED.yaml", help="where to write the chosen configuration")


def _run(args: argparse.Namespace) -> int:
    import yaml

    from llm_serving.simulator.costs import CostModelError
    from llm_serving.simulator.target import build_target
    from llm_serving.simulator.tuner import Constraint, TuneError, tune, tuned_yaml

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    config, target, requests = build(args, progress=log)
    params = device_params(args)
    try:
        constraints = [Constraint.parse(c, _metric_names()) for c in args.constraint]
        result = tune(config, lambda cfg: build_target(cfg, args.cost, params, args.model_shape, args.num_blocks,
                                                       args.tokens_per_word),
                      requests, constraints, args.max_concurrency, target.profiled_batch, log)
    except (TuneError, CostModelError) as exc:
        raise CliError(str(exc)) from None
    raw = yaml.safe_load(Path(args.config).read_text()) if args.config else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(tuned_yaml(config, raw, result.best), sort_keys=False))
    base, best = result.base, result.best
    print(f"{len(result.trials)} configurations simulated ({target.cost.describe()})")
    print(f"given config: {base.total_s:.2f} s{'' if base.feasible else ' (breaks a constraint)'}")
    changes = ", ".join(f"{k}={v}" for k, v in best.values.items()) or "no change"
    print(f"chosen: {best.total_s:.2f} s ({base.total_s / best.total_s:.2f}x) with {changes}"
          f"{'' if best.feasible else ' -- NO candidate meets the constraints'}"
          f"{' (decode batch beyond the profiled ones: extrapolated)' if best.extrapolated else ''}")
    for c in constraints:
        print(f"  {c}: {c.metric} = {best.metrics.get(c.metric)}")
    print(f"written: {out}")
    return 0 if best.feasible else 1


def _metric_names() -> set[str]:
    """The numeric metrics of a run (what a constraint may bound)."""
    from llm_serving.bench.metrics import compute_metrics

    return {k for k, v in compute_metrics([], 1.0).items() if v is None or isinstance(v, (int, float))}


COMMAND = Command("tune", "choose batch sizes, chunk budget, policy and KV blocks for a workload on the simulator "
                  "and write the YAML", _add_arguments, _run)
