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
    p.add_argument("--rounds", type=int, default=2, metavar="N", help="times the sweep runs (default 2; their "
                   "agreement says whether the machine was quiet)")
    p.add_argument("--staggered", type=int, default=16, metavar="N", help="requests sent one by one while the "
                   "others decode, each round (default 16; 0: none)")


def _run(args: argparse.Namespace) -> int:
    from llm_serving.bench.local_server import ServerStartError
    from llm_serving.simulator.costs import FittedCost, round_spread, save_profile, shape_summary
    from llm_serving.simulator.profiling import default_sweep, run_sweep

    if args.new_tokens < 1 or args.staggered < 0 or args.rounds < 1:
        raise CliError("--new-tokens and --rounds must be >= 1, --staggered >= 0")
    config = config_from_args(args)
    points = default_sweep(config.model_config.decode_batch_size[-1], config.max_model_len, args.new_tokens)
    out = Path(args.out)
    try:
        steps, meta = run_sweep(config, points, out.with_suffix(".d"), args.staggered,
                                progress=lambda line: print(line, file=sys.stderr), rounds=args.rounds)
    except ServerStartError as exc:
        raise CliError(f"the profiled server did not start ({exc}): see {out.with_suffix('.d') / 'profiled-server.log'}"
                       ) from None
    path = save_profile(out, steps, meta)
    model = FittedCost.fit(steps, path.name, meta["decode_buckets"])
    print(f"{len(steps)} served steps measured -> {path}")
    print(model.describe())
    print(f"fit on these steps: {shape_summary(model.relative_errors(steps))}")
    spread = round_spread(steps, meta["round_steps"], meta["decode_buckets"])
    if spread is not None:
        print(f"the {len(meta['round_steps'])} rounds' fits differ by {spread:.0%} on these steps"
              + (": the machine was not quiet throughout; measure again before trusting it" if spread > 0.1 else ""))
    return 0


COMMAND = Command("profile", "measure step times of a launch config on this machine for `simulate --cost`",
                  _add_arguments, _run)
