"""Seeded per-position sampling.

Each sampled token is argmax(filtered logits / temperature + gumbel), where the Gumbel noise
is a hash of (request seed, absolute position, vocabulary index) and nothing else. So a
seeded request draws the same tokens in any batch, loop or transition, and a drafter that
samples with the same noise (coupled drafting) proposes exactly the token the target will
sample whenever their filtered distributions agree on the argmax.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

_GOLDEN = 0x9E3779B9


def _mix32(x: mx.array) -> mx.array:
    """murmur3's 32-bit finalizer: a bijective avalanche on uint32 lanes."""
    x = x ^ (x >> 16)
    x = x * mx.array(0x85EBCA6B, dtype=mx.uint32)
    x = x ^ (x >> 13)
    x = x * mx.array(0xC2B2AE35, dtype=mx.uint32)
    return x ^ (x >> 16)


def gumbel_noise(seeds: mx.array, positions: mx.array, vocab_size: int) -> mx.array:
    """Noise (N, V) for N (seed, position) pairs; seeds are uint64 split into two lanes."""
    return -mx.log(-mx.log(uniform_noise(seeds, positions, vocab_size)))


# Streams besides the Gumbel one, for stochastic acceptance: a stream is a position offset
# no real position reaches, so each (seed, position) still draws each stream's noise once.
ACCEPT_STREAM, RESIDUAL_STREAM = 1 << 30, 2 << 30


def uniform_noise(seeds: mx.array, positions: mx.array, vocab_size: int, stream: int = 0) -> mx.array:
    """Uniform noise in (0, 1), (N, V), a hash of (seed, position + stream, index) only."""
    positions = positions.astype(mx.uint32) + mx.array(stream, dtype=mx.uint32)
    seed_lo = (seeds & 0xFFFFFFFF).astype(mx.uint32)
    seed_hi = (seeds >> 32).astype(mx.uint32)
    golden = mx.array(_GOLDEN, dtype=mx.uint32)
    key = _mix32(_mix32(seed_lo + golden) ^ seed_hi)
    key = _mix32(key ^ (positions.astype(mx.uint32) * mx.array(0x27D4EB2F, dtype=mx.uint32)))
    vocab = mx.arange(vocab_size, dtype=mx.uint32) * golden
    bits = _mix32(key[:, None] + vocab[None, :])  # (N, V)
    return ((bits >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)


@dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters as device arrays, built once per batch layout."""

    temperature: mx.array  # (B,) float32; 0 = greedy
    top_p: mx.array  # (B,)
    top_k: mx.array  # (B,) int32; 0 = off
    min_p: mx.array  # (B,)
    seeds: mx.array  # (B,) uint64
    is_all_greedy: bool
    needs_sort: bool  # some row filters by top-p or top-k
    presence_penalty: mx.array | None = None  # (B,), where some row penalizes repeats; else None
    frequency_penalty: mx.array | None = None  # (B,)
    repetition_penalty: mx.array | None = None  # (B,); 1 where a row has none
    bias_ids: mx.array | None = None  # (B, 1, L) int32, where some row has a logit_bias; else None
    bias_values: mx.array | None = None  # (B, 1, L) float32: what bias() adds at bias_ids
    floor_ids: mx.array | None = None  # (B, 1, L) int32: end tokens held back (min_tokens); else None
    floor_until: mx.array | None = None  # (B, 1, 1) int32: the first position they may be sampled at

    @classmethod
    def make(cls, params_list, seeds: list[int], floors: list | None = None) -> SamplingRows:
        """floors: each row's Request.min_tokens_floor, where some row has one."""
        temps = [p.temperature for p in params_list]
        is_penalized = any(p.is_penalized for p in params_list)
        bias_ids, bias_values = _pad_biases([p.logit_bias for p in params_list])
        floor_ids, floor_until = _pad_floors(floors or [])
        return cls(
            temperature=mx.array(temps, dtype=mx.float32),
            top_p=mx.array([p.top_p for p in params_list], dtype=mx.float32),
            top_k=mx.array([p.top_k for p in params_list], dtype=mx.int32),
            min_p=mx.array([p.min_p for p in params_list], dtype=mx.float32),
            seeds=mx.array(seeds, dtype=mx.uint64),
            is_all_greedy=all(t == 0.0 for t in temps),
            needs_sort=any(p.temperature > 0 and (p.top_p < 1.0 or p.top_k > 0) for p in params_list),
            presence_penalty=mx.array([p.presence_penalty for p in params_list], dtype=mx.float32)
            if is_penalized else None,
            frequency_penalty=mx.array([p.frequency_penalty for p in params_list], dtype=mx.float32)
            if is_penalized else None,
            repetition_penalty=mx.array([p.repetition_penalty for p in params_list], dtype=mx.float32)
            if is_penalized else None,
            bias_ids=bias_ids,
            bias_values=bias_values,
            floor_ids=floor_ids,
            floor_until=floor_until,
        )

    @property
    def is_penalized(self) -> bool:
        return self.presence_penalty is not None

    def for_drafting(self) -> SamplingRows:
        """These rows for a drafter, without logit bias and min_tokens: its logits may cover another
        vocabulary (a draft model's, a head's draft ids), and the verify applies both to every
        token it keeps anyway."""
        if self.bias_ids is None and self.floor_ids is None:
            return self
        return dataclasses.replace(self, bias_ids=None, bias_values=None, floor_ids=None, floor_until=None)


def pad_with_first(rows: list, dtype) -> np.ndarray:
    """(B, L) of per-row sequences, each padded with a repeat of its first entry and a row of
    None or nothing with zeros: a sparse write then writes a padded entry's one value twice."""
    width = max([1, *(len(row) for row in rows if row is not None)])
    out = np.zeros((len(rows), width), dtype=dtype)
    for i, row in enumerate(rows):
        if row is not None and len(row):
            out[i] = row[0]
            out[i, : len(row)] = row
    return out


def _pad_biases(biases: list) -> tuple[mx.array | None, mx.array | None]:
    """Each row's logit_bias as ids and values (B, 1, L), padded with its first entry; a row
    without one adds 0.0 to id 0."""
    if not any(biases):
        return None, None
    ids = pad_with_first([None if b is None else [t for t, _ in b] for b in biases], np.int32)
    values = pad_with_first([None if b is None else [v for _, v in b] for b in biases], np.float32)
    return mx.array(ids)[:, None, :], mx.array(values)[:, None, :]


@dataclass(frozen=True)
class RepeatCounts:
    """penalize()'s input, sparse: per row and sampled position, the ids (B, T, L) that may have been
    generated before it and their counts (B, T, L). An id may appear more than once, always with
    the same count, so writing its penalized logit twice writes one value. The same holds for
    seen_ids (B, T, S) and is_seen (B, T, S): the tokens in the prompt or generated before each
    position, where some row has a repetition penalty (else None)."""

    ids: mx.array
    counts: mx.array
    seen_ids: mx.array | None = None
    is_seen: mx.array | None = None

    @classmethod
    def make(cls, history_ids: np.ndarray, history_counts: np.ndarray, is_real: np.ndarray,
             inputs: mx.array | None, seen_ids: np.ndarray | None = None) -> RepeatCounts:
        """From each row's generated tokens before the first position (history_ids / counts (B, H),
        padded with a repeat of a real entry, or id 0 with count 0 where a row has none; is_real
        (B, H) 1 for the entries that are not padding) and the inputs (B, T) the positions are
        sampled after: position j's history is the row's and inputs[:, :j + 1] (None: one
        position, the history alone). seen_ids (B, S): each row's distinct prompt and history
        ids, padded with a repeat of its first (where some row has a repetition penalty)."""
        ids, counts = mx.array(history_ids, dtype=mx.int32), mx.array(history_counts, dtype=mx.float32)
        if inputs is None:
            if seen_ids is None:
                return cls(ids[:, None, :], counts[:, None, :])
            seen = mx.array(seen_ids, dtype=mx.int32)[:, None, :]  # all seen: the history is all before
            return cls(ids[:, None, :], counts[:, None, :], seen, mx.ones(seen.shape, mx.bool_))
        num_positions = inputs.shape[1]
        inputs = inputs.astype(mx.int32)
        # Sums of 0/1 and integer counts: exact in float32, in any order.
        is_upto = (mx.arange(num_positions)[:, None] >= mx.arange(num_positions)[None, :]).astype(mx.float32)
        is_history = (inputs[:, :, None] == ids[:, None, :]).astype(mx.float32)  # (B, T, H)
        history_part = counts[:, None, :] + is_upto @ is_history  # (B, T, H)
        is_input = (inputs[:, :, None] == inputs[:, None, :]).astype(mx.float32)  # (B, T, T)
        real_counts = counts * mx.array(is_real, dtype=mx.float32)  # a padding repeat must not count twice
        input_base = (is_history * real_counts[:, None, :]).sum(axis=-1)  # (B, T): each input's count in the history
        input_part = input_base[:, None, :] + is_upto @ is_input  # (B, T, T)
        all_ids = mx.concatenate([mx.broadcast_to(ids[:, None, :], history_part.shape),
                                  mx.broadcast_to(inputs[:, None, :], input_part.shape)], axis=-1)
        if seen_ids is None:
            return cls(all_ids, mx.concatenate([history_part, input_part], axis=-1))
        # An input is seen at position j where the prompt or history holds it, or inputs[:, :j + 1] do.
        seen = mx.array(seen_ids, dtype=mx.int32)  # (B, S)
        is_in_seen = (inputs[:, :, None] == seen[:, None, :]).any(axis=-1)  # (B, T)
        is_input_seen = is_in_seen[:, None, :] | (input_part > input_base[:, None, :])  # (B, T, T)
        seen_all = mx.concatenate([mx.broadcast_to(seen[:, None, :], (*inputs.shape, seen.shape[-1])),
                                   mx.broadcast_to(inputs[:, None, :], is_input_seen.shape)], axis=-1)
        is_seen = mx.concatenate([mx.ones((*inputs.shape, seen.shape[-1]), mx.bool_), is_input_seen], axis=-1)
        return cls(all_ids, mx.concatenate([history_part, input_part], axis=-1), seen_all, is_seen)


def _pad_floors(floors: list) -> tuple[mx.array | None, mx.array | None]:
    """Each row's min_tokens floor as ids (B, 1, L), padded with its first, and the position
    (B, 1, 1) from which they may be sampled (0 for a row without one: never held back)."""
    if not any(floors):
        return None, None
    ids = pad_with_first([None if f is None else f[0] for f in floors], np.int32)
    until = np.array([0 if f is None else f[1] for f in floors], dtype=np.int32)
    return mx.array(ids)[:, None, :], mx.array(until)[:, None, None]


def bias(logits: mx.array, rows: SamplingRows) -> mx.array:
    """OpenAI's logit_bias: each row's values added to its tokens' logits at every position (no
    bias: as is). Position-independent, so every loop adds the same values to the same logits."""
    if rows.bias_ids is None:
        return logits
    logits = logits.astype(mx.float32)
    shape = (*logits.shape[:2], rows.bias_ids.shape[-1])
    ids = mx.broadcast_to(rows.bias_ids, shape)
    values = mx.take_along_axis(logits, ids, axis=-1) + rows.bias_values
    return mx.put_along_axis(logits, ids, values, axis=-1)


def hold_back(logits: mx.array, rows: SamplingRows, positions: mx.array | None) -> mx.array:
    """min_tokens: a row's end tokens at -inf at positions (B, T) before its floor. A function of
    the absolute position alone, so every loop holds back the same positions."""
    if rows.floor_ids is None:
        return logits
    assert positions is not None, "min_tokens needs the sampled positions"
    logits = logits.astype(mx.float32)
    ids = mx.broadcast_to(rows.floor_ids, (*logits.shape[:2], rows.floor_ids.shape[-1]))
    is_early = (positions[:, :, None] < rows.floor_until)  # (B, T, 1)
    values = mx.where(is_early, mx.array(-float("inf"), dtype=mx.float32), mx.take_along_axis(logits, ids, axis=-1))
    return mx.put_along_axis(logits, ids, values, axis=-1)


def adjust(logits: mx.array, rows: SamplingRows, repeats: RepeatCounts | None,
           positions: mx.array | None = None) -> mx.array:
    """The logits sampling draws from: the raw ones with each row's bias and repeat penalties,
    then its end tokens held back before min_tokens (last, so nothing lifts them again)."""
    return hold_back(penalize(bias(logits, rows), rows, repeats), rows, positions)


def penalize(logits: mx.array, rows: SamplingRows, repeats: RepeatCounts | None) -> mx.array:
    """OpenAI's repeat penalties: logits - frequency x count - presence x (count > 0), counts of
    each token among a row's generated tokens before each position (None: as is), after the
    repetition penalty where a row has one. Only the tokens counted change; each position's
    counts and seen flags are the same whatever loop samples it, so its bits are plain decoding's."""
    if repeats is None:
        return logits
    logits = logits.astype(mx.float32)
    if repeats.seen_ids is not None:  # transformers' repetition penalty first, as vLLM orders them
        penalty = rows.repetition_penalty[:, None, None]
        values = mx.take_along_axis(logits, repeats.seen_ids, axis=-1)
        repeated = mx.where(values > 0, values / penalty, values * penalty)
        logits = mx.put_along_axis(logits, repeats.seen_ids, mx.where(repeats.is_seen, repeated, values), axis=-1)
    frequency = rows.frequency_penalty[:, None, None]
    presence = rows.presence_penalty[:, None, None]
    values = mx.take_along_axis(logits, repeats.ids, axis=-1)
    counts = repeats.counts
    return mx.put_along_axis(logits, repeats.ids, values - frequency * counts - presence * (counts > 0), axis=-1)


def sample(logits: mx.array, rows: SamplingRows, positions: mx.array, repeats: RepeatCounts | None = None) -> mx.array:
    """Tokens (B, T) for logits (B, T, V); positions (B, T) are absolute token positions; repeats:
    where rows penalize repeats, penalize()'s (the drafters sample without them)."""
    logits = adjust(logits, rows, repeats, positions)
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    if rows.is_all_greedy:
        return greedy
    batch, num_pos, vocab = logits.shape
    temperature = mx.maximum(rows.temperature, 1e-6)[:, None, None]
    scaled = _filter(logits.astype(mx.float32) / temperature, rows)  # (B, T, V)
    seeds = mx.broadcast_to(rows.seeds[:, None], (batch, num_pos)).reshape(-1)
    noise = gumbel_noise(seeds, positions.reshape(-1), vocab).reshape(batch, num_pos, vocab)
    sampled = mx.argmax(scaled + noise, axis=-1).astype(mx.int32)
    return mx.where(rows.temperature[:, None] == 0.0, greedy, sampled)


def probabilities(logits: mx.array, rows: SamplingRows, repeats: RepeatCounts | None = None,
                  positions: mx.array | None = None) -> mx.array:
    """The distribution `sample` draws from, (B, T, V): softmax of the filtered, scaled logits;
    one-hot on the argmax for greedy rows."""
    logits = adjust(logits, rows, repeats, positions)
    greedy = mx.argmax(logits, axis=-1)  # (B, T)
    one_hot = (mx.arange(logits.shape[-1])[None, None, :] == greedy[..., None]).astype(mx.float32)
    if rows.is_all_greedy:
        return one_hot
    temperature = mx.maximum(rows.temperature, 1e-6)[:, None, None]
    probs = mx.softmax(_filter(logits.astype(mx.float32) / temperature, rows), axis=-1)
    return mx.where(rows.temperature[:, None, None] == 0.0, one_hot, probs)


def _filter(scaled: mx.array, rows: SamplingRows) -> mx.array:
    """Mask tokens outside top-k, top-p and min-p with -inf (scaled: (B, T, V))."""
    neg_inf = mx.array(-float("inf"), dtype=scaled.dtype)
    log_probs = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    min_p = rows.min_p[:, None, None]
    top_log_prob = mx.max(log_probs, axis=-1, keepdims=True)
    keep = (min_p <= 0) | (log_probs >= top_log_prob + mx.log(mx.maximum(min_p, 1e-30)))
    if rows.needs_sort:
        order = mx.argsort(-log_probs, axis=-1)  # descending
        sorted_lp = mx.take_along_axis(log_probs, order, axis=-1)
        rank = mx.arange(scaled.shape[-1])[None, None, :]
        top_k = rows.top_k[:, None, None]
        keep_sorted = (top_k <= 0) | (rank < top_k)
        # Keep a token while the mass before it is below top_p, so the top token always stays.
        mass_before = mx.cumsum(mx.exp(sorted_lp), axis=-1) - mx.exp(sorted_lp)
        keep_sorted = keep_sorted & (mass_before < rows.top_p[:, None, None])
        inverse = mx.argsort(order, axis=-1)
        keep = keep & mx.take_along_axis(keep_sorted, inverse, axis=-1)
    return mx.where(keep, scaled, neg_inf)
