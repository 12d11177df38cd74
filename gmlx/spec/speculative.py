"""The decode rounds: speculative verify (scalar and batch loop), plain, settle and capture.

Each round returns the tokens every row emits, in order. One host sync per round.
A speculative round with one row is the scalar loop; the loops differ in their admission
boundary (see admission.py), not in the arithmetic, so greedy and seeded output is the
same token stream whichever loop, width or transition a request goes through.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from gmlx.models.loader import LoadedModel
from gmlx.sampling import sample
from gmlx.spec.batch import DecodeBatch


@dataclass(frozen=True, slots=True)
class VerifyResult:
    tokens_by_row: list[list[int]]  # accepted drafts then the bonus, per row
    num_accepted: list[int]  # drafts accepted per row
    num_drafted: int  # drafts proposed per row


def speculative_round(target: LoadedModel, batch: DecodeBatch, drafter, num_draft: int) -> VerifyResult:
    """Draft k, verify [pending, drafts] in one target forward, keep the matching prefix."""
    assert batch.is_settled and batch.mode.is_armed
    drafts = drafter.propose(batch, num_draft)  # (B, k)
    verify_in = mx.concatenate([batch.pending[:, None], drafts], axis=1)  # (B, k+1)
    positions = batch.positions(num_draft + 1, first_offset=1)
    hidden, logits = target.forward(verify_in, batch.caches)  # (B, k+1, D), (B, k+1, V)
    targets = sample(logits, batch.sampling, positions)  # (B, k+1)
    matches = (drafts == targets[:, :num_draft]).astype(mx.int32)
    accepted = mx.cumprod(matches, axis=1).sum(axis=1)  # (B,)
    mx.eval(targets, accepted)
    target_rows, num_accepted = targets.tolist(), accepted.tolist()
    for cache in batch.caches:
        cache.trim_rows([num_draft - a for a in num_accepted])
    rows = mx.arange(batch.num_rows)
    batch.pending = targets[rows, accepted]
    drafter.on_verified(batch, num_accepted, hidden if drafter.needs_hidden else None)
    tokens = [row[: a + 1] for row, a in zip(target_rows, num_accepted)]
    return VerifyResult(tokens, num_accepted, num_draft)


def plain_round(target: LoadedModel, batch: DecodeBatch, dispatch_next: bool) -> list[list[int]]:
    """One plain decode round, pipelined: the next forward is dispatched before this one's read.

    With dispatch_next=False no lookahead is left in flight: the round reads the one the
    previous round dispatched (or, from a settled batch, one it dispatches itself), which
    leaves the batch settled.
    """
    if batch.is_settled:
        _dispatch_plain(target, batch)  # first lookahead: emitted by the read below
    undelivered = [not d for d in batch.is_delivered]
    lookahead = batch.pending
    if dispatch_next:
        _dispatch_plain(target, batch)
    values = lookahead.tolist() if any(undelivered) else []
    tokens = [[values[i]] if undelivered[i] else [] for i in range(batch.num_rows)]
    batch.is_delivered = [not dispatch_next] * batch.num_rows
    return tokens


def capture_round(target: LoadedModel, batch: DecodeBatch) -> tuple[list[list[int]], mx.array]:
    """A one-position verify of each row's pending token with the hidden state kept.

    Emits one token per row at plain-decode cost and returns the hidden (B, D) a drafter
    cold-starts from.
    """
    assert batch.is_settled
    positions = batch.positions(1, first_offset=1)
    hidden, logits = target.forward(batch.pending[:, None], batch.caches)
    tokens = sample(logits, batch.sampling, positions)[:, 0]
    mx.eval(tokens, hidden)
    batch.pending = tokens
    return [[t] for t in tokens.tolist()], hidden[:, 0, :]


def _dispatch_plain(target: LoadedModel, batch: DecodeBatch) -> None:
    positions = batch.positions(1, first_offset=1)
    _, logits = target.forward(batch.pending[:, None], batch.caches)  # appends pending to the KV
    batch.pending = sample(logits, batch.sampling, positions)[:, 0]
    mx.async_eval(batch.pending)
    batch.is_delivered = [False] * batch.num_rows
