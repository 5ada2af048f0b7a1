"""Time the parsing of typical OpenAI request bodies (``/v1/completions`` and ``/v1/chat/completions``), from the
decoded JSON to the request the route serves (``parse_completion`` / ``parse_chat``), and the engine parameters
made from it (``to_params``).

    python scripts/bench_request_parse.py [--number 20000] [--rounds 5]

Prints the best of ``rounds`` per-call times in microseconds of this process' CPU time (best, and CPU rather than
wall time: the machine is shared, and waiting for a core is not the parser's cost).
"""

from __future__ import annotations

import argparse
import time
import timeit

from llm_serving.api.chat_schema import parse_chat
from llm_serving.api.schema import parse_completion

COMPLETION = {"model": "llama2", "prompt": "Write a haiku about the sea.", "max_tokens": 64, "temperature": 0.7,
              "top_p": 0.9, "stop": ["\n\n"], "stream": True, "stream_options": {"include_usage": True},
              "seed": 1, "presence_penalty": 0.1}
CHAT = {"model": "llama2", "messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Write a haiku about the sea."}],
        "max_completion_tokens": 64, "temperature": 0.7, "top_p": 0.9, "stream": True,
        "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--number", type=int, default=20000, help="calls per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    cases = {
        "completion parse": lambda: parse_completion(COMPLETION),
        "completion parse+to_params": lambda: _completion_params(),
        "chat parse": lambda: parse_chat(CHAT),
    }
    for name, fn in cases.items():
        best = min(timeit.repeat(fn, timer=time.process_time, number=args.number, repeat=args.rounds)) / args.number
        print(f"{name:30s} {best * 1e6:8.2f} us")


def _completion_params() -> object:
    req = parse_completion(COMPLETION)
    return req.sampling.to_params(req.max_tokens or 16, req.ignore_eos, req.stop, req.FIELD_NAMES)


if __name__ == "__main__":
    main()
