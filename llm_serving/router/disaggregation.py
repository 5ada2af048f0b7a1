"""Prefill/decode disaggregation in the router (``llm-serving router --prefill URL``): a completion or chat request
goes first to a prefill engine, asking for one token and for the prompt's KV blocks to be kept
(``kv_transfer_params: {"do_remote_decode": true}``), then, as the client sent it, to a decode engine with the
transfer that answer names and the prefill engine's URL, from which the decode engine fetches the blocks before it
computes the rest of the prompt (``llm_serving.api.kv_transfer_routes``). The client sees the decode engine's answer
only. Requests this cannot split (several prompts or choices, other routes, a body that is not JSON) go to a decode
engine whole, as do those whose prefill engine fails: the decode engine then computes the prompt itself.

Transfer parameters are the router's alone: a client's own ``kv_transfer_params`` are dropped from every completion
and chat request (``without_transfer_params``), with or without prefill engines, so no client can make an engine
hold blocks, or a decode engine fetch from a URL the client chose.
"""

from __future__ import annotations

import json
from typing import Any

DISAGGREGATED_PATHS = ("/v1/completions", "/v1/chat/completions")
_LENGTH_KEYS = ("max_tokens", "max_completion_tokens")


def without_transfer_params(data: dict[str, Any]) -> dict[str, Any]:
    """The client's request (its parsed JSON body) without ``kv_transfer_params``."""
    return {k: v for k, v in data.items() if k != "kv_transfer_params"}


def prefill_request(data: Any) -> dict[str, Any] | None:
    """The request to send a prefill engine (transfer parameters the router's own) for the client's parsed JSON
    body, or None when the request is not one to split."""
    if not isinstance(data, dict):
        return None
    if data.get("n", 1) != 1 or data.get("best_of", 1) != 1:
        return None
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
        return None  # several prompts
    out = {k: v for k, v in data.items() if k not in ("stream", "stream_options", "min_tokens", *_LENGTH_KEYS)}
    out["max_completion_tokens" if "max_completion_tokens" in data else "max_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_request(data: dict[str, Any], prefill_answer: bytes, prefill_url: str) -> dict[str, Any] | None:
    """The client's request (parsed, without transfer parameters) for the decode engine with the transfer the
    prefill engine's answer names (its blocks at ``prefill_url``); None when it names none (the decode engine
    then computes the prompt from the client's request as it is)."""
    try:
        params = json.loads(prefill_answer).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    if not isinstance(params, dict) or not isinstance(params.get("transfer_id"), str) or not params.get("num_blocks"):
        return None
    return {**data, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": params["transfer_id"],
                                           "remote_url": prefill_url}}
