"""A target against the best of several others, read two ways.

The best of several noisy medians is biased upwards: when the others are equally fast (every
speculative target gated at a wide batch, say), their maximum still beats each of them by about
a standard error, so a target as fast as they are reads below 1. Cross-fitting takes that
bias out: the best is chosen on one half of the repeats and the ratio measured on the other
half, both ways round, averaged over the ways to split the repeats.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics

MAX_SPLITS = 512  # halvings averaged over; beyond, a seeded sample of them


def versus_best(runs: list[dict], comparators: list[str], key: str = "aggregate_tok_per_s") -> list[dict]:
    """Per level, each target outside `comparators` over the best of them: `of_medians` (the
    best median of all repeats) and `cross_fitted` (None under two repeats)."""
    values: dict = {}  # (level, target) -> {repeat: value}
    for run in runs:
        value = run["summary"].get(key)
        if value is not None:
            values.setdefault((run["level"], run["target"]), {})[run["repeat"]] = value
    rows = []
    for level in dict.fromkeys(run["level"] for run in runs):
        subjects = [t for (lv, t) in values if lv == level and t not in comparators]
        if any((level, c) not in values for c in comparators):
            continue  # a comparator without a value at this level: no best to read
        for subject in subjects:
            series = {name: values[(level, name)] for name in (subject, *comparators)}
            repeats = sorted(set.intersection(*(set(s) for s in series.values())))
            if not repeats:
                continue
            best = max(_median(series[c], repeats) for c in comparators)
            rows.append({"level": level, "target": subject, "comparators": list(comparators),
                         "num_repeats": len(repeats), "of_medians": _median(series[subject], repeats) / best,
                         "cross_fitted": _cross_fitted(series, subject, comparators, repeats)})
    return rows


def _cross_fitted(series: dict, subject: str, comparators: list[str], repeats: list[int]) -> float | None:
    if len(repeats) < 2:
        return None
    ratios = []
    for half in _halves(repeats):
        other = [r for r in repeats if r not in half]
        for choose, judge in ((half, other), (other, half)):
            pick = max(comparators, key=lambda c: _median(series[c], choose))
            ratios.append(_median(series[subject], judge) / _median(series[pick], judge))
    return statistics.fmean(ratios)


def _halves(repeats: list[int]) -> list[tuple[int, ...]]:
    """Ways to take half the repeats (the rest is the other half): all, or a seeded sample."""
    size = len(repeats) // 2
    if math.comb(len(repeats), size) <= MAX_SPLITS:
        return list(itertools.combinations(repeats, size))
    rng = random.Random(len(repeats))
    return [tuple(sorted(rng.sample(repeats, size))) for _ in range(MAX_SPLITS)]


def _median(by_repeat: dict, repeats) -> float:
    return statistics.median(by_repeat[r] for r in repeats)


def versus_best_table(rows: list[dict]) -> str:
    """Markdown: each target over the best of the comparators, both readings."""
    if not rows:
        return ""
    has_levels = any(r["level"] is not None for r in rows)
    head = (["conc."] if has_levels else []) + [
        "target", f"over the best of {' / '.join(rows[0]['comparators'])}: of medians", "cross-fitted", "repeats"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cross = "-" if r["cross_fitted"] is None else f"{r['cross_fitted']:.3f}"
        cells = ([str(r["level"])] if has_levels else []) + [
            r["target"], f"{r['of_medians']:.3f}", cross, str(r["num_repeats"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
