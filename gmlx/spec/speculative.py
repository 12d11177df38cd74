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
from gmlx.models.packed import Segment, packed_body, unpack
from gmlx.platform.cpu_layers import segment_bodies
from gmlx.sampling import sample
from gmlx.spec.batch import DecodeBatch
from gmlx.spec.rejection import stochastic_accept


@dataclass(frozen=True, slots=True)
class VerifyResult:
    tokens_by_row: list[list[int]]  # accepted drafts then the bonus, per row
    num_accepted: list[int]  # drafts accepted per row
    num_drafted: list[int]  # drafts proposed per row (its own k; 0 for a row that decodes plain)
    chunk_hidden: tuple = ()  # (1, T, D) of each prompt chunk packed into the verify forward


def speculative_round(target: LoadedModel, batch: DecodeBatch, drafter, num_draft_by_row: list[int],
                      is_stochastic: bool = False, chunks: tuple[Segment, ...] = ()) -> VerifyResult:
    """Each row drafts its own k, all verify [pending, drafts] in one target forward, each keeps
    its matching prefix.

    Ragged k is padded: the drafter proposes max(k) for its rows and every row verifies max(k)+1
    positions, but row i accepts at most k_i drafts and its KV is trimmed back past them. The
    causal mask makes the padding invisible to the positions a row keeps, so exactness is that
    of the fixed-k round. A row with k = 0 decodes plain (its bonus is the target's next token).
    is_stochastic: accept by rejection sampling (rejection.py) with a drafter that has_distribution.
    chunks: prompt chunks packed into the verify forward (models/packed.py).

    A row whose pending token is a lookahead not yet delivered (after a bare round, engine.py)
    verifies it first, with drafts of what follows it guessed from the delivered history alone
    (a drafter that drafts_past_pending); the round emits it before the verified tokens.
    """
    assert batch.mode.is_armed
    assert batch.is_settled or (drafter.drafts_past_pending and not is_stochastic), "a lookahead needs history drafts"
    assert len(num_draft_by_row) == batch.num_rows
    num_draft = max(num_draft_by_row, default=0)
    view = batch.draft_view
    assert all(num_draft_by_row[i] == 0 for i in _opt_out_rows(batch)), "opt-out rows never draft"
    draft_probs = None
    if num_draft == 0:
        is_stochastic = False
        drafts = mx.zeros((batch.num_rows, 0), dtype=mx.int32)
    elif view is batch:
        drafts, draft_probs = _propose(drafter, batch, num_draft, is_stochastic)  # (B, k), (B, k, V)
    else:
        # Opt-out rows verify the padding only: their own pending token repeated.
        view_drafts, view_probs = _propose(drafter, view, num_draft, is_stochastic)
        drafts = mx.repeat(batch.pending[:, None], num_draft, axis=1)  # (B, k)
        drafts[view.index] = view_drafts
        if is_stochastic:
            draft_probs = mx.zeros((batch.num_rows, num_draft, view_probs.shape[-1]), dtype=view_probs.dtype)
            draft_probs[view.index] = view_probs
    lookahead = batch.pending  # the rows' pending tokens, some perhaps not yet delivered
    verify_in = mx.concatenate([lookahead[:, None], drafts], axis=1)  # (B, k+1)
    positions = batch.positions(num_draft + 1, first_offset=1)
    logprob_positions = batch.logprob_positions(1)
    hidden, logits, chunk_hidden = _forward(target, verify_in, batch.caches, chunks)  # (B, k+1, D), (B, k+1, V)
    repeats = batch.repeat_counts(verify_in)
    targets = sample(logits, batch.sampling, positions, repeats)  # (B, k+1)
    rows = mx.arange(batch.num_rows)
    if is_stochastic:
        accepted, batch.pending = stochastic_accept(logits, targets, drafts, draft_probs, num_draft_by_row,
                                                    batch.sampling, positions, repeats)
        # Accepted drafts need not be the target's own samples: emit the drafts, then the next token.
        emitted = mx.concatenate([drafts, batch.pending[:, None]], axis=1)  # (B, k+1)
        emitted = mx.where(mx.arange(num_draft + 1)[None, :] == accepted[:, None], batch.pending[:, None], emitted)
    else:
        is_own = mx.arange(num_draft)[None, :] < mx.array(num_draft_by_row, dtype=mx.int32)[:, None]  # (B, k)
        matches = ((drafts == targets[:, :num_draft]) & is_own).astype(mx.int32)
        accepted = mx.cumprod(matches, axis=1).sum(axis=1)  # (B,)
        batch.pending, emitted = targets[rows, accepted], targets
    batch.keep_logprobs(logits, emitted, logprob_positions)  # emitted[i, j]: row i's token at its j-th position
    mx.eval(emitted, accepted, batch.pending, *chunk_hidden)  # the chunks' hidden: outputs of their own when fused
    target_rows, num_accepted = emitted.tolist(), accepted.tolist()
    for cache in batch.caches:
        cache.trim_rows([num_draft - a for a in num_accepted])
    if view.num_rows:
        if view is not batch:
            hidden = hidden[view.index]
            num_view_accepted = [num_accepted[i] for i in view.rows]
        else:
            num_view_accepted = num_accepted
        drafter.on_verified(view, num_view_accepted, hidden if drafter.needs_hidden else None)
    looked_ahead = [] if batch.is_settled else [[] if d else [t] for d, t in zip(batch.is_delivered, lookahead.tolist())]
    batch.is_delivered = [True] * batch.num_rows
    tokens = [row[: a + 1] for row, a in zip(target_rows, num_accepted)]
    if looked_ahead:
        tokens = [ahead + row for ahead, row in zip(looked_ahead, tokens)]
    return VerifyResult(tokens, num_accepted, list(num_draft_by_row), chunk_hidden)


def _forward(target: LoadedModel, tokens: mx.array, caches, chunks: tuple[Segment, ...]):
    """hidden and logits of the batch's tokens; with chunks, their hidden too: packed into one
    forward, or where the target's layers are fused nodes, the fused layers' own way (one stack
    node for all segments, else each segment's forward; the packed body's ~20 unfused nodes a
    layer cost more than a pass over the weights; BENCHMARKS.md, sessions 30-31)."""
    if not chunks:
        return (*target.forward(tokens, caches), ())
    segments = [Segment(tokens, caches), *chunks]
    if target.is_layer_fused:
        hidden, *chunk_hidden = segment_bodies(target.body, segments)
        return hidden, target.head(hidden), tuple(chunk_hidden)
    hidden, *chunk_hidden = unpack(packed_body(target.body, segments), segments)
    return hidden, target.head(hidden), tuple(chunk_hidden)


def _propose(drafter, rows, num_draft: int, is_stochastic: bool):
    if is_stochastic:
        return drafter.propose_with_probs(rows, num_draft)
    return drafter.propose(rows, num_draft), None


def _opt_out_rows(batch: DecodeBatch) -> list[int]:
    return [i for i, r in enumerate(batch.requests) if not r.params.speculate]


def plain_round(target: LoadedModel, batch: DecodeBatch, dispatch_next: bool) -> list[list[int]]:
    """One plain decode round, pipelined: the next forward is dispatched before this one's read.

    With dispatch_next=False no lookahead is left in flight: the round reads the one the
    previous round dispatched (or, from a settled batch, one it dispatches itself), which
    leaves the batch settled.
    """
    return _plain_round(target, batch, dispatch_next, ())[0]


def packed_plain_round(target: LoadedModel, batch: DecodeBatch,
                       chunks: tuple[Segment, ...]) -> tuple[list[list[int]], tuple]:
    """A pipelined plain round whose dispatched forward also runs prompt chunks (one pass
    over the weights for all, models/packed.py). Returns the tokens read and each chunk's
    hidden states (1, T, D), lazy: they are computed with the lookahead."""
    return _plain_round(target, batch, True, chunks)


def _plain_round(target, batch, dispatch_next: bool, chunks: tuple[Segment, ...]):
    assert not chunks or dispatch_next
    if batch.is_settled:
        _dispatch_plain(target, batch)  # first lookahead: emitted by the read below
    undelivered = [not d for d in batch.is_delivered]
    lookahead = batch.pending
    chunk_hidden = _dispatch_plain(target, batch, chunks) if dispatch_next else ()
    values = lookahead.tolist() if any(undelivered) else []
    tokens = [[values[i]] if undelivered[i] else [] for i in range(batch.num_rows)]
    batch.is_delivered = [not dispatch_next] * batch.num_rows
    return tokens, chunk_hidden


def capture_round(target: LoadedModel, batch: DecodeBatch) -> tuple[list[list[int]], mx.array]:
    """A one-position verify of each row's pending token with the hidden state kept.

    Emits one token per row at plain-decode cost and returns the hidden (B, D) a drafter
    cold-starts from.
    """
    assert batch.is_settled
    positions = batch.positions(1, first_offset=1)
    logprob_positions = batch.logprob_positions(1)
    hidden, logits = target.forward(batch.pending[:, None], batch.caches)
    tokens = sample(logits, batch.sampling, positions, batch.repeat_counts(batch.pending[:, None]))[:, 0]
    batch.keep_logprobs(logits, tokens[:, None], logprob_positions)
    mx.eval(tokens, hidden)
    batch.pending = tokens
    return [[t] for t in tokens.tolist()], hidden[:, 0, :]


def _dispatch_plain(target: LoadedModel, batch: DecodeBatch, chunks: tuple[Segment, ...] = ()) -> tuple:
    """Dispatch the next forward (appends pending to the KV); with chunks, packed with them."""
    positions = batch.positions(1, first_offset=1)
    logprob_positions = batch.logprob_positions(1)
    _, logits, chunk_hidden = _forward(target, batch.pending[:, None], batch.caches, chunks)
    repeats = batch.repeat_counts(batch.pending[:, None])
    batch.pending = sample(logits, batch.sampling, positions, repeats)[:, 0]
    batch.keep_logprobs(logits, batch.pending[:, None], logprob_positions)
    mx.async_eval(batch.pending, *chunk_hidden)  # the chunks' hidden: outputs of their own when fused
    batch.is_delivered = [False] * batch.num_rows
    return chunk_hidden
