"""The ``generate`` command: a file of prompts through the whole engine (agent processes, shared memory,
continuous batching), one JSON line per prompt, optionally with each prompt's logits dumped."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from llm_serving.cli.options import CliError, Command, add_config_arguments, config_from_args


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
            from llm_serving.request_errors import MessageError
            from llm_serving.tokenization.chat_template import check_messages

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
    from llm_serving.core.sequence import SamplingParams
    from llm_serving.request_errors import InvalidParameter

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
                assert res.logits is not None  # asked for with logits_tokens
                np.save(dump_dir / f"{index}.npy", res.logits)
            line: dict[str, object] = {"prompt": prompt if isinstance(prompt, str) else None,
                    "prompt_ids": res.prompt_ids, "token_ids": res.token_ids, "logprobs": res.logprobs,
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
    from llm_serving.request_errors import ChatTemplateError

    out = []
    for i, prompt in enumerate(prompts):
        try:
            out.append(llm.chat_prompt_ids(prompt) if _is_conversation(prompt) else prompt)
        except ChatTemplateError as exc:
            raise CliError(f"--prompts: item {i} of {path}: the chat template refused it: {exc}") from None
    return out


COMMAND = Command("generate", "generation (greedy unless --temperature) for a file of prompts through the whole "
                  "engine (JSON lines out)", _generate_arguments, _run_generate)
