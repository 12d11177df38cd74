"""Stochastic acceptance (opt-in): standard speculative sampling instead of exact matching.

Draft j, sampled from the drafter's q, is accepted with probability min(1, p/q) under the
target's p; at the first rejection the row's next token is drawn from the residual
norm(max(p - q, 0)); after all of a row's own drafts are accepted it is the target's own
sample at the next position (the bonus). Each output token is then distributed as p, and
more drafts are accepted than by exact matching when p and q are close but not equal.
The uniform and residual noise are hashes of (seed, position) on their own streams, so a
seeded request still repeats itself. Greedy rows (p and q one-hot) reduce to exact matching.
"""

from __future__ import annotations

import mlx.core as mx

from gmlx.sampling import ACCEPT_STREAM, RESIDUAL_STREAM, RepeatCounts, SamplingRows, probabilities, uniform_noise


def stochastic_accept(logits: mx.array, targets: mx.array, drafts: mx.array, draft_probs: mx.array,
                      num_draft_by_row: list[int], sampling: SamplingRows,
                      positions: mx.array, repeats: RepeatCounts | None = None) -> tuple[mx.array, mx.array]:
    """(accepted drafts (B,), next token (B,)) for verify logits (B, k+1, V), the target's own
    samples (B, k+1), drafts (B, k) drawn from draft_probs (B, k, V), positions (B, k+1)."""
    num_rows, num_draft = drafts.shape
    probs = probabilities(logits, sampling, repeats, positions)  # (B, k+1, V): penalties, bias, min_tokens
    p_draft = mx.take_along_axis(probs[:, :num_draft], drafts[..., None], axis=-1)[..., 0]  # (B, k)
    q_draft = mx.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]  # (B, k)
    seeds = mx.broadcast_to(sampling.seeds[:, None], (num_rows, num_draft)).reshape(-1)
    uniform = uniform_noise(seeds, positions[:, :num_draft].reshape(-1), 1, ACCEPT_STREAM).reshape(num_rows, num_draft)
    limit = mx.array(num_draft_by_row, dtype=mx.int32)
    is_own = mx.arange(num_draft)[None, :] < limit[:, None]
    is_kept = (uniform * q_draft < p_draft) & is_own  # u < p/q, without dividing by q
    accepted = mx.cumprod(is_kept.astype(mx.int32), axis=1).sum(axis=1)  # (B,)
    rows = mx.arange(num_rows)
    q_next = mx.concatenate([draft_probs, mx.zeros_like(draft_probs[:, :1])], axis=1)[rows, accepted]  # (B, V)
    p_next = probs[rows, accepted]  # (B, V)
    residual = mx.maximum(p_next - q_next, 0.0)
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p_next)
    position = positions[rows, accepted]
    gumbel = -mx.log(-mx.log(uniform_noise(sampling.seeds, position, residual.shape[-1], RESIDUAL_STREAM)))
    resampled = mx.argmax(mx.log(residual) + gumbel, axis=-1).astype(mx.int32)
    next_token = mx.where(accepted < limit, resampled, targets[rows, accepted])
    return accepted, next_token
