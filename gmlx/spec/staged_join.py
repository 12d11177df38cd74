"""A long prompt joins a running batch over a few steps, so no single step pays its whole KV copy.

A join merges the joining row's KV into the batch's buffers, one array per layer. For a long row
that copy costs rounds (a 1,500-token SmolLM2 row, 69 MB into 165 MB of buffers, took ~2.5 rounds
on the 2-core box), so the row is copied into buffers with room for the batch's rows first, a
share of the layers a step; at the join only the batch's own short rows move.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from gmlx.spec.admission import Prefilled

STAGED_JOIN_MIN_BYTES = 16 << 20  # a joining row with this much KV is staged
JOIN_STAGES = 3  # steps that stage all of a row's layers


@dataclass
class _Staging:
    item: Prefilled
    num_rows: int  # the batch's rows the staged buffers leave room for
    width: int
    caches: list  # per layer: RaggedKVCache.with_leading_rows, or None until staged


class JoinStager:
    def __init__(self):
        self._staging: _Staging | None = None

    def drop(self) -> None:
        """The staged row left (aborted, evicted): what was copied is dropped."""
        self._staging = None

    def advance(self, ready: list[Prefilled], batch) -> bool:
        """True while the one prompt ready to join has layers left to stage (this step staged
        some); False when it joins now, staged or not."""
        item = ready[0]
        if batch is None or len(ready) != 1 or sum(c.nbytes for c in item.caches) < STAGED_JOIN_MIN_BYTES:
            self._staging = None
            return False
        staging = self._staging
        if staging is None or staging.item is not item or staging.num_rows != batch.num_rows:
            width = max(item.caches[0].buffer_tokens, batch.caches[0].buffer_tokens)
            staging = self._staging = _Staging(item, batch.num_rows, width, [None] * len(item.caches))
        todo = [i for i, c in enumerate(staging.caches) if c is None]
        if not todo:
            return False
        staged = todo[: -(-len(staging.caches) // JOIN_STAGES)]
        for i in staged:
            staging.caches[i] = item.caches[i].with_leading_rows(staging.num_rows, staging.width)
        mx.eval([(staging.caches[i].keys, staging.caches[i].values) for i in staged])  # the copy lands in this step
        return True

    def take(self, batch) -> list | None:
        """The staged buffers when they still fit the batch (else the join merges as usual)."""
        staging, self._staging = self._staging, None
        if staging is None or staging.num_rows != batch.num_rows:
            return None
        fits = all(c.can_fill_leading_rows(own) for c, own in zip(staging.caches, batch.caches, strict=True))
        return staging.caches if fits else None
