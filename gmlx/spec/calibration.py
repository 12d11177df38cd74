"""Start-up calibration: what a plain and a speculative decode round cost on this machine, and
from that, per batch width, the draft depth and the width cap that maximize expected tokens/s.

Measured once per (model, drafter, machine) and cached as JSON under gmlx.config.cache_dir();
GMLX_CALIBRATE=measure re-measures, off skips it (the drafter's fixed cap and the default
cost model then apply). A config's speculative_width_cap or GMLX_MTP_WIDTH_CAP still wins.
A measurement taken while other processes kept the CPU busy is taken again, and never cached.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from gmlx import config
from gmlx.cache.ragged import make_ragged_cache
from gmlx.platform import cpu_kernels, machine_cache
from gmlx.platform.blas_select import cpu_model_name
from gmlx.platform.timing import OtherLoad
from gmlx.spec.depth import expected_tokens

logger = logging.getLogger(__name__)

# 2: whole rounds (plain pipelined, speculative with its host work), not forwards; 3: MTP heads
# beside a quantized target draft in its kernels (2-3x cheaper drafts than the tables of 2 hold);
# 4: plain rounds timed back to back (tables of 3 could hold a bogus-low plain round).
CACHE_VERSION = 4
_CONTEXT_TOKENS = 64  # KV each calibration row holds: a short-context decode
_NUM_REPEATS = 3  # the fastest of this many timings: the box's noise only ever adds time
_MAX_WIDTH = 16  # wider batches are extrapolated from the widest two measured
_MAX_ATTEMPTS = 3  # calibrations disturbed by other processes (timing.OtherLoad): measured again
# A pipelined plain round reads the forward the one before dispatched: timed alone it may find that
# forward done and dispatch the next without waiting (0.25-0.5 ms for a 1-3 ms built-in round, at some
# width in each of six calibrations on session 44's box). Rounds timed back to back wait for theirs.
PLAIN_ROUNDS_PER_TIMING = 4


@dataclass(frozen=True)
class CostTable:
    """Seconds per decode round at measured widths; interpolated linearly in between.

    Whole rounds, as the engine runs them: a plain round pipelines its next forward behind the
    read, a speculative round drafts, verifies and reads in turn, so its host work is not hidden.
    Costing a speculative round by its forward alone made drafting look free on a fast forward
    (the built-in model's n-gram rounds lost 22% at 0.65 acceptance).
    """

    widths: tuple[int, ...]  # ascending
    plain_s: tuple[float, ...]  # [w]: a pipelined plain round
    spec_s: tuple[tuple[float, ...], ...]  # [w][k]: a speculative round where every row drafts k

    def __post_init__(self):
        assert list(self.widths) == sorted(set(self.widths)) and self.widths[0] >= 1, self.widths
        assert len(self.spec_s) == len(self.plain_s) == len(self.widths)

    @property
    def k_max(self) -> int:
        return len(self.spec_s[0]) - 1

    def _at(self, width: int, values) -> float:
        widths = self.widths
        if width <= widths[0]:
            return values[0]
        for i in range(1, len(widths)):
            if width <= widths[i]:
                share = (width - widths[i - 1]) / (widths[i] - widths[i - 1])
                return values[i - 1] + share * (values[i] - values[i - 1])
        if len(widths) == 1:
            return values[0] * width / widths[0]
        slope = (values[-1] - values[-2]) / (widths[-1] - widths[-2])
        return values[-1] + slope * (width - widths[-1])

    def round_s(self, width: int, depth: int) -> float:
        """One round at this width where every row drafts `depth`; depth 0 is a plain round,
        because a batch whose rows all draft nothing decodes plain (engine: the depth gate)."""
        if depth == 0:
            return self._at(width, self.plain_s)
        return self.spec_round_s(width, depth)

    def spec_round_s(self, width: int, depth: int) -> float:
        """One speculative round at this width where every row drafts `depth`, depth 0 included
        (the pending tokens verified alone: a plain round's forward without its pipelining)."""
        return self._at(width, [row[depth] for row in self.spec_s])

    def tokens_per_s(self, width: int, depth: int, acceptance: float, spec_scale: float = 1.0) -> float:
        """spec_scale: a speculative round's served cost over this table's, relative to a plain
        round's (served_costs.py); 1.0 takes the table as it is."""
        round_s = self.round_s(width, depth) * (spec_scale if depth else 1.0)
        return width * expected_tokens(acceptance, depth) / round_s

    def best_depth(self, width: int, acceptance: float, k_max: int | None = None, spec_scale: float = 1.0) -> int:
        """The depth in 0..k_max with the most expected tokens/s at this width (ties: shallower)."""
        top = self.k_max if k_max is None else min(k_max, self.k_max)
        # Asked for every row every round: memoized on acceptance to 0.01, which moves no choice
        # that matters (the model's own inputs are noisier), and costs a gated round nothing.
        return self._best_depth(width, round(acceptance, 2), top, spec_scale)

    @functools.lru_cache(maxsize=8192)
    def _best_depth(self, width: int, acceptance: float, top: int, spec_scale: float) -> int:
        return max(range(top + 1), key=lambda k: (self.tokens_per_s(width, k, acceptance, spec_scale), -k))

    def width_cap(self, acceptance: float, max_rows: int, spec_scale=None) -> int:
        """Speculate while at most this many rows decode (0 = at every width up to max_rows):
        the widest width up to which drafting beats plain decoding at every width.
        spec_scale: None, or the served scale per width (a callable)."""
        if spec_scale is None:
            return self._width_cap(round(acceptance, 2), max_rows)
        return self._scaled_width_cap(acceptance, max_rows, spec_scale)

    @functools.lru_cache(maxsize=1024)
    def _width_cap(self, acceptance: float, max_rows: int) -> int:
        return self._scaled_width_cap(acceptance, max_rows, lambda width: 1.0)

    def _scaled_width_cap(self, acceptance: float, max_rows: int, spec_scale) -> int:
        cap = 0
        for width in range(1, max_rows + 1):
            if self.best_depth(width, acceptance, spec_scale=spec_scale(width)) == 0:
                return max(cap, 1)  # never below 1: a lone row at depth 0 is gated to plain anyway
            cap = width
        return 0

    def describe(self, acceptance: float, max_rows: int, spec_scale=None) -> dict:
        scale = spec_scale or (lambda width: 1.0)
        return {
            "widths": list(self.widths),
            "plain_round_ms": [round(s * 1e3, 3) for s in self.plain_s],
            "spec_round_ms": [[round(s * 1e3, 3) for s in row] for row in self.spec_s],
            "acceptance": round(acceptance, 4),
            "best_depth": [self.best_depth(w, acceptance, spec_scale=scale(w)) for w in self.widths],  # per width
            "width_cap": self.width_cap(acceptance, max_rows, spec_scale),
        }


def format_table(table: CostTable, acceptance: float, max_rows: int) -> str:
    """The table as `gmlx doctor` prints it: per width, a plain round and a speculative round at
    each depth, the depth chosen at this acceptance, then the width cap that follows."""
    d = table.describe(acceptance, max_rows)
    depths = " | ".join(f"depth {k} ms" for k in range(table.k_max + 1))
    lines = [f"| width | plain round ms | {depths} | best depth |",
             "|---" * (table.k_max + 4) + "|"]
    for width, plain_ms, spec_ms, depth in zip(d["widths"], d["plain_round_ms"], d["spec_round_ms"], d["best_depth"]):
        lines.append(f"| {width} | {plain_ms:.2f} | " + " | ".join(f"{ms:.2f}" for ms in spec_ms) + f" | {depth} |")
    cap = d["width_cap"]
    lines.append(f"at acceptance {d['acceptance']:.2f}: speculate up to width "
                 f"{cap if cap else f'{max_rows} (every width)'}")
    return "\n".join(lines)


def load_or_measure(target, drafter, max_rows: int) -> CostTable | None:
    """The cached table for this model, drafter and machine, measured now if there is none."""
    mode = config.calibrate_mode()
    if drafter is None or mode == "off":
        return None
    key = _cache_key(target, drafter, max_rows)
    table = None if mode == "measure" else _read_cache(key)
    if table is not None:
        return table
    start_s = time.perf_counter()
    tables = []
    for _ in range(_MAX_ATTEMPTS):
        with OtherLoad() as load:
            tables.append(measure(target, drafter, max_rows))
        if not load.is_disturbed:
            logger.info("calibrated %s + %s drafter in %.1f s", target.path, drafter.kind, time.perf_counter() - start_s)
            _write_cache(key, tables[-1])
            return tables[-1]
        logger.warning("calibrating %s + %s drafter: other processes used %.0f%% of the CPU meanwhile",
                       target.path, drafter.kind, 100 * load.share)
    # Every attempt disturbed: noise only adds time, so each cost's fastest reading serves this
    # process, and the next start measures again.
    logger.warning("round costs from %d disturbed calibrations, not cached", len(tables))
    return _fastest_cells(tables)


def measure(target, drafter, max_rows: int) -> CostTable:
    """Time the engine's own rounds at widths 1, 2, 4, ...: speculative rounds of depth 0..k_max
    (drafting, the verify forward, acceptance and the KV trim) and pipelined plain rounds."""
    from gmlx.request import Request, SamplingParams
    from gmlx.spec.batch import BatchMode, DecodeBatch
    from gmlx.spec.speculative import plain_round, speculative_round

    k_max = drafter.num_draft_tokens
    widths = [w for w in (1, 2, 4, 8, 16) if w <= min(max_rows, _MAX_WIDTH)]
    plain_s, spec_s = [], []
    for width in widths:
        tokens = mx.array([[(7 * i + 3 * j) % target.vocab_size for j in range(_CONTEXT_TOKENS)]
                           for i in range(width)], dtype=mx.int32)  # (W, C)
        caches = make_ragged_cache(target.num_layers, width, stored_dtype=target.kv_dtype)
        hidden = target.body(tokens, caches)  # (W, C, D)
        mx.eval(hidden, [c.keys for c in caches])
        requests = [Request(f"calibration-{i}", tokens[i].tolist(), SamplingParams(), i) for i in range(width)]
        batch = DecodeBatch(requests, caches, tokens[:, -1], BatchMode.ARMED)
        drafter.reset()
        drafter.add_rows(batch, list(range(width)), hidden[:, -1, :] if drafter.needs_hidden else None)
        # Each timed round appends its tokens to the KV and, as the engine delivers them, to the
        # requests (a draft model reads its history from them): a few more than the context.
        def deliver(tokens_by_row):
            for request, row_tokens in zip(requests, tokens_by_row):
                request.output_token_ids.extend(row_tokens)

        spec_s.append(tuple(
            _fastest_round_s(lambda k=k: deliver(speculative_round(target, batch, drafter, [k] * width).tokens_by_row))
            for k in range(k_max + 1)))
        deliver(plain_round(target, batch, dispatch_next=True))  # the first dispatches two forwards
        plain_s.append(_fastest_round_s(lambda: deliver(plain_round(target, batch, dispatch_next=True)),
                                        PLAIN_ROUNDS_PER_TIMING))
        deliver(plain_round(target, batch, dispatch_next=False))  # reads the last lookahead
        drafter.reset()
    return CostTable(tuple(widths), tuple(_suffix_min(plain_s)), _monotone(spec_s))


def _fastest_cells(tables: list[CostTable]) -> CostTable:
    """Each cost's fastest reading over tables of one shape (each monotone, so this is too)."""
    return CostTable(tables[0].widths, tuple(map(min, zip(*(t.plain_s for t in tables)))),
                     tuple(tuple(map(min, zip(*cells))) for cells in zip(*(t.spec_s for t in tables))))


def _suffix_min(values: list[float]) -> list[float]:
    out, best = [], float("inf")
    for value in reversed(values):
        best = min(best, value)
        out.append(best)
    return out[::-1]


def _monotone(round_s: list[tuple[float, ...]]) -> tuple[tuple[float, ...], ...]:
    """More rows or drafts never cost less, and noise only adds time: each cell becomes the
    fastest timing at any width and depth at least its own."""
    rows = [_suffix_min(list(row)) for row in round_s]
    columns = [_suffix_min([row[p] for row in rows]) for p in range(len(rows[0]))]
    return tuple(tuple(columns[p][w] for p in range(len(rows[0]))) for w in range(len(rows)))


def _fastest_round_s(run, rounds_per_timing: int = 1) -> float:
    """The fastest of a few timings of rounds_per_timing rounds back to back, per round; a round
    reads its own tokens, so it has finished when it returns."""
    best = float("inf")
    for _ in range(_NUM_REPEATS + 1):  # the first call warms up (graph build, allocations)
        start_s = time.perf_counter()
        for _ in range(rounds_per_timing):
            run()
        best = min(best, (time.perf_counter() - start_s) / rounds_per_timing)
    return best


CACHE_NAME = "spec_calibration"


def _cache_key(target, drafter, max_rows: int) -> str:
    parts = [cpu_model_name(), str(os.cpu_count()), mx.__version__, str(CACHE_VERSION), drafter.kind,
             str(drafter.num_draft_tokens), str(min(max_rows, _MAX_WIDTH)), os.environ.get("OPENBLAS_CORETYPE", ""),
             str(getattr(drafter, "path", ""))]
    # The CPU kernels' switches and build set the costs too: a rebuilt (faster) extension re-measures.
    # So do the graph's switches, the device, and the row-invariance rules the model was loaded
    # under (they cost a GPU 2-3x): a table measured with them is not read without them.
    parts += [f"{name}={value}" for name, value in sorted(os.environ.items())
              if name.startswith(("GMLX_CPU_", "GMLX_FUSE_CPU_OPS", "GMLX_INPUT_MAJOR_WEIGHTS"))]
    parts += [str(mx.default_device()), repr(getattr(target.body, "row_rules", None))]
    # The weights too: a model folder's safetensors and config, or the GGUF file itself.
    source = Path(target.path)
    weights = [source] if source.is_file() else sorted(source.glob("*.safetensors")) + [source / "config.json"]
    drafter_files = drafter.weight_files() if hasattr(drafter, "weight_files") else []
    files = weights + drafter_files + cpu_kernels.build_files()
    return machine_cache.cache_key(parts, files)


def _read_cache(key: str) -> CostTable | None:
    entry = machine_cache.read_entry(CACHE_NAME, key)
    try:
        return CostTable(tuple(entry["widths"]), tuple(entry["plain_s"]), tuple(tuple(r) for r in entry["spec_s"]))
    except (AttributeError, KeyError, TypeError, AssertionError):
        return None


def _write_cache(key: str, table: CostTable) -> None:
    machine_cache.write_entry(CACHE_NAME, key, {"cpu": cpu_model_name(), **asdict(table)})
