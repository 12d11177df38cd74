"""Per-row draft depth from live acceptance: each round every speculating row drafts the k in
0..k_max that maximizes its expected tokens per unit of round cost.

Model: a row accepts each draft independently with probability a, so a round of depth k emits
E(k) = 1 + a + ... + a^k tokens; it costs 1 + k * (verify_per_position + draft_per_token) in
units of a one-position target forward. k = 0 is plain decoding (E = 1 at cost 1), so a row
whose drafts do not pay stops drafting. The costs come from the start-up calibration
(gmlx/spec/calibration.py) or from DraftCosts' defaults.

The acceptance a is per request, smoothed: decayed counts of accepted and tried drafts plus a
prior, which is the drafter's acceptance over every row so far. A row at k = 0 tries nothing,
so its counts decay toward the prior and it probes again after a while. A new row drafts at
least one token a round until it has tried MIN_TRIES_TO_STOP drafts, whatever the prior says.
When every row of a batch is at k = 0 the engine gates it to pipelined plain rounds; it
re-arms when one row's estimate asks for drafts again (pays_to_draft; a gated n-gram row
keeps score from its history, other rows rest toward the prior).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.6  # before any row has drafted: a typical first-draft agreement
_PRIOR_WEIGHT = 2.0  # the prior counts as this many tried drafts
_DECAY = 0.8  # per round: about the last five rounds carry a row's estimate
# Per plain round of a batch gated because no row's drafts pay: a resume costs two unpipelined
# rounds, so a resting row's estimate returns to the prior over ~20 rounds, not ~5.
_RESTING_DECAY = 0.95
# A row drafts until it has tried this many drafts: n-gram drafts hit in runs, and one
# rejected first draft stopped rows that accept a third of their drafts over a request.
MIN_TRIES_TO_STOP = 3


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


def best_depth(acceptance: float, k_max: int, costs: DraftCosts) -> int:
    """The depth in 0..k_max with the most expected tokens per unit of cost (ties: the shallower)."""
    rates = [expected_tokens(acceptance, k) / (1.0 + k * costs.per_depth) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (rates[k], -k))


@dataclass(slots=True)
class _RowEstimate:
    num_accepted: float = 0.0  # decayed
    num_tried: float = 0.0  # decayed; a draft counts as tried when the ones before it were accepted
    num_tried_ever: int = 0  # not decayed: the evidence the row's own estimate rests on


@dataclass
class DepthPolicy:
    k_max: int
    costs: DraftCosts = field(default_factory=DraftCosts)
    table: object = None  # a calibration.CostTable: measured costs per width replace `costs`
    _rows: dict[str, _RowEstimate] = field(default_factory=dict)
    _num_accepted: int = 0  # over every row: the prior of a new row
    _num_tried: int = 0

    def __post_init__(self):
        assert self.k_max >= 0, self.k_max

    @property
    def prior_acceptance(self) -> float:
        return (self._num_accepted + PRIOR_ACCEPTANCE * _PRIOR_WEIGHT) / (self._num_tried + _PRIOR_WEIGHT)

    def acceptance(self, request_id: str) -> float:
        row = self._rows.get(request_id) or _RowEstimate()
        return (row.num_accepted + self.prior_acceptance * _PRIOR_WEIGHT) / (row.num_tried + _PRIOR_WEIGHT)

    def depth(self, request_id: str, width: int = 1) -> int:
        """This round's k for the row, in a batch of `width` speculating rows."""
        k = self._best_depth(request_id, width)
        # A row's first rounds draft at least once, so its acceptance is measured, not assumed.
        row = self._rows.get(request_id)
        return max(k, 1) if (row is None or row.num_tried_ever < MIN_TRIES_TO_STOP) and self.k_max else k

    def pays_to_draft(self, request_id: str, width: int = 1) -> bool:
        """Whether the row's estimate alone asks for drafts (no first-round probe): what
        re-arms a batch gated because none of its rows' drafts paid."""
        return self._best_depth(request_id, width) > 0

    def _best_depth(self, request_id: str, width: int) -> int:
        acceptance = self.acceptance(request_id)
        if self.table is not None:
            return self.table.best_depth(width, acceptance, self.k_max)
        return best_depth(acceptance, self.k_max, self.costs)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """After a verify round; num_drafted = 0 for a row that decoded plain in it."""
        assert 0 <= num_accepted <= num_drafted, (num_accepted, num_drafted)
        num_tried = num_accepted + (num_accepted < num_drafted)
        row = self._rows.setdefault(request_id, _RowEstimate())
        row.num_accepted = row.num_accepted * _DECAY + num_accepted
        row.num_tried = row.num_tried * _DECAY + num_tried
        row.num_tried_ever += num_tried
        self._num_accepted += num_accepted
        self._num_tried += num_tried

    def rest(self, request_id: str) -> None:
        """After a plain round of a gated batch: the row's evidence fades slowly toward the prior."""
        row = self._rows.setdefault(request_id, _RowEstimate())
        row.num_accepted *= _RESTING_DECAY
        row.num_tried *= _RESTING_DECAY

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def describe(self) -> dict:
        costs = {} if self.table is not None else {"verify_per_position": self.costs.verify_per_position,
                                                   "draft_per_token": self.costs.draft_per_token}
        return {"k_max": self.k_max, "prior_acceptance": round(self.prior_acceptance, 4), **costs}
