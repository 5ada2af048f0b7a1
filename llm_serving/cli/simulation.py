"""Options the ``simulate`` and ``tune`` commands share: the cost model, the workload, and turning them into a
``Target`` and its requests."""

from __future__ import annotations

import argparse
import math
from typing import Any

from llm_serving.cli.options import CliError, add_config_arguments, config_from_args


def add_simulation_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    cost = p.add_argument_group("step-time model")
    cost.add_argument("--cost", required=True, metavar="PROFILE.json|DEVICE",
                      help="a step profile measured here (`llm-serving profile`; several of one config, comma-"
                      "separated, are fitted together: profiles taken at different times average a shared machine's "
                      "drift), or a device preset: ascend-910b (analytic; docs/simulator.md lists its parameters)")
    cost.add_argument("--device-param", action="append", default=[], metavar="KEY=VALUE",
                      help="override a device preset's parameter, e.g. memory_efficiency=0.5 (repeatable)")
    cost.add_argument("--model-shape", metavar="PRESET|DIR",
                      help="with a device preset: the model's shape (llama-2-7b, llama-2-13b, llama-2-70b, "
                      "llama-3.1-8b, or a directory with config.json); default: the config's model")
    cost.add_argument("--num-blocks", type=int, metavar="N", help="KV blocks (default: the profile's, the "
                      "device's memory after the weights, or pa_config.num_blocks)")
    cost.add_argument("--request-overhead-ms", type=float, default=None, metavar="MS",
                      help="a request's time outside the engine on each side, before the engine sees it and after "
                      "each token leaves it (HTTP, tokenizing, streaming; default: what the profile measured, 0 "
                      "for a device preset)")
    work = p.add_argument_group("workload (as the load tool sends it)")
    work.add_argument("--results", metavar="RESULT.json", help="replay a load-test result file: its prompts, the "
                      "output lengths its server produced and its send times (with --max-concurrency the send times "
                      "come from -X instead, as the load tool's cap set them)")
    work.add_argument("--dataset", default="./alpaca_5010.json", help="alpaca json (default: ./alpaca_5010.json, "
                      "or the generated default workload when it is absent, as the load tool does)")
    work.add_argument("-X", "--qps", type=float, default=math.inf, help="mean request rate; inf = all at once "
                      "(default)")
    work.add_argument("-T", "--test_time", "--test-time", dest="test_time", type=float, default=None,
                      help="seconds of arrivals: int(test_time * qps) requests, as the contest script sends")
    work.add_argument("--num-prompts", type=int, default=None, help="number of requests (overrides -T)")
    work.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                      help="the load tool's cap on requests in flight")
    work.add_argument("--arrival", choices=("poisson", "gamma", "constant"), default="poisson")
    work.add_argument("--burstiness", type=float, default=1.0)
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--max-output-tokens", type=int, default=None, metavar="N", help="cap on max_new_tokens")
    work.add_argument("--tokens-per-word", type=float, default=1.3,
                      help="token estimate per word where the model's tokenizer is not here (default 1.3)")


def device_params(args: argparse.Namespace) -> dict[str, str]:
    """``--device-param KEY=VALUE`` items as a mapping (the values are checked by the device profile)."""
    params = {}
    for item in args.device_param:
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"--device-param {item!r}: expected KEY=VALUE")
        params[key] = value
    return params


def build(args: argparse.Namespace, progress=None) -> tuple[Any, Any, list]:
    """The launch config, its ``Target`` and the requests (clipped to the context as admission does)."""
    from llm_serving.simulator import workload
    from llm_serving.simulator.costs import CostModelError
    from llm_serving.simulator.target import build_target

    config = config_from_args(args)
    if config.speculative.method:
        raise CliError(f"{config.source}: speculative.method: {config.speculative.method} is not simulated (what it "
                       "proposes depends on the real tokens); simulate the configuration without it")
    try:
        target = build_target(config, args.cost, device_params(args), args.model_shape, args.num_blocks,
                              args.tokens_per_word, progress)
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise CliError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
        if args.results:
            requests = workload.from_results(args.results, target.encode)
            if args.max_concurrency:
                requests = workload.retimed(requests, args.qps, args.arrival, args.burstiness, args.seed)
        else:
            num = args.num_prompts
            if num is None:
                if args.test_time is None or math.isinf(args.qps):
                    raise CliError("say how many requests: --num-prompts, or -T with a finite -X")
                num = int(args.test_time * args.qps)
            if num < 1:
                raise CliError(f"nothing to simulate: {num} requests")
            requests = workload.from_dataset(args.dataset, num, target.encode, args.qps, args.arrival, args.burstiness,
                                    args.seed, args.max_output_tokens)
        requests = workload.clip_to_context(requests, target.scheduler.max_model_len)
    except (CostModelError, workload.WorkloadError) as exc:
        raise CliError(str(exc)) from None
    if args.request_overhead_ms is not None:
        if args.request_overhead_ms < 0:
            raise CliError(f"--request-overhead-ms must be >= 0, got {args.request_overhead_ms}")
        target.request_overhead_s = args.request_overhead_ms / 1e3
    return config, target, requests
