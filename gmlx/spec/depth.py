"""Draft depth from live acceptance: each round the speculating rows draft the k in 0..k_max
that maximizes the round's expected tokens per unit of round cost.

Model: a row accepts each draft independently with probability a (its own, live), so with k
drafts it emits E(k) = 1 + a + ... + a^k tokens. A ragged verify pads every row to the deepest
row's k + 1 positions, so the round's cost is set by its deepest row: the rows share one k,
chosen for the sum of their E(k) (an opted-out row adds 1 token) over the round's cost at that
k and width. A per-row k would let one row with good acceptance make every row pay its depth
(served, built-in model, 16 clients: 0.69x of plain while each row's own sums said it paid).
k = 0 is plain decoding (E = 1 per row at a plain round's cost); a batch drafts only where it
beats plain decoding by DRAFT_GAIN_MARGIN (a lone stream wherever it beats it), so a batch
whose drafts do not pay stops drafting.
The costs come from the start-up calibration corrected by the rounds as served
(calibration.py, served_costs.py) or from DraftCosts' defaults.

The acceptance a is per request, smoothed: decayed counts of accepted and tried drafts plus a
prior, which is the drafter's acceptance over every row so far. A row at k = 0 tries nothing,
so its counts decay toward the prior and it probes again after a while. A round with a row
that has tried fewer than MIN_TRIES_TO_STOP drafts drafts at least one token where such a row,
taking PROBE_SPREAD more of its drafts than the rows so far, would make drafts pay: a probe
finds the texts a drafter suits, and costs only where none could. When a round's depth is 0
the engine gates the batch to pipelined plain rounds; it re-arms when the rows' estimates ask
for drafts again (pays_to_draft; a gated n-gram row keeps score from its history, other rows
rest toward the prior).

A drafter may grade each row's drafts this round (its evidence class: the n-gram drafter's match
size). Then the rows' estimates only decide whether the batch speculates, each round's depth is
chosen from the acceptance of its rows' classes, pooled over every row, and a round whose
classes ask for none runs at depth 0 without a gate (a gate and resume cost two unpipelined
rounds, and the next round may match): a verify of the pending tokens alone, or, where the
drafter drafts past an undelivered lookahead (has_bare_rounds), a bare round, which is a
pipelined plain round once one is in flight. Whether to speculate weighs the share of recent
rounds that drafted, since a round without drafts may cost more than a gated plain one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.6  # before any row has drafted: a typical first-draft agreement
_PRIOR_WEIGHT = 2.0  # the prior counts as this many tried drafts
_DECAY = 0.8  # per round: about the last five rounds carry a row's estimate
# Per plain round of a batch gated because no row's drafts pay: a resume costs two unpipelined
# rounds, so a resting row's estimate returns to the prior over ~20 rounds, not ~5.
_RESTING_DECAY = 0.95
# A batch drafts only when its expected tokens per unit of cost beat plain decoding's by this
# much: independent acceptance overstates a batch's runs of drafts (served built-in, 16 clients:
# 1.9 tokens a row at depth 2 where it predicted 2.2), and each gate and resume costs two wide
# rounds. A lone stream's drafts hit in long runs the estimate understates, and its transitions
# are two short rounds: with the margin, served built-in at 1 client read 1.30x of plain
# against fixed k's 1.40x; without it 1.27-1.53x against 1.17-1.48x in three runs.
DRAFT_GAIN_MARGIN = 0.1
# A row drafts until it has tried this many drafts: n-gram drafts hit in runs, and one
# rejected first draft stopped rows that accept a third of their drafts over a request.
MIN_TRIES_TO_STOP = 3
# How much better than the pooled acceptance a new row's may turn out: requests differ by
# about this much (SmolLM2, session 5's MTP head: prose 0.0, code 0.5). Where even that would
# not pay (that head, whose drafts cost 40% of a step, needed 0.8 at one row), a probe is only
# a cost: 4% of a lone stream's tokens per second at 64 tokens a request.
PROBE_SPREAD = 0.25
# Per observation of an evidence class: about the last fifty rounds of a class carry its estimate
# (classes are the drafter's, not the text's: SmolLM2's prose and code agree within 0.12 per class).
_CLASS_DECAY = 0.98
# Per speculating round: about the last twenty rounds carry the share of rounds that drafted.
_DRAFTING_SHARE_DECAY = 0.95


# The ledger of drafts kept against the model's expectation groups rounds by width, from these
# (describe()): where wide batches keep less than independent acceptance predicts, it shows there.
_LEDGER_WIDTHS = (1, 2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class DraftCosts:
    """One round's cost terms, in units of a one-position target forward at the same width."""

    verify_per_position: float = 0.1  # each verified position past the first (DESIGN: 4 cost ~1.3x 1)
    draft_per_token: float = 0.1  # the drafter's work per draft step

    @property
    def per_depth(self) -> float:
        return self.verify_per_position + self.draft_per_token


def expected_tokens(acceptance: float, depth: int) -> float:
    """Tokens one round of this depth emits: accepted drafts plus the bonus."""
    return sum(acceptance**j for j in range(depth + 1))


@dataclass(slots=True)
class _RowEstimate:
    num_accepted: float = 0.0  # decayed
    num_tried: float = 0.0  # decayed; a draft counts as tried when the ones before it were accepted
    num_tried_ever: int = 0  # not decayed: the evidence the row's own estimate rests on
    num_rests_applied: int = 0  # the policy's resting rounds already decayed into the counts


@dataclass(slots=True)
class _LedgerEntry:
    num_row_rounds: int = 0  # a row's drafting round each
    num_expected: float = 0.0  # drafts the model expected kept: a + ... + a^k a row-round
    num_kept: int = 0


@dataclass(slots=True)
class _ClassEstimate:
    num_accepted: float = 0.0  # decayed, pooled over every row that drafted in this class
    num_tried: float = 0.0


@dataclass
class DepthPolicy:
    k_max: int
    costs: DraftCosts = field(default_factory=DraftCosts)
    table: object = None  # a calibration.CostTable: measured costs per width replace `costs`
    # The engine runs a round whose rows draft nothing as a pipelined plain round (a bare round:
    # the drafter drafts past an undelivered lookahead), not as a verify of the pending tokens.
    has_bare_rounds: bool = False
    _rows: dict[str, _RowEstimate] = field(default_factory=dict)
    _classes: dict[int, _ClassEstimate] = field(default_factory=dict)  # evidence class -> its estimate
    # Of the recent speculating rounds with evidence, the share whose classes asked for drafts.
    _drafting_share: float = 1.0
    _num_accepted: int = 0  # over every row: the prior of a new row
    _num_tried: int = 0
    # Gated rounds so far: a row's counts take their resting decay when next read, so a gated
    # round's bookkeeping does not grow with the width (it was 3 us at 8 rows, 11 us at 32).
    _num_rests: int = 0
    # Per speculating row of the round in flight: (its ledger width, the drafts it is expected to keep).
    _expected: dict[str, tuple[int, float]] = field(default_factory=dict)
    _ledger: dict[int, _LedgerEntry] = field(default_factory=dict)

    def __post_init__(self):
        assert self.k_max >= 0, self.k_max

    @property
    def prior_acceptance(self) -> float:
        return (self._num_accepted + PRIOR_ACCEPTANCE * _PRIOR_WEIGHT) / (self._num_tried + _PRIOR_WEIGHT)

    def acceptance(self, request_id: str) -> float:
        row = self._current(request_id) if request_id in self._rows else _RowEstimate()
        return (row.num_accepted + self.prior_acceptance * _PRIOR_WEIGHT) / (row.num_tried + _PRIOR_WEIGHT)

    def _current(self, request_id: str) -> _RowEstimate:
        """The row's estimate (a new one if none) with every resting round since its last read applied."""
        row = self._rows.get(request_id)
        if row is None:
            row = self._rows[request_id] = _RowEstimate(num_rests_applied=self._num_rests)
        elif row.num_rests_applied != self._num_rests:
            fade = _RESTING_DECAY ** (self._num_rests - row.num_rests_applied)
            row.num_accepted *= fade
            row.num_tried *= fade
            row.num_rests_applied = self._num_rests
        return row

    def depths(self, request_ids: list[str], num_plain_rows: int = 0) -> list[int]:
        """This round's k for each speculating row, beside num_plain_rows rows that decode plain
        (opted out) in the same verify: one k for all (the deepest row sets the round's cost)."""
        return self.round_depths(request_ids, num_plain_rows) or [0] * len(request_ids)

    def round_depths(self, request_ids: list[str], num_plain_rows: int = 0, evidence: list[int] | None = None,
                     is_pipelined: bool = False) -> list[int] | None:
        """depths(), or None where the batch should not speculate (the engine gates it); with
        the rows' evidence classes this round, its depth from their classes' acceptance (0 allowed).
        is_pipelined: a lookahead is in flight (after a bare round), so a round at depth 0 is a
        pipelined plain round's cost."""
        row_acceptances = [self.acceptance(r) for r in request_ids]
        k = self._depth_for(row_acceptances, num_plain_rows)
        # A row's first rounds draft once (acceptance measured, not assumed) where that could pay.
        is_probe = k == 0 and self.k_max > 0 and self._is_probe_worth_it(request_ids, num_plain_rows)
        if is_probe:
            k = 1
        if k == 0:
            return None
        if evidence is not None:
            assert len(evidence) == len(request_ids)
            acceptances = [self.class_acceptance(c) for c in evidence]
            k = self._class_depth(acceptances, num_plain_rows, is_pipelined and self.has_bare_rounds)
            k = max(k, 1) if is_probe else k  # a probe drafts whatever the evidence
            self._note_drafting(k > 0)
        else:
            acceptances = row_acceptances
        if k:
            width = max(w for w in _LEDGER_WIDTHS if w <= len(request_ids) + num_plain_rows)
            for request_id, a in zip(request_ids, acceptances):
                self._expected[request_id] = (width, expected_tokens(a, k) - 1)
        return [k] * len(request_ids)

    def observe_share(self, evidence_class: int) -> None:
        """A gated row's evidence this round: whether a lone row would draft on it moves the
        share of drafting rounds, so a text that turns repetitive can re-arm the batch."""
        self._note_drafting(self._class_depth([self.class_acceptance(evidence_class)], 0) > 0)

    def _note_drafting(self, is_drafting: bool) -> None:
        self._drafting_share = self._drafting_share * _DRAFTING_SHARE_DECAY + (1 - _DRAFTING_SHARE_DECAY) * is_drafting

    def class_acceptance(self, evidence_class: int) -> float:
        """The pooled acceptance of drafts made on this evidence, the drafter's overall as prior."""
        pooled = self._classes.get(evidence_class) or _ClassEstimate()
        return (pooled.num_accepted + self.prior_acceptance * _PRIOR_WEIGHT) / (pooled.num_tried + _PRIOR_WEIGHT)

    def _class_depth(self, acceptances: list[float], num_plain_rows: int, is_pipelined: bool = False) -> int:
        """A speculating batch's depth this round for rows of these acceptances: 0 is a verify of
        the pending tokens alone or a bare round from a settled batch, at an unpipelined round's
        cost; a bare round with a lookahead in flight is a pipelined plain round."""
        width, rows = len(acceptances) + num_plain_rows, self._expected_tokens_by_depth(acceptances)
        bare_s = self._round_cost(width, 0) if is_pipelined else self._spec_round_cost(width, 0)
        return max(range(self.k_max + 1), key=lambda k: ((sum(row[k] for row in rows) + num_plain_rows)
                                                          / (self._spec_round_cost(width, k) if k else bare_s), -k))

    def pays_to_draft(self, request_ids: list[str], num_plain_rows: int = 0) -> bool:
        """Whether the rows' estimates alone ask for drafts (no probe): what re-arms a batch
        gated because its drafts did not pay."""
        return self._round_depth(request_ids, num_plain_rows) > 0

    def _is_probing(self, request_id: str) -> bool:
        row = self._rows.get(request_id)
        return row is None or row.num_tried_ever < MIN_TRIES_TO_STOP

    def _is_probe_worth_it(self, request_ids: list[str], num_plain_rows: int) -> bool:
        """Some row is still probing, and drafts would pay were the probing rows' acceptance
        PROBE_SPREAD above the pooled one."""
        is_probing = [self._is_probing(r) for r in request_ids]
        if not any(is_probing):
            return False
        hopeful = min(1.0, self.prior_acceptance + PROBE_SPREAD)
        acceptances = [hopeful if probing else self.acceptance(r) for r, probing in zip(request_ids, is_probing)]
        return self._depth_for(acceptances, num_plain_rows) > 0

    def _round_depth(self, request_ids: list[str], num_plain_rows: int) -> int:
        return self._depth_for([self.acceptance(r) for r in request_ids], num_plain_rows)

    def expected_gain(self, request_ids: list[str], num_plain_rows: int = 0) -> float:
        """The rows' best expected tokens per unit of cost over plain decoding's (what a resume
        and a gate weigh; the engine's transition events report it)."""
        rates = self._rates([self.acceptance(r) for r in request_ids], num_plain_rows)
        return max(rates[1:]) / rates[0] if len(rates) > 1 else 0.0

    def _depth_for(self, acceptances: list[float], num_plain_rows: int) -> int:
        """The round's depth for rows of these acceptances beside num_plain_rows plain rows."""
        rates = self._rates(acceptances, num_plain_rows)
        if len(rates) < 2:
            return 0
        best = max(range(1, self.k_max + 1), key=lambda k: (rates[k], -k))
        margin = DRAFT_GAIN_MARGIN if len(acceptances) + num_plain_rows > 1 else 0.0
        return best if rates[best] > (1 + margin) * rates[0] else 0

    def _rates(self, acceptances: list[float], num_plain_rows: int) -> list[float]:
        """Expected tokens per unit of round cost at each depth 0..k_max; none without
        speculating rows or drafts."""
        if not acceptances or not self.k_max:
            return []
        width, rows = len(acceptances) + num_plain_rows, self._expected_tokens_by_depth(acceptances)
        # A share q of rounds drafts (evidence classes): the rest verify only the pending tokens,
        # or with bare rounds run mostly as pipelined plain rounds.
        q, num_spec = self._drafting_share, len(acceptances)
        idle_s = self._round_cost(width, 0) if self.has_bare_rounds else self._spec_round_cost(width, 0)
        rates = [(num_spec + num_plain_rows) / self._round_cost(width, 0)]
        rates += [(q * sum(row[k] for row in rows) + (1 - q) * num_spec + num_plain_rows)
                  / (q * self._round_cost(width, k) + (1 - q) * idle_s)
                  for k in range(1, self.k_max + 1)]
        return rates

    def _expected_tokens_by_depth(self, acceptances: list[float]) -> list[list[float]]:
        """Per row, E(0..k_max). Asked every gated round: running sums (the very additions
        expected_tokens makes), not E(k) afresh for every k and every comparison."""
        return [list(itertools.accumulate((a**j for j in range(self.k_max + 1)), initial=0))[1:]
                for a in acceptances]

    def _round_cost(self, width: int, depth: int) -> float:
        if self.table is not None:
            return self.table.round_s(width, depth)
        return 1.0 + depth * self.costs.per_depth

    def _spec_round_cost(self, width: int, depth: int) -> float:
        """A speculative round's cost, depth 0 included (the defaults price it as a plain round)."""
        if self.table is not None:
            return self.table.spec_round_s(width, depth)
        return self._round_cost(width, depth)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int, evidence_class: int | None = None) -> None:
        """After a verify round; num_drafted = 0 for a row that decoded plain in it; the row's
        evidence class that round, where its drafter grades drafts."""
        assert 0 <= num_accepted <= num_drafted, (num_accepted, num_drafted)
        expected = self._expected.pop(request_id, None)
        if expected is not None and num_drafted:
            entry = self._ledger.setdefault(expected[0], _LedgerEntry())
            entry.num_row_rounds += 1
            entry.num_expected += expected[1]
            entry.num_kept += num_accepted
        num_tried = num_accepted + (num_accepted < num_drafted)
        if evidence_class is not None:
            if not num_tried:
                return  # its evidence asked for no drafts: the row's estimate is not due a probe
            pooled = self._classes.setdefault(evidence_class, _ClassEstimate())
            pooled.num_accepted = pooled.num_accepted * _CLASS_DECAY + num_accepted
            pooled.num_tried = pooled.num_tried * _CLASS_DECAY + num_tried
        row = self._current(request_id)
        row.num_accepted = row.num_accepted * _DECAY + num_accepted
        row.num_tried = row.num_tried * _DECAY + num_tried
        row.num_tried_ever += num_tried
        self._num_accepted += num_accepted
        self._num_tried += num_tried

    def rest(self, scored_id: str | None = None) -> None:
        """After a plain round of a gated batch: every row's evidence fades slowly toward the
        prior, but the scored row's (observed for this round instead, when not None)."""
        scored = self._current(scored_id) if scored_id is not None else None  # earlier rests applied
        self._num_rests += 1
        if scored is not None:
            scored.num_rests_applied = self._num_rests  # this round's skipped

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
        self._expected.pop(request_id, None)

    def describe(self) -> dict:
        costs = {} if self.table is not None else {"verify_per_position": self.costs.verify_per_position,
                                                   "draft_per_token": self.costs.draft_per_token}
        classes = {str(c): round(self.class_acceptance(c), 4) for c in sorted(self._classes)}
        evidence = {"class_acceptance": classes, "drafting_share": round(self._drafting_share, 4)} if classes else {}
        # Per width group (rows from that width to the next group's): drafting row-rounds, the
        # drafts the model expected kept, and the drafts kept.
        ledger = {str(w): [e.num_row_rounds, round(e.num_expected, 1), e.num_kept]
                  for w, e in sorted(self._ledger.items())}
        return {"k_max": self.k_max, "prior_acceptance": round(self.prior_acceptance, 4), **costs, **evidence,
                **({"kept_vs_expected": ledger} if ledger else {})}
