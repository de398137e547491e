"""Prediction intervals from the backtest's own errors (split conformal), and their scores.

For a model and a series, each backtest window gives one absolute error per forecast step. The
interval at level L for step j is the forecast ± the ⌈(n + 1)·L⌉-th smallest of the n errors at
step j: for errors that are exchangeable across windows it covers the truth with probability at
least L, whatever the model (no extra fits, no distributional assumption). With too few windows
for that rank (n < L / (1 − L): 4 windows for 80%, 19 for 95%) the largest error is used, and the
interval may cover less than L; more windows tighten the guarantee.

Scores, per level, on windows whose interval comes from the windows before them only: coverage
(share of actual values inside), the Winkler (interval) score (width plus 2/α times the miss,
mean over steps: lower is better) and MSIS (the Winkler score scaled like MASE, by the in-sample
seasonal naive error).
"""

from __future__ import annotations

import math

import numpy as np


def half_widths(errors: list[np.ndarray], level: int) -> np.ndarray:
    """Per forecast step, the conformal half-width at `level` (percent) from the windows'
    absolute errors (one array per window, one value per step); NaN with no finite error."""
    scores = np.sort(np.vstack(errors), axis=0)  # NaN (no actual value) sorts last
    counts = np.isfinite(scores).sum(axis=0)
    ranks = np.minimum(np.ceil((counts + 1) * level / 100), counts).astype(int)
    picked = scores[np.maximum(ranks - 1, 0), np.arange(scores.shape[1])]
    return np.where(counts > 0, picked, np.nan)


def interval_scores(
    actual: np.ndarray, lower: np.ndarray, upper: np.ndarray, level: int, naive_mae: float
) -> dict[str, float]:
    """Coverage, Winkler score and MSIS of one window's intervals at `level` (NaN actual values
    left out)."""
    keep = ~np.isnan(actual) & ~np.isnan(lower)
    if not keep.any():
        return dict.fromkeys(score_names(level), math.nan)
    a, lo, hi = actual[keep], lower[keep], upper[keep]
    alpha = 1 - level / 100
    winkler = (hi - lo) + 2 / alpha * (np.maximum(lo - a, 0) + np.maximum(a - hi, 0))
    coverage, width = float(np.mean((a >= lo) & (a <= hi))), float(np.mean(winkler))
    names = score_names(level)
    msis = width / naive_mae if naive_mae > 0 else math.nan
    return {names[0]: coverage, names[1]: width, names[2]: msis}


def score_names(level: int) -> tuple[str, str, str]:
    return (f"coverage_{level}", f"winkler_{level}", f"msis_{level}")


def bound_names(level: int) -> tuple[str, str]:
    """The forecast columns of an interval: `lo_80`, `hi_80`."""
    return (f"lo_{level}", f"hi_{level}")
