"""The agent sections of the reliability suite (``scripts/chaos.py`` loads ``SECTIONS``): what a dead, a stuck
and a poisoned agent step cost the clients of a live server on this machine.

- ``sigkill``: a batch of greedy requests (more than the decode batch, so some are queued) is answered once
  for reference; the same batch again, and mid-way the serving agent gets SIGKILL. Figures: when /health
  stopped saying ready and when it said ready again with a new agent, how many requests were answered,
  whether every answer equals its reference (the running ones were recomputed), KV blocks used after.
- ``sigstop``: the same with SIGSTOP (a stuck agent): noticed after the step timeout derived from warm-up.
- ``poison``: innocent requests (greedy and sampled) sent together with poisoned ones (issue 18's
  ``top_p: 1e-300`` and ``top_k: 1, top_p: 5e-324``, which reached the agent's sampler as 0) so that they
  share steps. Figures: innocent requests failed (the blast radius), how the poisoned ones were answered,
  agent restarts, KV blocks used after.

The agents' process ids come from ``/health`` (``agent_pids``); the server must run on this machine.
Runnable alone: ``python scripts/chaos_agents.py --url URL [--sections sigkill,sigstop,poison]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_core import Context, RawResponse, Section, SectionError

POISONS = ({"do_sample": True, "top_p": 1e-300}, {"do_sample": True, "top_k": 1, "top_p": 5e-324})
PROMPTS = ("The river ran past the old mill and", "Once upon a time, in a small village by the sea, there lived",
           "Numbers: 1 2 3", "hello world", "tea?", "The quick brown fox")
POLL_S = 0.02


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("agent sections (sigkill, sigstop, poison)")
    g.add_argument("--agents-requests", type=int, default=48,
                   help="requests in flight when the agent is killed or stopped (default 48)")
    g.add_argument("--agents-max-new-tokens", type=int, default=48, help="tokens per request (default 48)")
    g.add_argument("--agents-kill-after-s", type=float, default=0.2,
                   help="seconds after the batch starts running to signal the agent (default 0.2)")
    g.add_argument("--agents-max-recovery-s", type=float, default=60.0,
                   help="a section fails when /health is not ready again within this (default 60)")
    g.add_argument("--poison-innocents", type=int, default=32, help="innocent requests (default 32)")
    g.add_argument("--poison-copies", type=int, default=4, help="copies of each poisoned body (default 4)")


def _arg(ctx: Context, name: str, default: Any) -> Any:
    return getattr(ctx.args, name, default)


def _body(prompt: str, max_new_tokens: int, **parameters: Any) -> dict[str, Any]:
    return {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "do_sample": False, **parameters}}


def _text(r: RawResponse) -> str | None:
    body = r.json() if r.status == 200 else None
    return body.get("generated_text") if isinstance(body, dict) else None


async def _ready_health(ctx: Context) -> dict[str, Any]:
    status, body = await ctx.health()
    if status != 200 or not isinstance(body, dict) or not body.get("agent_pids"):
        raise SectionError(f"the server is not ready with known agent pids (/health: {status} {body})")
    return body


async def _watch_health(ctx: Context, t0: float, old_pids: list[int], bound_s: float) -> dict[str, Any]:
    """Poll /health from ``t0`` until it says ready with other agents: when it stopped and became ready. A
    promoted standby (``serving_config.standby_agents``) may be serving before any poll sees "recovering": then
    ``not_ready_after_s`` is None and the new agents alone say it recovered."""
    left = recovered = None
    states: list[str] = []
    while time.monotonic() - t0 < bound_s:
        status, body = await ctx.health()
        state = body.get("status", str(status)) if isinstance(body, dict) else str(status)
        if not states or states[-1] != state:
            states.append(state)
        if left is None and state != "ready":
            left = time.monotonic() - t0
        if state == "ready" and body.get("agent_pids") not in (None, old_pids):
            recovered = time.monotonic() - t0
            return {"health_states": " > ".join(states), "not_ready_after_s": None if left is None else round(left, 3),
                    "ready_again_after_s": round(recovered, 3), "new_agent_pids": body["agent_pids"]}
        await asyncio.sleep(POLL_S)
    return {"health_states": " > ".join(states), "not_ready_after_s": left, "ready_again_after_s": None}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _agent_fault(ctx: Context, sig: signal.Signals) -> dict[str, Any]:
    """Reference answers, then the same batch with ``sig`` sent to the agent mid-way (see the docstring)."""
    n, tokens = _arg(ctx, "agents_requests", 48), _arg(ctx, "agents_max_new_tokens", 48)
    path = f"/models/{await ctx.model_name()}/generate"
    bodies = [_body(f"{PROMPTS[i % len(PROMPTS)]} {i}", tokens) for i in range(n)]
    health = await _ready_health(ctx)
    before = await ctx.metrics()
    reference = [_text(r) for r in await asyncio.gather(*(ctx.post_json(path, b) for b in bodies))]
    pid = health["agent_pids"][0]
    sends = [asyncio.ensure_future(ctx.post_json(path, b, timeout=300)) for b in bodies]
    deadline = time.monotonic() + 30
    while (at_signal := await ctx.metrics()).get("llm_serving_running_batch_size", 0) == 0:
        if time.monotonic() > deadline:
            raise SectionError("the requests did not start running within 30 s")
        await asyncio.sleep(POLL_S)
    await asyncio.sleep(_arg(ctx, "agents_kill_after_s", 0.2))
    at_signal = await ctx.metrics()
    t0 = time.monotonic()
    os.kill(pid, sig)
    try:
        figures = await _watch_health(ctx, t0, health["agent_pids"], _arg(ctx, "agents_max_recovery_s", 60.0))
        answers = await asyncio.gather(*sends)
        answered_s = time.monotonic() - t0
    finally:
        if sig == signal.SIGSTOP and not _gone(pid):
            os.kill(pid, signal.SIGCONT)  # never leave a stopped process behind
    fresh = await ctx.post_json(path, _body("after the fault", 8))
    after = await ctx.wait_idle()
    texts = [_text(r) for r in answers]
    statuses = Counter(str(r.status) for r in answers)
    ok = sum(t is not None for t in texts)
    same = sum(t is not None and t == ref for t, ref in zip(texts, reference))
    figures = {
        "signal": sig.name, "agent_pid": pid, **figures,
        "running_at_signal": at_signal.get("llm_serving_running_batch_size"),
        "waiting_at_signal": at_signal.get("llm_serving_queue_length"),
        "requests": n, "answered_ok": ok, "statuses": ", ".join(f"{k}x{v}" for k, v in sorted(statuses.items())),
        "identical_to_reference": same, "all_answered_after_s": round(answered_s, 3),
        "old_agent_gone": _gone(pid), "fresh_request_status": fresh.status,
        "agent_restarts": after.get("llm_serving_engine_agent_restarts", 0)
        - before.get("llm_serving_engine_agent_restarts", 0),
        "requests_recomputed": after.get("llm_serving_engine_requests_recomputed", 0)
        - before.get("llm_serving_engine_requests_recomputed", 0),
        "step_timeout_s": after.get("llm_serving_engine_step_timeout_s"),
        "kv_blocks_used_after": after.get("llm_serving_kv_blocks_used"),
    }
    figures["passed"] = (figures["ready_again_after_s"] is not None and ok == n and same == n
                         and fresh.status == 200 and figures["old_agent_gone"]
                         and figures["kv_blocks_used_after"] == 0)
    return figures


async def run_sigkill(ctx: Context) -> dict[str, Any]:
    return await _agent_fault(ctx, signal.SIGKILL)


async def run_sigstop(ctx: Context) -> dict[str, Any]:
    return await _agent_fault(ctx, signal.SIGSTOP)


async def run_poison(ctx: Context) -> dict[str, Any]:
    """Innocent and poisoned requests at once; innocent greedy answers checked against a clean run."""
    n, copies = _arg(ctx, "poison_innocents", 32), _arg(ctx, "poison_copies", 4)
    path = f"/models/{await ctx.model_name()}/generate"
    innocents = [_body(f"{PROMPTS[i % len(PROMPTS)]} {i}", 16, **(
        {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "seed": i} if i % 2 else {})) for i in range(n)]
    poisoned = [_body(f"poison {k}", 4, **p) for k in range(copies) for p in POISONS]
    await _ready_health(ctx)
    before = await ctx.metrics()
    reference = [_text(r) for r in await asyncio.gather(*(ctx.post_json(path, b) for b in innocents))]
    mixed = innocents[: n // 2] + poisoned + innocents[n // 2:]  # poisons in the middle of one burst
    answers = await asyncio.gather(*(ctx.post_json(path, b, timeout=120) for b in mixed))
    got = answers[: n // 2] + answers[n // 2 + len(poisoned):]
    bad = answers[n // 2: n // 2 + len(poisoned)]
    texts = [_text(r) for r in got]
    after = await ctx.wait_idle()
    status, _ = await ctx.health()
    figures = {
        "innocent_requests": n, "poisoned_requests": len(poisoned),
        "innocent_failed": sum(t is None for t in texts),
        "innocent_identical_to_clean_run": sum(t is not None and t == ref for t, ref in zip(texts, reference)),
        "poisoned_statuses": ", ".join(f"{k}x{v}" for k, v in sorted(Counter(str(r.status) for r in bad).items())),
        "poisoned_json_errors": sum(r.is_json_error for r in bad),
        "requests_failed_in_engine": after.get("llm_serving_engine_requests_failed", 0)
        - before.get("llm_serving_engine_requests_failed", 0),
        "agent_restarts": after.get("llm_serving_engine_agent_restarts", 0)
        - before.get("llm_serving_engine_agent_restarts", 0),
        "kv_blocks_used_after": after.get("llm_serving_kv_blocks_used"), "health_after": status,
    }
    figures["passed"] = (figures["innocent_failed"] == 0 and figures["innocent_identical_to_clean_run"] == n
                         and figures["agent_restarts"] == 0 and figures["kv_blocks_used_after"] == 0
                         and status == 200)
    return figures


SECTIONS = [
    Section("sigkill", "SIGKILL the agent mid-batch: recovery time, answers recomputed, KV leak",
            run_sigkill, add_arguments),
    Section("sigstop", "SIGSTOP the agent mid-batch: the stuck step noticed, agent replaced", run_sigstop),
    Section("poison", "poisoned requests mixed into a batch: innocent requests failed (blast radius)", run_poison),
]


def main(argv: list[str] | None = None) -> int:
    """``chaos.py`` with only these sections unless ``--sections`` says otherwise."""
    import chaos

    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--sections" or a.startswith("--sections=") for a in argv):
        argv += ["--sections", ",".join(s.name for s in SECTIONS)]
    return chaos.main(argv)


if __name__ == "__main__":
    sys.exit(main())
