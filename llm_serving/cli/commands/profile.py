"""The ``profile`` command: measure this machine's step times for a launch config (the served engine, HTTP and
agents, on a sweep of batch sizes and prompt lengths) and write the profile ``simulate --cost`` fits its model to."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llm_serving.cli.options import CliError, Command, add_config_arguments, config_from_args


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--out", required=True, metavar="PROFILE.json", help="where to write the measured steps (the "
                   "served config, its log and raw record go beside it, in PROFILE.d/)")
    p.add_argument("--new-tokens", type=int, default=32, metavar="N", help="decode steps a sweep point runs "
                   "(default 32)")
    p.add_argument("--staggered", type=int, default=16, metavar="N", help="requests of the last phase, sent one "
                   "by one while the others decode (default 16; 0: none)")


def _run(args: argparse.Namespace) -> int:
    from llm_serving.simulator.costs import FittedCost, save_profile, shape_summary
    from llm_serving.simulator.profiling import default_sweep, run_sweep

    if args.new_tokens < 1 or args.staggered < 0:
        raise CliError("--new-tokens must be >= 1 and --staggered >= 0")
    config = config_from_args(args)
    points = default_sweep(config.model_config.decode_batch_size[-1], config.max_model_len, args.new_tokens)
    out = Path(args.out)
    steps, meta = run_sweep(config, points, out.with_suffix(".d"), args.staggered,
                            progress=lambda line: print(line, file=sys.stderr))
    path = save_profile(out, steps, meta)
    model = FittedCost.fit(steps, path.name)
    print(f"{len(steps)} served steps measured -> {path}")
    print(model.describe())
    print(f"fit on these steps: {shape_summary(model.relative_errors(steps))}")
    return 0


COMMAND = Command("profile", "measure step times of a launch config on this machine for `simulate --cost`",
                  _add_arguments, _run)
