"""Per-token log-probabilities, for the requests that ask (SamplingParams.logprobs = N).

A token's logprob is the log-softmax of the target's raw logits at its position: the model's
own distribution, before temperature and the top-k / top-p / min-p filters (what vLLM reports
by default). N more are the position's N most likely tokens, most likely first.

Every site that samples the target's logits keeps, for each row that asks, the logits row of
each position it sampled (`keep`); delivery turns the rows of the delivered tokens into entries
(`entries`) and drops the rest. The logits at a position are the same bits in every loop, width
and transition (the engine's invariant), so the logprobs are too.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx



@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One delivered token's logprob and its position's most likely tokens."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first; ties by id


def keep(requests, logits: mx.array, first_positions: list[int]) -> None:
    """Keep logits[i, j] (lazy) as row i's logits at position first_positions[i] + j, for the
    rows whose request asks for logprobs; a later sample of the same position replaces it."""
    for i, request in enumerate(requests):
        if request.params.logprobs is None:
            continue
        for j in range(logits.shape[1]):
            request.logits_by_position[first_positions[i] + j] = logits[i, j]


def entries(logits_rows: list[mx.array], token_ids: list[int], num_top: int) -> tuple[TokenLogprob, ...]:
    """Each token's entry from the logits row (V,) it was sampled from."""
    if not token_ids:
        return ()
    logits = mx.stack(logits_rows).astype(mx.float32)  # (N, V)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(token_ids, dtype=mx.int32)[:, None], axis=-1)[:, 0]
    if num_top == 0:
        mx.eval(chosen)
        return tuple(TokenLogprob(lp, ()) for lp in chosen.tolist())
    num_top = min(num_top, logprobs.shape[-1])
    # The top set by partition; its order (and ties, by id) on the host, so it is deterministic.
    top_ids = mx.argpartition(-logprobs, num_top - 1, axis=-1)[:, :num_top]
    top_lps = mx.take_along_axis(logprobs, top_ids, axis=-1)
    mx.eval(chosen, top_ids, top_lps)
    out = []
    for lp, ids, lps in zip(chosen.tolist(), top_ids.tolist(), top_lps.tolist()):
        top = sorted(zip(ids, lps), key=lambda pair: (-pair[1], pair[0]))
        out.append(TokenLogprob(lp, tuple(top)))
    return tuple(out)


def take_delivered(request, new_token_ids: list[int]) -> tuple[TokenLogprob, ...]:
    """The entries of the tokens about to be appended to request's output, its kept rows of
    their positions consumed; rows of positions before the next one are dropped."""
    first = request.num_prompt_tokens + request.num_generated
    kept = request.logits_by_position
    rows = []
    for offset in range(len(new_token_ids)):
        row = kept.pop(first + offset, None)
        assert row is not None, f"no logits kept for position {first + offset} of {request.request_id}"
        rows.append(row)
    for position in [p for p in kept if p < first + len(new_token_ids)]:
        del kept[position]
    return entries(rows, new_token_ids, request.params.logprobs)
