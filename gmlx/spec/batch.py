"""The decode batch: rows, their ragged target KV, and each row's pending token.

Every row has one pending token: the next input of the target, never in the KV. It is
either delivered (a bonus token the client has) or not yet delivered (a plain round's
lookahead, sampled by a forward dispatched ahead). At a settled round boundary every
pending token is delivered, so the KV holds every delivered token except the bonus.
"""

from __future__ import annotations

import enum

import mlx.core as mx
import numpy as np

from gmlx import logprobs
from gmlx.cache.ragged import RaggedKVCache, concat_layer_caches
from gmlx.request import Request, SamplingParams
from gmlx.sampling import RepeatCounts, SamplingRows, pad_with_first

_GREEDY = SamplingParams()


class BatchMode(enum.Enum):
    """What the drafter holds and which rounds the batch may run (the spec's state diagram).

    PLAIN    no drafter loaded: pipelined plain rounds, for good
    SCALAR   one request speculating alone; no admission boundary (a waiter preempts it)
    ARMED    the batch loop speculating: the drafter holds every speculating row
    UNARMED  preempted from SCALAR: the drafter was reset; a capture round arms it again
    GATED    over the cap, no row's drafts paying (or resume off): plain rounds, no drafter
             work; resume re-arms it
    RESUMING a gated batch that passed the resume check: its settle round runs, then a
             capture re-arms it (decided once, so a settle round is never paid for nothing)
    """

    PLAIN = "plain"
    SCALAR = "scalar"
    ARMED = "armed"
    UNARMED = "unarmed"
    GATED = "gated"
    RESUMING = "resuming"

    @property
    def is_armed(self) -> bool:
        return self in (BatchMode.SCALAR, BatchMode.ARMED)


class Loop(enum.Enum):
    """The kind of one round; `num_{value}_rounds` are public counters."""

    SCALAR = "scalar"  # a SCALAR batch's speculative round
    BATCH = "batch"  # an ARMED batch's speculative round
    GATED = "gated"  # plain, next forward dispatched ahead, no drafter work
    # An armed batch's round whose rows' evidence asked for no drafts: plain, next forward
    # dispatched ahead; the next speculative round verifies that lookahead first (no gate).
    BARE = "bare"
    SETTLE = "settle"  # plain, reads the lookahead without a successor (before a capture)
    CAPTURE = "capture"  # one-position verify keeping the hidden state the drafter cold-starts from
    PLAIN = "plain"  # no drafter loaded

    @property
    def is_speculative(self) -> bool:
        return self in (Loop.SCALAR, Loop.BATCH)


class DecodeBatch:
    def __init__(self, requests: list[Request], caches: list[RaggedKVCache], pending: mx.array,
                 mode: BatchMode, is_draft_coupled: bool = True):
        assert caches[0].num_rows == len(requests) == pending.shape[0]
        assert mode in (BatchMode.PLAIN, BatchMode.SCALAR, BatchMode.ARMED), "a batch forms plain or armed"
        assert mode is not BatchMode.SCALAR or len(requests) == 1
        self.requests = requests
        self.caches = caches  # one per target layer
        self.pending = pending  # (B,) int32
        self.is_delivered = [True] * len(requests)
        self.mode = mode
        self.is_draft_coupled = is_draft_coupled  # batch-loop drafts sample with the row's own noise
        self._refresh_sampling()

    @property
    def num_rows(self) -> int:
        return len(self.requests)

    @property
    def lengths(self) -> list[int]:
        """Tokens in each row's target KV."""
        return self.caches[0].lengths

    @property
    def is_settled(self) -> bool:
        return all(self.is_delivered)

    @property
    def has_boundary(self) -> bool:
        """Whether the injection drain runs before this batch's rounds (all but SCALAR)."""
        return self.mode is not BatchMode.SCALAR

    # --- the mode's verbs; the engine does the drafter's side of each ---------------------

    def preempt(self) -> None:
        """SCALAR -> UNARMED: the lone stream becomes a batch-loop row; its drafter state is dropped."""
        # The scalar round's verified tokens went out; what is pending is its delivered bonus,
        # or a bare round's lookahead, which the settle round before the capture reads.
        assert self.mode is BatchMode.SCALAR
        self.mode = BatchMode.UNARMED

    def gate(self) -> bool:
        """Over the cap, or no row's drafts pay -> GATED; True when this disarmed the drafter
        (its state must go). A lone SCALAR stream gated this way gains an admission boundary."""
        assert self.mode is not BatchMode.PLAIN
        was_armed = self.mode.is_armed
        self.mode = BatchMode.GATED
        return was_armed

    def arm(self) -> None:
        """UNARMED -> ARMED: a preempted batch's capture round cold-started the drafter."""
        assert self.mode is BatchMode.UNARMED and self.is_settled
        self.mode = BatchMode.ARMED

    def begin_resume(self) -> None:
        """GATED -> RESUMING: back within the cap with budget left; settle, then capture."""
        assert self.mode is BatchMode.GATED
        self.mode = BatchMode.RESUMING

    def resume(self) -> None:
        """GATED or RESUMING -> ARMED: the capture round cold-started the drafter."""
        assert self.mode in (BatchMode.GATED, BatchMode.RESUMING) and self.is_settled
        self.mode = BatchMode.ARMED

    def positions(self, num_tokens: int, first_offset: int = 0) -> mx.array:
        """Absolute positions (B, T) starting at each row's KV length + first_offset."""
        lengths = mx.array(self.lengths, dtype=mx.int32)
        return lengths[:, None] + first_offset + mx.arange(num_tokens, dtype=mx.int32)[None, :]

    def logprob_positions(self, first_offset: int) -> list[int] | None:
        """Each row's first sampled position (host), where some row asks for logprobs; taken
        before the forward that appends to the KV, for keep_logprobs after it."""
        if not self.has_logprob_rows:
            return None
        return [n + first_offset for n in self.lengths]

    def keep_logprobs(self, logits: mx.array, tokens: mx.array, first_positions: list[int] | None) -> None:
        """logprobs.keep for the tokens (B, T) sampled from logits (B, T, V), where a row asks."""
        if first_positions is not None:
            logprobs.keep(self.requests, logits, tokens, first_positions)

    def repeat_counts(self, inputs: mx.array) -> RepeatCounts | None:
        """Where some row penalizes repeats (sampling.penalize): the counts of its generated tokens
        before each position sampled from inputs (B, T), the pending token then the drafts: its
        delivered tokens (less the pending one where it is delivered, the last of them) and
        inputs[:, :j + 1]. None where no row penalizes."""
        if not self.sampling.is_penalized:
            return None
        return repeat_counts(self.requests, self.is_delivered, inputs)

    def keep_rows(self, rows: list[int]) -> None:
        if rows == list(range(self.num_rows)):
            return
        for cache in self.caches:
            cache.select_rows(rows)
        self.requests = [self.requests[i] for i in rows]
        self.is_delivered = [self.is_delivered[i] for i in rows]
        self.pending = self.pending[mx.array(rows, dtype=mx.int32)] if rows else self.pending[:0]
        self._refresh_sampling()

    def append_rows(self, requests: list[Request], caches: list[RaggedKVCache], pending: mx.array,
                    is_staged: bool = False) -> None:
        """Add rows whose pending token is delivered (freshly prefilled requests). is_staged:
        `caches` already hold the batch's rows' room first (RaggedKVCache.with_leading_rows)."""
        if is_staged:
            for staged, own in zip(caches, self.caches, strict=True):
                staged.fill_leading_rows(own)
            self.caches = caches
        else:
            self.caches = concat_layer_caches([self.caches, caches])
        self.requests = self.requests + requests
        self.is_delivered = self.is_delivered + [True] * len(requests)
        self.pending = mx.concatenate([self.pending, pending])
        self._refresh_sampling()

    @property
    def draft_sampling(self) -> SamplingRows:
        """How drafters sample: coupled to each row's noise (without its logit bias and min_tokens),
        or greedy (the spec's batch loop)."""
        is_coupled = self.mode is BatchMode.SCALAR or self.is_draft_coupled
        return self._coupled_sampling if is_coupled else self._greedy_sampling

    @property
    def draft_requests(self) -> list[Request]:
        return [self.requests[i] for i in self.draft_rows]

    @property
    def num_draft_rows(self) -> int:
        """Rows that speculate: the width the cap is checked against (opt-out rows never count)."""
        return len(self.draft_rows)

    @property
    def draft_view(self) -> DecodeBatch | DraftRows:
        """What the drafter sees: the speculating rows only (the batch itself when all speculate)."""
        return self if self._draft_view is None else self._draft_view

    def _refresh_sampling(self) -> None:
        seeds = [r.seed for r in self.requests]
        self.sampling = SamplingRows.make([r.params for r in self.requests], seeds,
                                          [r.min_tokens_floor for r in self.requests])
        self._coupled_sampling = self.sampling.for_drafting()
        self._greedy_sampling = SamplingRows.make([_GREEDY] * len(seeds), seeds)
        self.draft_rows = [i for i, r in enumerate(self.requests) if r.params.speculate]
        self.has_logprob_rows = any(r.params.logprobs is not None for r in self.requests)
        is_all = len(self.draft_rows) == len(self.requests)
        self._draft_view = None if is_all else DraftRows(self, self.draft_rows)


class DraftRows:
    """The speculating rows of a batch, shaped like a batch for the drafters (row j = batch
    row rows[j]); opt-out rows (SamplingParams.speculate=False) are never shown to a drafter."""

    def __init__(self, batch: DecodeBatch, rows: list[int]):
        self.batch = batch
        self.rows = rows
        self.index = mx.array(rows, dtype=mx.int32)
        self.requests = [batch.requests[i] for i in rows]
        seeds = [r.seed for r in self.requests]
        self._sampling = SamplingRows.make([r.params for r in self.requests], seeds).for_drafting()
        self._greedy_sampling = SamplingRows.make([_GREEDY] * len(seeds), seeds)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def pending(self) -> mx.array:
        return self.batch.pending[self.index]  # (Bd,)

    @property
    def is_delivered(self) -> list[bool]:
        is_delivered = self.batch.is_delivered
        return [is_delivered[i] for i in self.rows]

    @property
    def lengths(self) -> list[int]:
        lengths = self.batch.lengths
        return [lengths[i] for i in self.rows]

    def positions(self, num_tokens: int, first_offset: int = 0) -> mx.array:
        return self.batch.positions(num_tokens, first_offset)[self.index]  # (Bd, T)

    @property
    def draft_sampling(self) -> SamplingRows:
        is_coupled = self.batch.mode is BatchMode.SCALAR or self.batch.is_draft_coupled
        return self._sampling if is_coupled else self._greedy_sampling


def repeat_counts(requests: list[Request], is_delivered: list[bool], inputs: mx.array | None) -> RepeatCounts:
    """sampling.penalize's input for these rows (is_delivered: whether each row's last generated
    token is a pending one counted again among the inputs; inputs None: one position after the
    history alone, as a prefill's first token)."""
    histories = [generated_history(r, is_pending) if r.params.is_penalized else None
                 for r, is_pending in zip(requests, is_delivered)]
    return RepeatCounts.make(*pad_histories(histories), inputs, seen_tokens(requests, histories))


def generated_history(request: Request, is_pending_delivered: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(ids, counts) of the distinct tokens among the request's generated ones, less its last one
    where that is a batch's delivered pending token (counted again as the next forward's input)."""
    ids = request.output_token_ids[:-1] if is_pending_delivered else request.output_token_ids
    return np.unique(np.asarray(ids, dtype=np.int32), return_counts=True)


def seen_tokens(requests: list[Request], histories: list) -> np.ndarray | None:
    """(B, S): each row's distinct prompt and history ids where some row has a repetition
    penalty, padded with a repeat of its first (id 0 for a row without one: a penalty of 1
    leaves every logit as it is). None where no row has one."""
    if all(r.params.repetition_penalty == 1.0 for r in requests):
        return None
    rows = []
    for request, history in zip(requests, histories):
        if request.params.repetition_penalty == 1.0:
            rows.append(None)
            continue
        if request.distinct_prompt_ids is None:
            request.distinct_prompt_ids = np.unique(np.asarray(request.prompt_token_ids, dtype=np.int32))
        rows.append(np.union1d(request.distinct_prompt_ids, history[0]))
    return pad_with_first(rows, np.int32)


def pad_histories(histories: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B, H) ids, counts and is-real flags of each row's history (None: a row that does not
    penalize), padded with a repeat of its first entry (the same id and count: its penalized
    logit is written twice with one value), or id 0 counted 0 where it has none."""
    ids = pad_with_first([None if h is None else h[0] for h in histories], np.int32)
    counts = pad_with_first([None if h is None else h[1] for h in histories], np.float32)
    lengths = np.array([0 if h is None else len(h[0]) for h in histories])
    is_real = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.float32)
    return ids, counts, is_real
