"""The ``serve`` command's arguments and configuration (YAML, ``--set``, then the named flags); the serving
process itself is ``llm_serving.api.launch`` (imported when the command runs, so ``--help`` stays light)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_serving.cli.options import Command, add_config_arguments

if TYPE_CHECKING:
    from llm_serving.config.serving_config import ServingConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``serve``; each overrides the matching key of the YAML file (after any ``--set``)."""
    add_config_arguments(p)  # --config, --model, --decode-batch-size, --prefill-batch-size, --policy, --agents
    p.add_argument("--model-path", dest="model", help=argparse.SUPPRESS)  # spelling used in configs/example.yaml
    p.add_argument("--num-agents", dest="agents", type=int, help=argparse.SUPPRESS)
    p.add_argument("--host", help="address to bind (serving_config.server_ip; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind, 0 for any free one (serving_config.server_port)")
    p.add_argument("--api-key", default=os.environ.get("LLM_SERVING_API_KEY") or None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(serving_config.api_key; default $LLM_SERVING_API_KEY, which keeps it out of ps)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME", help="the names the API answers to, the first "
                   "the main one (model_config.model_name, then serving_config.model_aliases, which they replace)")
    p.add_argument("--max-model-len", metavar="N", help="most tokens (prompt + output) of one sequence "
                   "(pa_config.decode_seq_length), or 'model': the model's max_position_embeddings, capped by what "
                   "the KV cache holds (the default for --model / model_config.model_path when no config sets the "
                   "length)")
    p.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters chosen by each request's model (lora.enable)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=DIR", help="PEFT adapter directories served from the "
                   "start, each under its NAME (lora.modules, which they replace; implies --enable-lora)")
    p.add_argument("--max-loras", type=int, metavar="N", help="adapter slots in device memory: the most distinct "
                   "adapters one step computes (lora.max_loras)")
    p.add_argument("--max-lora-rank", type=int, metavar="R", help="the largest adapter rank a slot holds "
                   "(lora.max_lora_rank)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true", default=None,
                   help="open POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora.allow_runtime_updates)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key, VALUE in YAML (e.g. --set pa_config.num_blocks=1024)")
    p.add_argument("--record-steps", metavar="FILE.json", help="record every step's shape and time and write them to "
                   "FILE.json when stopped: a step profile of the served path for `simulate --cost`")
    p.add_argument("--standin-agents", action="store_true",
                   help="testing only: agents answer instantly with deterministic tokens, no model")
    p.add_argument("--standin-step-delay", type=float, default=0.0, metavar="SECONDS",
                   help="testing only: simulated compute time of each stand-in step")


def load_config(args: argparse.Namespace) -> ServingConfig:
    """The YAML file (or defaults) with ``--set`` and the named flags applied, in that order."""
    import yaml

    from llm_serving.config.serving_config import ConfigError, ServingConfig

    cfg = ServingConfig.from_yaml(args.config) if args.config else ServingConfig()
    values: dict[str, Any] = {}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE", key=item, source="--set")
        try:
            values[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: VALUE is not valid YAML: {exc}", key=key, source="--set") from None
    if getattr(args, "api_key", None):
        values["serving_config.api_key"] = args.api_key
    if getattr(args, "device_target", None):
        values["model_config.device_target"] = args.device_target
    if args.reasoning_parser:
        values["tokenizer.reasoning_parser"] = args.reasoning_parser
    values.update(lora_values(args))
    names = getattr(args, "served_model_name", None)
    if names:
        values["model_config.model_name"] = names[0]
        values["serving_config.model_aliases"] = list(names[1:])
    if values:
        cfg = cfg.with_values(values)
    if getattr(args, "max_model_len", None):
        cfg = with_max_model_len(cfg, args.max_model_len, args.model)
    elif (args.model or not cfg.uses_default_model) and not sets_model_len(args.config, values):
        # a model directory of the user's with no length chosen: the model's own, as vLLM serves it (the embedded
        # model's config is built for the configured length)
        cfg = with_max_model_len(cfg, "model", args.model)
    return cfg.with_overrides(model_path=args.model, host=args.host, port=args.port, policy=args.policy,
                              decode_batch_size=args.decode_batch_size,
                              prefill_batch_size=args.prefill_batch_size, num_agents=args.agents)


def lora_values(args: argparse.Namespace) -> dict[str, Any]:
    """The ``lora`` keys the adapter flags set (paths resolved against the current directory)."""
    values: dict[str, Any] = {}
    modules = getattr(args, "lora_modules", None)
    if modules:
        values["lora.modules"] = [f"{n}={os.path.abspath(os.path.expanduser(d))}" if sep else item
                                  for item in modules for n, sep, d in [item.partition("=")]]
    if modules or getattr(args, "enable_lora", None):
        values["lora.enable"] = True
    for flag, key in (("max_loras", "max_loras"), ("max_lora_rank", "max_lora_rank"),
                      ("allow_runtime_lora_updating", "allow_runtime_updates")):
        if getattr(args, flag, None) is not None:
            values[f"lora.{key}"] = getattr(args, flag)
    return values


def sets_model_len(config_file: str | None, values: dict[str, Any]) -> bool:
    """Whether the YAML file or ``--set`` chose ``pa_config.decode_seq_length``."""
    import yaml

    if "pa_config.decode_seq_length" in values:
        return True
    if not config_file:
        return False
    raw = yaml.safe_load(Path(os.path.expanduser(config_file)).read_text(encoding="utf-8")) or {}
    return "decode_seq_length" in (raw.get("pa_config") or {})


def with_max_model_len(cfg: ServingConfig, value: str, model: str | None) -> ServingConfig:
    """``--max-model-len N``, or ``model``: the model's max_position_embeddings, capped by the KV cache
    (``(num_blocks - 1) x block_size`` per sequence); what was chosen and why is printed."""
    from llm_serving.config.serving_config import ConfigError
    from llm_serving.engine.wiring import resolve_model

    if value != "model":
        try:
            length = int(value)
        except ValueError:
            raise ConfigError(f"--max-model-len: expected a number of tokens or 'model', got {value!r}",
                              key="pa_config.decode_seq_length", source="--max-model-len") from None
    else:
        cfg = cfg.with_overrides(model_path=model)
        positions = resolve_model(cfg, None, tokenizer=False).llama_config.max_position_embeddings
        pa = cfg.pa_config
        length, why = positions, "the model's max_position_embeddings"
        blocks = pa.fixed_blocks
        if blocks is not None and (blocks - 1) * pa.block_size < positions:
            length = (blocks - 1) * pa.block_size
            why = (f"what the KV cache holds ((pa_config.num_blocks {pa.num_blocks} - 1) x block_size "
                   f"{pa.block_size}), below the model's max_position_embeddings {positions}")
        print(f"max model length {length}: {why}", file=sys.stderr, flush=True)
        buckets = cfg.model_config.seq_length
        if buckets[-1] > length:  # prefill buckets beyond what one sequence may hold would never be used
            kept = [b for b in buckets if b < length] + [length]
            print(f"prefill buckets (model_config.seq_length) {list(buckets)} -> {kept}: none longer than the "
                  "model length", file=sys.stderr, flush=True)
            return cfg.with_values({"pa_config.decode_seq_length": length, "model_config.seq_length": kept})
    return cfg.with_values({"pa_config.decode_seq_length": length})


def main(args: argparse.Namespace) -> int:
    """Entry point of ``llm-serving serve`` (the CLI passes its parsed arguments)."""
    from llm_serving.config.serving_config import ConfigError

    try:
        config = load_config(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    from llm_serving.api.launch import serve

    return serve(config, standin_agents=args.standin_agents,
                 standin_step_delay=getattr(args, "standin_step_delay", 0.0),
                 record_steps=getattr(args, "record_steps", None))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llm-serving serve", description=COMMAND.help)
    add_arguments(p)
    return p


COMMAND = Command("serve", "serve a model over HTTP (llm-serving and OpenAI APIs) until SIGINT/SIGTERM",
                  add_arguments, main)


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
