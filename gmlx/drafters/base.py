"""The drafter protocol: how the loops ask for drafts and tell a drafter what was kept."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import mlx.core as mx


DEFAULT_WIDTH_CAP = 2  # the measured knee on the built-in model (BENCHMARKS.md); calibration may replace it


class ModelDrafter:
    """What the drafters that run a model (an MTP head, a draft model) share: their draft
    distribution is known, so stochastic acceptance can use it (propose_with_probs)."""

    default_width_cap = DEFAULT_WIDTH_CAP
    has_distribution = True
    drafts_past_pending = False  # a model drafts from its state after the last verified token

    def would_have_drafted(self, request) -> bool | None:
        return None  # a draft would need a forward

    def weight_files(self) -> list[Path]:
        """The files its weights come from: a retrained head in the same folder re-calibrates."""
        folder = Path(self.path)
        return sorted(folder.glob("*.safetensors")) + [folder / "config.json"]


class Drafter(Protocol):
    kind: str
    num_draft_tokens: int  # default draft depth k
    default_width_cap: int  # speculate while at most this many rows decode (0 = uncapped)
    needs_hidden: bool  # wants the target's hidden state at each row's last verified position
    has_distribution: bool  # offers propose_with_probs (batch, k) -> (drafts (B, k), probs (B, k, V))
    # Drafts from the delivered history alone: past a pending lookahead not yet delivered, it
    # drafts what follows its guess of that token (the engine's bare rounds need this).
    drafts_past_pending: bool

    def reset(self) -> None:
        """Forget every row (gate, preempt). Must do no MLX work."""

    def add_rows(self, batch, rows: list[int], hidden: mx.array | None) -> None:
        """Rows `rows` of `batch` (appended last) join; hidden (len(rows), D) produced their pending token."""

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows, in this order."""

    def propose(self, batch, num_tokens: int) -> mx.array:
        """Drafts (B, num_tokens) for the positions after each row's pending token."""

    def on_verified(self, batch, num_accepted: list[int], hidden: mx.array | None) -> None:
        """After a verify round; hidden (B, k+1, D) is the verify forward's, before trimming."""

    def would_have_drafted(self, request) -> bool | None:
        """Whether this drafter's first draft before the request's last token was that token,
        from its history alone at no forward's cost; None when it cannot tell (a model drafter)."""
