"""The ``llm-serving`` command line (also ``python -m llm_serving``).

Subcommands are ``Command`` entries in ``COMMANDS``: a name, a help line, a function that adds its
arguments and one that runs it and returns the exit status. ``generate`` lives here; ``serve``, ``bench`` and
``export`` are added by appending their ``Command`` (from their own modules, imported lazily in ``_commands``).
Heavy modules are imported inside the run functions so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_serving.protocol.model_config import DEVICE_TARGETS


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class CliError(Exception):
    """A user mistake worth one line on stderr and exit status 2 (not a traceback)."""


# ---- shared options ---------------------------------------------------------------------------------------
def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """--config/--model and the launch overrides shared by generate, serve and bench."""
    p.add_argument("--config", metavar="YAML", help="launch configuration (default: built-in defaults, "
                   "which serve the embedded default model)")
    p.add_argument("--model", metavar="PATH", help="model directory or checkpoint (overrides "
                   "model_config.model_path)")
    p.add_argument("--decode-batch-size", type=int, metavar="B", help="largest decode batch (one bucket)")
    p.add_argument("--prefill-batch-size", type=int, metavar="P", help="largest prefill batch (one bucket)")
    p.add_argument("--policy", choices=("fcfs", "longest_output_first"), help="admission order")
    p.add_argument("--agents", type=int, metavar="K", help="tensor-parallel size: agent processes (ranks), each "
                   "holding 1/K of the model")
    p.add_argument("--device-target", choices=DEVICE_TARGETS, help="device of the agents "
                   "(model_config.device_target; rank r on device serving_config.start_device_id + r)")


def config_from_args(args: argparse.Namespace) -> Any:
    from llm_serving.config.serving_config import ServingConfig

    cfg = ServingConfig.from_yaml(args.config) if args.config else ServingConfig()
    if getattr(args, "device_target", None):
        cfg = cfg.with_values({"model_config.device_target": args.device_target})
    return cfg.with_overrides(model_path=args.model, policy=args.policy,
                              decode_batch_size=args.decode_batch_size,
                              prefill_batch_size=args.prefill_batch_size, num_agents=args.agents)


# ---- generate ---------------------------------------------------------------------------------------------
def _generate_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--prompts", required=True, metavar="FILE.json",
                   help='JSON list of prompts: strings, token-id lists, {"prompt": "..."} objects, or '
                   'conversations (lists of {"role", "content"} messages, or {"messages": [...]}) rendered by '
                   "the model's chat template")
    p.add_argument("--max-new-tokens", type=int, required=True, metavar="N",
                   help="tokens to generate per prompt")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K likeliest (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1: all)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="Hugging Face repetition penalty over prompt + output (1: none)")
    p.add_argument("--seed", type=int, metavar="S", help="seed of every prompt's draws (default: random)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a prompt's generation where TEXT first appears, cut from its text (repeatable)")
    p.add_argument("--dump-logits", metavar="DIR", help="write each prompt's float32 logits [N, vocab] of its "
                   "first N generated positions to DIR/<prompt index>.npy (serving_config.dump_logits_dir)")
    p.add_argument("--dump-logits-tokens", type=int, metavar="N", help="positions per prompt for --dump-logits "
                   "(serving_config.dump_logits_tokens; default: every generated position)")
    p.add_argument("--standin-agents", action="store_true", help=argparse.SUPPRESS)  # tests: no MindSpore


def _is_conversation(item: Any) -> bool:
    return isinstance(item, list) and bool(item) and all(isinstance(m, dict) for m in item)


def read_prompts(path: str) -> list[str | list[int] | list[dict[str, str]]]:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CliError(f"--prompts: {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CliError(f"--prompts: cannot read {path} as JSON: {exc}") from None
    if not isinstance(raw, list) or not raw:
        raise CliError(f"--prompts: {path} must hold a non-empty JSON list of prompts")
    prompts: list[str | list[int] | list[dict[str, str]]] = []
    for i, item in enumerate(raw):
        if isinstance(item, dict):
            item = item.get("messages", item.get("prompt"))
        if _is_conversation(item):
            from llm_serving.tokenization.chat_template import MessageError, check_messages

            try:
                prompts.append(check_messages(item))
            except MessageError as exc:
                raise CliError(f"--prompts: item {i} of {path}: {exc}") from None
        elif isinstance(item, str) or (isinstance(item, list) and item
                                       and all(isinstance(t, int) and not isinstance(t, bool) for t in item)):
            prompts.append(item)
        else:
            raise CliError(f"--prompts: item {i} of {path} is not a string, a list of token ids, "
                           f'{{"prompt": "..."}} or a conversation (a list of messages)')
    return prompts


def sampling_from_args(args: argparse.Namespace) -> Any:
    """The generate command's SamplingParams; a bad value is a CliError naming its option."""
    from llm_serving.core.sequence import InvalidParameter, SamplingParams

    try:
        return SamplingParams(args.max_new_tokens, args.ignore_eos, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                              seed=args.seed, stop=tuple(args.stop))
    except InvalidParameter as exc:  # named as its option: --max-new-tokens, --top-p, ...
        raise CliError(exc.message_for(f"--{exc.field.replace('_', '-')}")) from None


def _run_generate(args: argparse.Namespace) -> int:
    import numpy as np

    from llm_serving.engine.llm import LLM
    from llm_serving.engine.stop_strings import cut_at_stop

    prompts = read_prompts(args.prompts)
    params = sampling_from_args(args)
    cfg = config_from_args(args)
    dump_dir, dump_tokens = logits_dump_from_args(args, cfg, params.max_new_tokens)
    with LLM(cfg, standin_agents=args.standin_agents) as llm:
        results = llm.generate(_chat_prompts(llm, prompts, args.prompts), sampling_params=params,
                               logits_tokens=dump_tokens)
        for index, (prompt, res) in enumerate(zip(prompts, results)):
            if dump_dir is not None:
                np.save(dump_dir / f"{index}.npy", res.logits)
            line = {"prompt": prompt if isinstance(prompt, str) else None, "prompt_ids": res.prompt_ids,
                    "token_ids": res.token_ids, "logprobs": res.logprobs,
                    "text": cut_at_stop(llm.tokenizer.decode(res.token_ids), params.stop)}
            if _is_conversation(prompt):
                line = {"messages": prompt, **line}
            print(json.dumps(line, ensure_ascii=False), flush=True)
    return 0


def logits_dump_from_args(args: argparse.Namespace, cfg: Any, max_new_tokens: int) -> tuple[Path | None, int]:
    """(folder, positions per prompt) of the logits dump: the flags, else serving_config's keys; (None, 0) for
    none. The folder is created now, so a bad path fails before the agents start."""
    s = cfg.serving_config
    folder = args.dump_logits or s.dump_logits_dir
    tokens = args.dump_logits_tokens if args.dump_logits_tokens is not None else s.dump_logits_tokens
    if args.dump_logits_tokens is not None and args.dump_logits_tokens < 1:
        raise CliError(f"--dump-logits-tokens must be >= 1, got {args.dump_logits_tokens}")
    if folder is None:
        if args.dump_logits_tokens is not None:
            raise CliError("--dump-logits-tokens needs --dump-logits DIR (or serving_config.dump_logits_dir)")
        return None, 0
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"--dump-logits: cannot create {folder}: {exc}") from None
    return Path(folder), min(tokens or max_new_tokens, max_new_tokens)


def _chat_prompts(llm: Any, prompts: list[Any], path: str) -> list[str | list[int]]:
    """Conversations replaced by their prompt ids (the served model's chat template); other prompts as given."""
    from llm_serving.tokenization.chat_template import ChatTemplateError

    out = []
    for i, prompt in enumerate(prompts):
        try:
            out.append(llm.chat_prompt_ids(prompt) if _is_conversation(prompt) else prompt)
        except ChatTemplateError as exc:
            raise CliError(f"--prompts: item {i} of {path}: the chat template refused it: {exc}") from None
    return out


COMMANDS: list[Command] = [
    Command("generate", "generation (greedy unless --temperature) for a file of prompts through the whole "
            "engine (JSON lines out)",
            _generate_arguments, _run_generate),
]


def _commands() -> list[Command]:
    """Built-in commands plus serve, bench, export and patch-mindformers, which live in their own modules."""
    from llm_serving.cli.commands import bench as bench_cli
    from llm_serving.cli.commands import export as export_cli
    from llm_serving.cli.commands import patch_mindformers as mindformers_patches
    from llm_serving.cli.commands import serve as serve_cli

    patch_mf = Command("patch-mindformers", "apply llm-serving's patches (patches/) to the installed MindFormers: "
                       "version check and dry run first (--check: only those)", mindformers_patches.add_arguments,
                       mindformers_patches.run)
    return [*COMMANDS, serve_cli.COMMAND, bench_cli.COMMAND, export_cli.COMMAND, patch_mf]


def main(argv: Sequence[str] | None = None) -> int:
    from llm_serving.config.serving_config import ConfigError
    from llm_serving.core.scheduler import RequestRejected
    from llm_serving.engine.request_stream import EngineError
    from llm_serving.executor.agent_pool import AgentError

    parser = argparse.ArgumentParser(prog="llm-serving", description="Continuous-batching LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    handlers = {}
    for cmd in _commands():
        cmd.add_arguments(sub.add_parser(cmd.name, help=cmd.help, description=cmd.help))
        handlers[cmd.name] = cmd.run
    args = parser.parse_args(argv)
    try:
        return handlers[args.command](args)
    except (CliError, ConfigError, RequestRejected) as exc:
        print(f"llm-serving {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (EngineError, AgentError) as exc:  # agents failed to start or died
        print(f"llm-serving {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
