"""Proposers for speculative decoding: tokens a sequence will probably generate next, verified by the model in one
step (``agents.runtime.verify_steps``), so several tokens can come from one model call.

``NgramProposer`` is prompt lookup (``llm_serving.protocol.prompt_lookup``: the agents propose with it too, in a
step's later verify rounds); ``AgentProposer`` leaves the proposing to the agents' draft model.
"""

from __future__ import annotations

from llm_serving.protocol.prompt_lookup import NgramProposer

__all__ = ["AGENT_METHODS", "METHODS", "AgentProposer", "NgramProposer"]

METHODS = ("", "ngram", "draft", "self")
AGENT_METHODS = ("draft", "self")  # the agents' draft proposes (agents.runtime.speculative_runner)


class AgentProposer:
    """The agents propose (a draft model, or the target's first layers): the master reserves the positions and
    sends placeholders, which the agent replaces with its draft's tokens before verifying them."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return [0] * max(k, 0)
