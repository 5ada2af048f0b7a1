"""Speculative decoding's policy on the master: which decode steps verify proposals, how many a sequence gets
and in how many rounds, and the counts the metrics report.

The scheduler decides who runs; when its step is a decode step it asks ``plan`` whether to verify instead.
Proposals (``core.speculative``'s proposers) go to the sequences whose sampling allows it, fewer than each may
still generate, within the KV blocks free now (never preempting for them), and fewer each as the batch grows
(``verify_round_proposals``: at saturation verifying costs more than it saves). A sequence whose proposals keep
failing sits out a while (``speculative_min_accepted``); with ``speculative_adaptive`` a batch size speculates only
while verify steps measure faster (tokens/s) than plain ones there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llm_serving.core.scheduler_config import SchedulerConfig
from llm_serving.core.sequence import Sequence
from llm_serving.core.speculative import AGENT_METHODS, AgentProposer, NgramProposer
from llm_serving.protocol.batch import StepBatch, StepOutput, verify_round_proposals

PAUSE_STEPS = 8  # decode steps a sequence sits out of speculation after its proposals kept failing
PROBE_EVERY = 16  # decode steps of a batch size between two tries of the mode measured slower
RATE_WEIGHT = 0.2  # weight of the newest step in a mode's running tokens/s
MEAN_WEIGHT = 0.3  # weight of the newest verification in a sequence's running mean of accepted proposals


@dataclass(frozen=True)
class VerifyPlan:
    """A decode step turned verify step: each sequence's proposals (blocks reserved), the rounds the agents run,
    and the proposals a sequence gets in each later round."""

    drafts: list[list[int]]
    rounds: int
    round_proposals: int


class Speculation:
    """The policy of a scheduler whose ``config.speculative`` names a method (its keys: ``SchedulerConfig``)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.proposer: NgramProposer | AgentProposer
        if config.speculative == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.speculative in AGENT_METHODS:
            self.proposer = AgentProposer()
        else:
            raise ValueError(f"speculative method {config.speculative!r} has no proposer")
        # verify steps, sequences' drafts verified, proposals sent and accepted (engine metrics)
        self.steps = self.drafts = self.proposed = self.accepted = 0
        self._verifying: dict[str, int] = {}  # the step in flight's first-round proposals per request
        # measured choice (``note_step_time``): running tokens/s of decode steps by (batch size class, speculated),
        # the decode steps seen per class, and what the last step was (class, speculated, tokens appended)
        self._rates: dict[tuple[int, bool], float] = {}
        self._turns: dict[int, int] = {}
        self._last_decode: tuple[int, bool, int] | None = None

    # ---- planning ---------------------------------------------------------------------------------------------
    def plan(self, seqs: list[Sequence], waiting: bool, reads_logits: bool, master_needed: bool,
             reserve: Callable[[list[Sequence], int], bool]) -> VerifyPlan | None:
        """The verify step replacing the decode step of ``seqs``, or None for a plain decode step: none while a
        request waits to be admitted or a running one reads logits back (``waiting``, ``reads_logits``); several
        rounds only while the master is not needed between tokens (``master_needed``). A plan of several rounds is
        sent even when its first round has no proposals (the agents propose in the later ones)."""
        if waiting or reads_logits:
            return None
        k = self.round_proposals(len(seqs))
        if k < 1 or (self.config.speculative_adaptive and not self._pays(len(seqs))):
            return None
        drafts = [self._propose(seq, k, reserve) for seq in seqs]
        rounds = self._rounds(seqs, k, master_needed, reserve)
        return VerifyPlan(drafts, rounds, k) if rounds > 1 or any(drafts) else None

    def round_proposals(self, batch_size: int) -> int:
        """Proposals a sequence of a verify step of ``batch_size`` sequences gets a round."""
        return verify_round_proposals(self.config.num_speculative_tokens, self.config.speculative_step_tokens,
                                      batch_size)

    def wants_history(self, rounds: int) -> bool:
        """Whether a verify step of ``rounds`` carries its sequences' tokens (the agents' prompt lookup)."""
        return rounds > 1 and isinstance(self.proposer, NgramProposer)

    def _propose(self, seq: Sequence, k: int, reserve: Callable[[list[Sequence], int], bool]) -> list[int]:
        """Up to ``k`` proposals for ``seq`` whose positions' blocks are free now (reserved for them)."""
        room = min(k, seq.params.max_new_tokens - len(seq.output_ids) - 1)  # the last pick is a token too
        if seq.spec_pause:  # its proposals kept failing: plain decode steps for a while
            seq.spec_pause -= 1
            room = 0
        room = room if seq.params.speculable else 0
        proposal = self.proposer.propose(seq.prompt_ids + seq.output_ids, room) if room > 0 else []
        while proposal and not reserve([seq], len(proposal)):
            proposal.pop()
        return proposal

    def _rounds(self, seqs: list[Sequence], k: int, master_needed: bool,
                reserve: Callable[[list[Sequence], int], bool]) -> int:
        """Verify rounds the agents run (``agents.runtime.verify_rounds``): up to ``speculative_rounds``, no more
        than any sequence may still generate at ``k + 1`` tokens a round, and only with the blocks of all those
        positions free now."""
        if self.config.speculative_rounds == 1 or master_needed:
            return 1
        per_round = k + 1
        rounds = min(self.config.speculative_rounds,
                     min(seq.params.max_new_tokens - len(seq.output_ids) for seq in seqs) // per_round)
        # the last round's proposals reach the position before the step's last token at most
        return rounds if rounds > 1 and reserve(seqs, rounds * per_round - 1) else 1

    def _pays(self, batch_size: int) -> bool:
        """Whether a decode step of ``batch_size`` sequences speculates: by the tokens/s measured for both modes at
        this batch size (its power-of-two class), trying each mode first and the slower one again every
        ``PROBE_EVERY`` steps (costs change with the contexts and the acceptance)."""
        size = batch_size.bit_length()
        turn = self._turns[size] = self._turns.get(size, 0) + 1
        spec, plain = self._rates.get((size, True)), self._rates.get((size, False))
        if spec is None or plain is None:
            return spec is None  # measure speculation first, then plain steps
        faster = spec >= plain
        return faster != (turn % PROBE_EVERY == 0)

    # ---- counting ---------------------------------------------------------------------------------------------
    def sent(self, seqs: list[Sequence], batch: StepBatch) -> None:
        """Count a verify step's first-round drafts and proposals."""
        assert batch.draft_lens is not None
        self.steps += 1
        self._verifying = {seq.request_id: int(d) for seq, d in zip(seqs, batch.draft_lens.tolist())}
        self.drafts += int((batch.draft_lens > 0).sum())
        self.proposed += int(batch.draft_lens.sum())

    def verified(self, seq: Sequence, row: int, output: StepOutput) -> None:
        """Count a verify step's drafts, proposals and accepted proposals of ``seq`` (those of every round: the
        agents' ``spec_counts``; the first round's proposals were counted when the step was sent)."""
        assert output.num_more is not None
        first = self._verifying.get(seq.request_id, 0)
        if output.spec_counts is None:
            drafts, accepted = int(first > 0), int(output.num_more[row])
        else:
            drafts, proposed, accepted = output.spec_counts[row].tolist()
            self.drafts += drafts - (first > 0)
            self.proposed += proposed - first
        if drafts:
            self._note_acceptance(seq, accepted, drafts)

    def _note_acceptance(self, seq: Sequence, accepted: int, drafts: int = 1) -> None:
        """Count ``accepted`` proposals of ``drafts`` verified drafts; pause the proposals while they keep failing."""
        self.accepted += accepted
        mean, now = seq.spec_accepted_mean, accepted / drafts
        mean = now if mean == float("inf") else (1 - MEAN_WEIGHT) * mean + MEAN_WEIGHT * now
        if mean < self.config.speculative_min_accepted:
            seq.spec_pause, mean = PAUSE_STEPS, float("inf")  # then a fresh start
        seq.spec_accepted_mean = mean

    def decoded(self, batch_size: int, speculated: bool, tokens: int) -> None:
        """Remember a decode step's batch size class and tokens for ``note_step_time``."""
        self._last_decode = (batch_size.bit_length(), speculated, tokens)

    def note_step_time(self, seconds: float) -> None:
        """The wall time of the decode step ``decoded`` last noted: its tokens/s feed the measured choice."""
        if self._last_decode is None or seconds <= 0:
            return
        size, speculated, tokens = self._last_decode
        self._last_decode = None
        rate, key = tokens / seconds, (size, speculated)
        old = self._rates.get(key)
        self._rates[key] = rate if old is None else (1 - RATE_WEIGHT) * old + RATE_WEIGHT * rate
