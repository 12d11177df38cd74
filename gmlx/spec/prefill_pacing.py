"""How much prefill a step may carry beside running rows, and whether prompts ride the decode forward.

The yardstick is a recent plain round's time: a chunk packed into a round's forward (models/packed.py)
is measured by how much longer that round took, and budgeted as a share of a round, so a long
prefill slows the rows decoding beside it by a bounded factor.
"""

from __future__ import annotations

# Packing a chunk saves a pass over the weights and adds ~20 small ops a layer: below this the
# ops cost more (built-in model, 17 MB: 4.5 ms packed against 4.1 ms apart; SmolLM2 at 4 bits,
# 100 MB: 55 against 70 ms). Fused layers (platform/cpu_layers.py) run a packed round's segments
# in the stack's one node instead, which pays at any size: the built-in model served, 2-32
# clients, packing on 1.04-1.16x of off (BENCHMARKS session 44).
PACKING_MIN_WEIGHT_BYTES = 64 << 20
# One round in this many carries no chunk, so the yardstick follows the machine's load during a
# long prefill.
PACKED_ROUNDS_PER_PLAIN = 8
PACKED_BUDGET_ROUNDS = 0.5  # the auto prefill budget of a packed chunk, in decode rounds
APART_BUDGET_ROUNDS = 2.0  # the auto budget of a chunk run in a forward of its own (reads every weight too)
ROUND_S_SMOOTHING = 0.2  # the weight of the newest plain round in the yardstick


def is_packing_chosen(is_packable: bool, num_weight_bytes: int, is_layer_fused: bool,
                      is_configured: bool | None) -> bool:
    """Whether prompt chunks ride decode forwards: the configured choice, else fused layers or
    enough weight bytes."""
    if is_configured is not None:
        return is_packable and is_configured
    return is_packable and (is_layer_fused or num_weight_bytes >= PACKING_MIN_WEIGHT_BYTES)


class PrefillPacer:
    def __init__(self, is_packed: bool, configured_budget_s: float | None):
        self.is_packed = is_packed
        self.configured_budget_s = configured_budget_s  # None: auto; 0: a whole chunk every drain
        self.round_s: float | None = None  # the yardstick: recent plain decode rounds, smoothed
        self.num_packed_rounds_in_a_row = 0

    def budget_s(self, is_decoding: bool) -> float | None:
        """Prefill time allowed this step: None (a whole chunk) when no row decodes."""
        if not is_decoding or self.configured_budget_s == 0:
            return None
        if self.configured_budget_s is not None:
            return self.configured_budget_s
        if self.round_s is None:
            return None
        # A packed chunk adds to one forward: half a round keeps its step near 1.5x a round, with
        # room for a chunk that overshoots (its cost per token grows with the prefix) and for jitter.
        return (PACKED_BUDGET_ROUNDS if self.is_packed else APART_BUDGET_ROUNDS) * self.round_s

    def is_paused(self, is_decoding: bool) -> bool:
        """One round in PACKED_ROUNDS_PER_PLAIN prefills nothing: it times a plain round."""
        return (self.is_packed and is_decoding and self.round_s is not None
                and self.num_packed_rounds_in_a_row >= PACKED_ROUNDS_PER_PLAIN)

    def ran(self, num_packed_tokens: int, elapsed_s: float) -> float | None:
        """A decode round ran, carrying num_packed_tokens prompt tokens; what they cost beyond a
        plain round (None where none rode it, or before a plain round was timed)."""
        self.num_packed_rounds_in_a_row = self.num_packed_rounds_in_a_row + 1 if num_packed_tokens else 0
        if not num_packed_tokens:
            self.round_s = elapsed_s if self.round_s is None else (
                (1 - ROUND_S_SMOOTHING) * self.round_s + ROUND_S_SMOOTHING * elapsed_s)
            return None
        return None if self.round_s is None else elapsed_s - self.round_s
