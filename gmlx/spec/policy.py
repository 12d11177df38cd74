"""Whether a batch speculates this round and how deep each row drafts: the width cap from the
measured round costs, the rows' live acceptance (spec/depth.py), and a gated batch's resume
checks. The engine (engine.py) asks; it owns the transitions these answers lead to."""

from __future__ import annotations

from dataclasses import dataclass, replace

from gmlx import config
from gmlx.config import EngineConfig
from gmlx.request import Request
from gmlx.spec import admission
from gmlx.spec.batch import BatchMode, DecodeBatch
from gmlx.spec.depth import PRIOR_ACCEPTANCE, DepthPolicy

# A gated batch asks whether to resume on one round in this many while its rows stay the
# same (a row joining asks at once): the question (width cap, resume budget, each row's
# expected tokens at every depth) is ~50 us of Python, a tenth of a fast model's round.
GATED_RECHECK_ROUNDS = 4
# Rows leaving a batch that was over the cap: it waits this many rounds before it asks, since
# their clients' next prompts may be on the way and would gate a resume again after its settle
# and capture (served SmolLM2, 8 closed-loop clients: a wave's last two rows resumed at once,
# and the returning six gated them 2-4 speculative rounds later, 6-12 times a run).
RESUME_AFTER_LEAVE_ROUNDS = 4


class SpeculationPolicy:
    def __init__(self, drafter, engine_config: EngineConfig, round_costs):
        self.drafter = drafter
        self.config = engine_config
        self.round_costs = round_costs  # measured (or as-served) round costs; None: the drafter's fixed cap
        # None: every speculating row drafts the drafter's k each round (fixed depth).
        self.depth_policy = (DepthPolicy(drafter.num_draft_tokens, table=round_costs,
                                         has_bare_rounds=drafter.drafts_past_pending)
                             if drafter is not None and engine_config.is_adaptive_depth else None)
        self._gate_hold: _GateHold | None = None  # a gated batch's last resume check
        self._round_evidence: dict[str, int] = {}  # request id -> its evidence class this round

    def width_cap(self) -> int:
        calibrated = None
        if self.round_costs is not None:
            calibrated = self.round_costs.width_cap(self.acceptance_prior(), self.config.max_num_rows)
        return admission.width_cap(self.config.speculative_width_cap, self.drafter, calibrated)

    def live_depth_policy(self) -> DepthPolicy | None:
        """The depth policy rounds follow; None (every row drafts the fixed k) when GMLX_ADAPTIVE_DEPTH=0."""
        return self.depth_policy if config.is_adaptive_depth_enabled() else None

    def acceptance_prior(self) -> float:
        return self.depth_policy.prior_acceptance if self.depth_policy is not None else PRIOR_ACCEPTANCE

    def describe(self) -> dict:
        """The stats' draft depths and calibration table (None where there is none)."""
        return {
            "draft_depth": self.depth_policy.describe() if self.depth_policy is not None else None,
            "calibration": (self.round_costs.describe(self.acceptance_prior(), self.config.max_num_rows)
                            if self.round_costs is not None else None),
        }

    # --- the cap and a gated batch's checks ---------------------------------------------

    def is_over_cap(self, batch: DecodeBatch) -> bool:
        # A cap is 0 (none) or at least one row: a lone speculating row is within it, and its
        # rounds skip the cap's model (~70 us whenever the acceptance prior moves a step).
        return (batch.mode is not BatchMode.PLAIN and batch.num_draft_rows > 1
                and not admission.is_within_cap(self.width_cap(), batch.num_draft_rows))

    def held_gate(self, batch: DecodeBatch) -> bool | None:
        """Within a gated batch's hold (same rows, rounds left): whether it was over the cap at
        its last check, and one round of the hold spent; rows leaving a batch over the cap start a
        hold of RESUME_AFTER_LEAVE_ROUNDS. None where this round must check."""
        hold = self._gate_hold
        if batch.mode is not BatchMode.GATED or hold is None:
            self._gate_hold = None
            return None
        rows = _rows_key(batch)
        if rows != hold.rows:
            self._gate_hold = None
            if (hold.is_over_cap or hold.is_awaiting_leavers) and set(rows) < set(hold.rows):
                # Rows left a batch over the cap (staggered leaves restart the wait): hold
                # again, asking what the rows left have.
                is_over_cap = self.is_over_cap(batch)
                self._gate_hold = _GateHold(rows, is_over_cap, RESUME_AFTER_LEAVE_ROUNDS - 1, is_awaiting_leavers=True)
                return is_over_cap
            return None
        if not hold.num_rounds_left:
            self._gate_hold = None
            return None
        self._gate_hold = replace(hold, num_rounds_left=hold.num_rounds_left - 1)
        return hold.is_over_cap

    def hold_gate(self, batch: DecodeBatch, is_over_cap: bool) -> None:
        """A gated batch just checked (and stays gated): the next GATED_RECHECK_ROUNDS - 1 rounds
        reuse the answer while its rows stay the same."""
        self._gate_hold = _GateHold(_rows_key(batch), is_over_cap, GATED_RECHECK_ROUNDS - 1)

    def waiters_go_over_cap(self, batch: DecodeBatch, waiting: list[Request]) -> bool:
        """Whether the speculating prompts waiting to join would take the batch over the cap: a
        resume now would pay its settle and capture rounds for a round or two of drafts (served
        SmolLM2, 8 closed-loop clients: a wave's last rows resumed as the next wave queued)."""
        num_waiting = min(sum(r.params.speculate for r in waiting), self.config.max_num_rows - batch.num_rows)
        return num_waiting > 0 and not admission.is_within_cap(self.width_cap(), batch.num_draft_rows + num_waiting)

    def drafting_pays(self, batch: DecodeBatch) -> bool:
        """Whether the speculating rows' estimates ask for drafts (always, with a fixed depth)."""
        policy = self.live_depth_policy()
        return policy is None or policy.pays_to_draft(*_policy_rows(batch))

    def expected_gain(self, batch: DecodeBatch) -> float | None:
        """What the rows' estimates expect a resume to gain (a resume's event reports it)."""
        policy = self.live_depth_policy()
        return None if policy is None else policy.expected_gain(*_policy_rows(batch))

    # --- depths and evidence ------------------------------------------------------------

    def draft_depths(self, batch: DecodeBatch) -> list[int] | None:
        """Each row's k this round: from the rows' live acceptance and this round's evidence (or
        the drafter's fixed k); opt-out rows 0. None: the rows' drafts do not pay (gate)."""
        policy = self.live_depth_policy()
        self._round_evidence = {}
        if policy is None:
            return [self.drafter.num_draft_tokens if r.params.speculate else 0 for r in batch.requests]
        request_ids, num_plain_rows = _policy_rows(batch)
        view = batch.draft_view
        evidence = self._draft_evidence_of(view.requests, view.is_delivered)
        depths = policy.round_depths(request_ids, num_plain_rows, evidence, is_pipelined=not batch.is_settled)
        if depths is None:
            return None
        self._round_evidence = dict(zip(request_ids, evidence)) if evidence is not None else {}
        drafted = iter(depths)
        return [next(drafted) if r.params.speculate else 0 for r in batch.requests]

    def scored_row(self, batch: DecodeBatch, round_index: int, is_over_cap: bool) -> int | None:
        """The one speculating row a gated round keeps score for (round robin; None over the cap or
        without a live policy): a lookup scans the row's history, and every row every round cost a
        wide batch of a fast model ~10%."""
        if self.live_depth_policy() is None or is_over_cap:
            return None
        draft_rows = batch.draft_rows
        return draft_rows[round_index % len(draft_rows)] if draft_rows else None

    def observe_gated(self, scored: Request | None) -> None:
        """A gated round's evidence: the speculating rows' estimates rest, but the scored row's
        (within the cap, a new token, still decoding) where a drafter can tell from the history
        alone (n-gram) whether its draft would have been this round's token, so a row whose
        text turns repetitive re-arms the batch."""
        policy = self.live_depth_policy()
        if policy is None:
            return
        would_match = self.drafter.would_have_drafted(scored) if scored is not None else None
        if would_match is None:
            policy.rest()
        else:
            policy.rest(scored.request_id)
            policy.observe(scored.request_id, 1, int(would_match))
            evidence = self._draft_evidence_of([scored], [True])  # a resumed batch drafts settled
            if evidence is not None:
                policy.observe_share(evidence[0])  # how often the text would give drafts to verify

    def observe_verify(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """A speculating row's verify: its acceptance estimate moves."""
        if self.depth_policy is not None and request.params.speculate:
            self.depth_policy.observe(request.request_id, num_drafted, num_accepted,
                                      self._round_evidence.get(request.request_id))

    def forget(self, request_id: str) -> None:
        if self.depth_policy is not None:
            self.depth_policy.forget(request_id)

    def _draft_evidence_of(self, requests: list[Request], is_delivered: list[bool]) -> list[int] | None:
        """These rows' evidence classes this round, where the drafter grades its drafts."""
        grade = getattr(self.drafter, "draft_evidence", None)
        is_on = self.config.is_draft_evidence and config.is_draft_evidence_enabled()
        return grade(requests, is_delivered) if grade is not None and is_on else None


def _policy_rows(batch: DecodeBatch) -> tuple[list[str], int]:
    """What the depth policy weighs: the speculating rows' ids, and how many rows decode plain beside them."""
    return [r.request_id for r in batch.draft_requests], batch.num_rows - batch.num_draft_rows


def _rows_key(batch: DecodeBatch) -> tuple[str, ...]:
    """Which requests a batch holds, in order (what a gated batch's hold is for)."""
    return tuple(r.request_id for r in batch.requests)


@dataclass(frozen=True)
class _GateHold:
    """A gated batch's last resume check, kept while its rows stay these requests."""
    rows: tuple[str, ...]  # the batch's request ids, in order
    is_over_cap: bool
    num_rounds_left: int  # rounds that reuse it before the batch asks again
    is_awaiting_leavers: bool = False  # held since rows left a batch over the cap
