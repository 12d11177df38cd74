"""Per-token log-probabilities, for the requests that ask (SamplingParams.logprobs = N, and
prompt_logprobs = N for the prompt's own tokens, scored as it is prefilled).

A token's logprob is the log-softmax of the target's raw logits at its position: the model's
own distribution, before temperature and the top-k / top-p / min-p filters (what vLLM reports
by default). N more are the position's N most likely tokens, most likely first.

Every site that samples the target's logits computes, for the rows that ask, each sampled
position's logprobs lazily beside its tokens (`keep`), evaluated with the round; delivery takes
the delivered positions' entries (`take_delivered`) and drops the rest. The logits at a position
are the same bits in every loop, width and transition (the engine's invariant), so the logprobs
are too.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from gmlx.platform import cpu_kernels


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One delivered token's logprob and its position's most likely tokens."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first; ties by id


class _RoundLogprobs:
    """One sampling site's logprobs for the rows that ask, evaluated with the round (never a
    sync of their own: one would wait behind the next forward, dispatched ahead)."""

    def __init__(self, chosen: mx.array, top_ids: mx.array | None, top_lps: mx.array | None):
        self._arrays = (chosen, top_ids, top_lps)
        self._host = None

    def entry(self, row: int, column: int, num_top: int) -> TokenLogprob:
        if self._host is None:
            self._host = tuple(None if a is None else a.tolist() for a in self._arrays)
        chosen, top_ids, top_lps = self._host
        if not num_top:
            return TokenLogprob(chosen[row][column], ())
        # The widest row's top set, in order (ties by id), cut to this row's count.
        top = sorted(zip(top_ids[row][column], top_lps[row][column]), key=lambda pair: (-pair[1], pair[0]))
        return TokenLogprob(chosen[row][column], tuple(top[:num_top]))


def keep(requests, logits: mx.array, tokens: mx.array, first_positions: list[int]) -> None:
    """For the rows whose request asks: the logprob of tokens[i, j], sampled (or accepted) from
    logits[i, j] at position first_positions[i] + j, and that position's likeliest, kept on
    the request until delivery; a later sample of the same position replaces it."""
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return
    index = mx.array(rows, dtype=mx.int32)
    num_top = max(requests[i].params.logprobs for i in rows)
    kept = _compute(logits[index], tokens[index], num_top)
    for r, i in enumerate(rows):
        by_position = requests[i].logprobs_by_position
        for j in range(logits.shape[1]):
            by_position[first_positions[i] + j] = (kept, r, j)


def keep_prompt(request, logits: mx.array, start: int) -> None:
    """The prompt's own logprobs (SamplingParams.prompt_logprobs) from a prefill chunk's logits
    (1, T, V) over prompt positions start..start+T-1: the next prompt token's logprob at each,
    kept under the next token's position (taken by take_prompt at the first delivery)."""
    num_positions = logits.shape[1]
    tokens = mx.array(request.prompt_token_ids[start + 1 : start + 1 + num_positions], dtype=mx.int32)[None]
    kept = _compute(logits, tokens, request.params.prompt_logprobs)
    for j in range(num_positions):
        request.logprobs_by_position[start + 1 + j] = (kept, 0, j)


def _compute(logits: mx.array, tokens: mx.array, num_top: int) -> _RoundLogprobs:
    """logits (R, T, V) at tokens (R, T), started now (async), read at delivery."""
    num_top = min(num_top, logits.shape[-1])
    chosen, top_ids, top_lps = (_kernel_logprobs if _has_kernel() else _mlx_logprobs)(
        logits, tokens.astype(mx.int32), num_top)
    mx.async_eval(*(a for a in (chosen, top_ids, top_lps) if a is not None))
    return _RoundLogprobs(chosen, top_ids, top_lps)


def _has_kernel() -> bool:
    """The CPU kernels' token_logprobs: ~0.1 ms a position where mlx's CPU ops took ~2 ms (a
    scalar exp per vocabulary entry, a partition over the whole row). Checked per call, so
    GMLX_CPU_KERNELS=0 turns it off at any time (each path is exact with itself, not with the other)."""
    return mx.default_device() == mx.cpu and cpu_kernels.has_token_logprobs()


def _kernel_logprobs(logits: mx.array, tokens: mx.array, num_top: int) -> tuple:
    num_rows, num_positions, vocab = logits.shape
    chosen, top_ids, top_lps = cpu_kernels.token_logprobs(logits.reshape(-1, vocab), tokens.reshape(-1),
                                                          max(num_top, 1))
    if not num_top:
        return chosen.reshape(num_rows, num_positions), None, None
    return (chosen.reshape(num_rows, num_positions), top_ids.reshape(num_rows, num_positions, num_top),
            top_lps.reshape(num_rows, num_positions, num_top))


def _mlx_logprobs(logits: mx.array, tokens: mx.array, num_top: int) -> tuple:
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]  # (R, T)
    if not num_top:
        return chosen, None, None
    top_ids = mx.argpartition(-logprobs, num_top - 1, axis=-1)[..., :num_top]  # (R, T, N), in no order
    return chosen, top_ids, mx.take_along_axis(logprobs, top_ids, axis=-1)


def take_delivered(request, new_token_ids: list[int]) -> tuple[TokenLogprob, ...]:
    """The entries of the tokens about to be appended to request's output, their kept records
    consumed; records of positions before the next one are dropped."""
    first = request.num_prompt_tokens + request.num_generated
    out = _take(request, range(first, first + len(new_token_ids)), request.params.logprobs)
    kept = request.logprobs_by_position
    for position in [p for p in kept if p < first + len(new_token_ids)]:
        del kept[position]
    return out


def take_prompt(request) -> tuple[TokenLogprob, ...]:
    """Prompt positions 1.. (position 0 has no logprob: nothing precedes it), kept by keep_prompt."""
    return _take(request, range(1, request.num_prompt_tokens), request.params.prompt_logprobs)


def _take(request, positions: range, num_top: int) -> tuple[TokenLogprob, ...]:
    kept = request.logprobs_by_position
    out = []
    for position in positions:
        record = kept.pop(position, None)
        assert record is not None, f"no logprobs kept for position {position} of {request.request_id}"
        round_logprobs, row, column = record
        out.append(round_logprobs.entry(row, column, num_top))
    return tuple(out)
