"""Round costs as served: the start-up table (calibration.py) corrected by the rounds the engine
actually runs, per kind (plain, speculative) and width.

The table times rounds in-process on a quiet machine. Served, the worker shares the cores with
its front-end and clients and publishes between rounds; a plain round hides that behind its
dispatched-ahead forward, a speculative round does not. So each kind keeps a smoothed ratio of
served to table cost, measured from one round's start to the next step's start (the publishing
and the worker's drain included, the next step's admission work not), and depths and the width
cap weigh a speculative round by the ratio of the two ratios.

A width that has served plain rounds but no speculative ones (a gated width) prices its drafts
by the nearest width that served both kinds, or, before any did, at its table cost plus what a
plain round at that width costs served beyond the table: publishing and the worker's drain are
paid once a round by either kind. With the table alone a gated batch never learned otherwise
(a lone built-in stream's table put a 4-draft round at 3.6x a plain one, served plain rounds
took 2.3x the table, and the stream never drafted, at 0.79x of fixed n-gram drafting's speed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gmlx.spec.calibration import CostTable
from gmlx.spec.depth import expected_tokens

_SMOOTHING = 0.05  # per round: about the last twenty rounds of a kind carry its ratio
_MIN_SAMPLES = 8  # a width's ratio counts from this many rounds
_RATIO_BOUNDS = (0.25, 4.0)  # a stall (swap, a paused process) must not rule for long
_SCALE_STEP = 0.05  # the speculative scale moves in these steps, so choices stay memoized


@dataclass(slots=True)
class _Ratio:
    value: float = 1.0
    num_samples: int = 0

    def add(self, ratio: float) -> None:
        ratio = min(max(ratio, _RATIO_BOUNDS[0]), _RATIO_BOUNDS[1])
        self.value = ratio if not self.num_samples else (1 - _SMOOTHING) * self.value + _SMOOTHING * ratio
        self.num_samples += 1


@dataclass(frozen=True, slots=True)
class _Round:
    start_s: float
    width: int
    depth: int  # 0: a pipelined plain round; else the deepest row's drafts


def _nearest_width(widths: list[int], width: int) -> int | None:
    """The one of `widths` nearest `width`, the narrower on a tie; None when there are none."""
    return min(widths, key=lambda w: (abs(w - width), w)) if widths else None


@dataclass
class ServedCosts:
    table: CostTable
    _plain: dict[int, _Ratio] = field(default_factory=dict)  # per width
    _spec: dict[int, _Ratio] = field(default_factory=dict)
    _version: int = 0  # moves when a width's ratio moves a _SCALE_STEP: memoized scales expire
    _steps: dict[tuple[str, int], int | None] = field(default_factory=dict)  # (kind, width) -> ratio in steps
    _scales: dict[int, float] = field(default_factory=dict)  # width -> spec_scale, this version
    _pair_scales: dict[int, float | None] = field(default_factory=dict)  # width -> its nearest pair's, this version
    _open: _Round | None = None  # a steady round whose period closes at the next step's start
    _last_shape: tuple[int, int] | None = None
    _cap_key: tuple | None = None
    _cap: int = 0

    def ran(self, start_s: float, width: int, depth: int | None) -> None:
        """After a round that started at start_s; depth None: not a steady round of either kind
        (a transition, a packed prompt chunk, a join), so it is not timed."""
        shape = None if depth is None else (width, depth)
        # The first round of a shape (after a gate, a resume, a join) still pays the switch.
        self._open = _Round(start_s, width, depth) if shape is not None and shape == self._last_shape else None
        self._last_shape = shape

    def step_started(self, now_s: float) -> None:
        """Closes the open round's period: its own time plus what ran between it and this step."""
        done, self._open = self._open, None
        if done is None:
            return
        width, name = done.width, "spec" if done.depth else "plain"
        ratio = (self._spec if done.depth else self._plain).setdefault(width, _Ratio())
        ratio.add((now_s - done.start_s) / self.table.round_s(width, done.depth))
        steps = round(ratio.value / _SCALE_STEP) if ratio.num_samples >= _MIN_SAMPLES else None
        if self._steps.get((name, width)) != steps:
            self._steps[(name, width)] = steps
            self._version += 1
            self._scales.clear()
            self._pair_scales.clear()

    def interrupted(self) -> None:
        """The engine went idle: the next step's start says nothing about the last round."""
        self._open = self._last_shape = None

    def spec_scale(self, width: int) -> float:
        """A speculative round's served cost over the table's, relative to a plain round's.

        Both kinds' ratios move with the width, so the two are compared at one width where both
        have run; elsewhere each kind's nearest width stands in, and that guess may only make
        drafting look dearer than the table says (a wrong guess toward drafting loses). Believing
        the nearest same-width pair either way here (session 33) opened built-in batches of 3-8
        to resumes that joins gated three rounds later; round_s believes it for a gated width
        only, and width_cap lets that open one row past the table's cap at most."""
        scale = self._scales.get(width)
        if scale is None:
            spec, plain = self._nearest(self._spec, width), self._nearest(self._plain, width)
            if spec is None or plain is None:
                scale = 1.0
            else:
                scale = spec[1] / plain[1]
                scale = scale if spec[0] == plain[0] == width else max(1.0, scale)
                scale = round(scale / _SCALE_STEP) * _SCALE_STEP
            self._scales[width] = scale
        return scale

    @staticmethod
    def _nearest(kind: dict[int, _Ratio], width: int) -> tuple[int, float] | None:
        """(width, ratio) at the measured width nearest this one."""
        nearest = _nearest_width([w for w in kind if ServedCosts._has_served(kind, w)], width)
        return None if nearest is None else (nearest, kind[nearest].value)

    def round_s(self, width: int, depth: int) -> float:
        """The table's round at this width and depth, a speculative one weighed by the served scale
        (in the table's plain-round units: a served cost over the plain rounds' served ratio)."""
        table_s = self.table.round_s(width, depth)
        if not depth:
            return table_s
        if not self._has_served(self._spec, width) and self._has_served(self._plain, width):
            scale = self._pair_scale(width)
            if scale is not None:  # a gated width: the nearest width that ran both kinds speaks for it
                return table_s * scale
            plain_ratio = self._plain[width].value
            if plain_ratio > 1.0:
                excess_s = self.table.round_s(width, 0) * (plain_ratio - 1.0)  # what a round pays served, beyond the table
                return (table_s + excess_s) / plain_ratio
        return table_s * self.spec_scale(width)

    def _pair_scale(self, width: int) -> float | None:
        """The scale at the width nearest this one where both kinds have served their
        _MIN_SAMPLES rounds (None: no such width), in _SCALE_STEP steps as spec_scale's."""
        if width not in self._pair_scales:
            paired = [w for w in self._spec.keys() & self._plain.keys()
                      if self._has_served(self._spec, w) and self._has_served(self._plain, w)]
            pair = _nearest_width(paired, width)
            self._pair_scales[width] = (None if pair is None else
                                        round(self._spec[pair].value / self._plain[pair].value / _SCALE_STEP) * _SCALE_STEP)
        return self._pair_scales[width]

    @staticmethod
    def _has_served(kind: dict[int, _Ratio], width: int) -> bool:
        return width in kind and kind[width].num_samples >= _MIN_SAMPLES

    def spec_round_s(self, width: int, depth: int) -> float:
        """round_s of a speculative round, depth 0 included: served as a depth-1 round is, against the table."""
        if depth:
            return self.round_s(width, depth)
        return self.table.spec_round_s(width, 0) * self.round_s(width, 1) / self.table.round_s(width, 1)

    def width_cap(self, acceptance: float, max_rows: int) -> int:
        """The table's width cap under the served scales, or one row wider where that width has
        served only plain rounds and drafting pays there at round_s; recomputed only when a
        scale moves a step.

        A gated width never serves a speculative round, so the scales alone never reopen it:
        served built-in at 2 clients drafts at 1.2x of plain, yet the table and the one-sided
        guess gated it in 5 of 14 server processes. One row past the table's own cap at most:
        opened at 3-8 rows, closed-loop joins gated each resume again within a few rounds."""
        key = (round(acceptance, 2), max_rows, self._version)
        if key != self._cap_key:
            cap = self.table.width_cap(acceptance, max_rows, self.spec_scale)
            width = cap + 1
            if (cap and width <= min(max_rows, self.table.width_cap(acceptance, max_rows) + 1)
                    and not self._has_served(self._spec, width) and self._pays(width, acceptance)):
                cap = width
            self._cap_key, self._cap = key, cap
        return self._cap

    def _pays(self, width: int, acceptance: float) -> bool:
        """Whether some depth beats plain decoding at this width, each round at round_s."""
        plain = 1.0 / self.round_s(width, 0)
        return any(expected_tokens(acceptance, k) / self.round_s(width, k) > plain
                   for k in range(1, self.table.k_max + 1))

    def describe(self, acceptance: float, max_rows: int) -> dict:
        def ratio(kind: dict[int, _Ratio], width: int) -> float | None:
            return round(kind[width].value, 3) if width in kind else None

        return {
            **self.table.describe(acceptance, max_rows, self.spec_scale),
            "width_cap": self.width_cap(acceptance, max_rows),  # with the one row a gated width may add
            "served": {str(w): {"plain_ratio": ratio(self._plain, w), "spec_ratio": ratio(self._spec, w),
                                "spec_scale": self.spec_scale(w),
                                "num_rounds": sum(k[w].num_samples for k in (self._plain, self._spec) if w in k)}
                       for w in sorted(self._spec.keys() | self._plain.keys())},
        }
