"""Fitting a CostModel to measured micro-batches, and saying how good the fit is.

Pure numpy (no torch): `wlb_opt.profile` measures, this module fits and validates, and the
tests check it against known coefficients with noise added.

One micro-batch of documents d_1..d_k has four features, one per fitted term (paper §3: W_a
quadratic, W_l linear, "derived from offline profiling"):

    attn       causal pairs   sum d(d+1)/2
    linear     tokens         sum d          (GEMMs, element-wise work; comm is 0 on one device)
    doc_const  documents      k
    mb_const   micro-batches  1

Non-negative least squares (Lawson-Hanson) fits them per phase, rows weighted by 1 / time so
the fit minimises relative error, which is what the planner's balance depends on. Samples
must vary these features independently (`sample_micro_batches`), or the terms are confounded:
micro-batches that all hold `window` tokens cannot tell `linear * window` from `mb_const`.

`validate` predicts micro-batches that the fit did not see and reports the mean and worst
absolute percentage error of forward + backward time, the figure the profile prints and saves.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._validate import check_int, is_float, validate_lengths

FIT_TERMS: tuple[str, ...] = ("attn", "linear", "doc_const", "mb_const")
FEATURE_NAMES: dict[str, str] = {"attn": "causal pairs", "linear": "tokens", "doc_const": "documents",
                                 "mb_const": "micro-batch"}


@dataclass
class Sample:
    """One measured micro-batch: its document lengths and seconds per phase (one layer or all)."""

    lengths: np.ndarray
    fwd_s: float
    bwd_s: float


def features(lengths) -> np.ndarray:
    """[causal pairs, tokens, documents, 1] of one micro-batch (floats)."""
    d = np.asarray(lengths, dtype=np.float64)
    return np.array([(d * (d + 1) / 2).sum(), d.sum(), float(len(d)), 1.0])


def nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active-set iterations (Lawson-Hanson), small problems."""
    n = A.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(3 * n + 10):
        w = A.T @ (b - A @ x)
        if passive.all() or np.max(np.where(passive, -np.inf, w)) <= 1e-12 * (np.abs(w).max() + 1e-30):
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if np.all(z[passive] > 0):
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def _check_layers(layers, what: str) -> int:
    """`layers` (the blocks the coefficients are scaled to) as an int >= 1."""
    return check_int(f"{what}: layers", layers, 1)


def _check_samples(samples: list[Sample], what: str) -> None:
    for i, s in enumerate(samples):
        validate_lengths(s.lengths, f"{what}: sample {i}'s lengths")
        for phase in ("fwd", "bwd"):
            t = getattr(s, f"{phase}_s")
            if not is_float(t) or not np.isfinite(t) or t <= 0:
                raise ValueError(f"{what}: measured {phase} times must be positive and finite, got {t!r} "
                                 f"for lengths {np.asarray(s.lengths).tolist()[:8]}")


def _design(samples: list[Sample], what: str) -> np.ndarray:
    """The samples' features, one row each, once the samples are checked and their features
    vary independently (full column rank; else no fit can tell the terms apart, and one
    would put the time of some on others, with a perfect in-sample error)."""
    if len(samples) < len(FIT_TERMS):
        raise ValueError(f"{what} needs at least {len(FIT_TERMS)} samples (one per coefficient), "
                         f"got {len(samples)}")
    _check_samples(samples, what)
    A = np.stack([features(s.lengths) for s in samples])
    scaled = A / np.where(A.max(axis=0) > 0, A.max(axis=0), 1.0)  # the features differ by orders of magnitude
    rank = np.linalg.matrix_rank(scaled)
    if rank < len(FIT_TERMS):
        null = np.abs(np.linalg.svd(scaled)[2][rank:]).max(axis=0)  # the directions the samples do not vary in
        tied = [FEATURE_NAMES[t] for t, c in zip(FIT_TERMS, null) if c > 1e-6]
        raise ValueError(f"{what}: the samples' features do not vary independently ({', '.join(tied)} move "
                         f"together), so their terms cannot be told apart; vary the token count, the document "
                         f"count and the length spread independently (`sample_micro_batches` does)")
    return A


def fit_terms(samples: list[Sample], layers: int = 1) -> dict[str, dict[str, float]]:
    """{phase: {term: coefficient}} for phase "fwd", "bwd": seconds per feature unit, scaled
    by `layers` (samples timed on one block, model of `layers` blocks). Plain floats.
    ValueError for samples whose features do not vary independently."""
    layers = _check_layers(layers, "fit_cost_model")
    A = _design(samples, "fit_cost_model")
    coef = {}
    for phase in ("fwd", "bwd"):
        t = np.array([getattr(s, f"{phase}_s") for s in samples], dtype=np.float64)
        w = 1.0 / t
        x = nnls(A * w[:, None], t * w) * layers
        coef[phase] = {term: float(v) for term, v in zip(FIT_TERMS, x)}
    return coef


BOOTSTRAP_FITS = 200
"""Resampled fits behind `coef_intervals`."""


def coef_intervals(samples: list[Sample], layers: int = 1, n_fits: int = BOOTSTRAP_FITS, seed: int = 0,
                   quantiles: tuple[float, float] = (10.0, 90.0)) -> dict[str, dict[str, list[float]]]:
    """{phase: {term: [low, high]}}: the `quantiles` (percent) of each coefficient over `n_fits`
    fits to the samples drawn again with replacement (a bootstrap), scaled like `fit_terms`.
    A term the samples pin down has a narrow interval; one they hardly tell from the others
    (a small per-document or per-micro-batch constant beside a large linear term) a wide one,
    which says how far a profile can be trusted term by term. Plain floats."""
    layers = _check_layers(layers, "coef_intervals")
    n_fits = check_int("coef_intervals: n_fits", n_fits, 1)
    seed = check_int("coef_intervals: seed", seed, 0)
    if (not isinstance(quantiles, (tuple, list)) or len(quantiles) != 2
            or not all(is_float(q) and 0 <= q <= 100 for q in quantiles) or not quantiles[0] <= quantiles[1]):
        raise ValueError(f"coef_intervals: quantiles must be (low, high) percentages with 0 <= low <= high <= 100, "
                         f"got {quantiles!r}")
    A = _design(samples, "coef_intervals")
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(samples), size=(n_fits, len(samples)))
    out = {}
    for phase in ("fwd", "bwd"):
        t = np.array([getattr(s, f"{phase}_s") for s in samples], dtype=np.float64)
        w = 1.0 / t
        fits = np.stack([nnls(A[rows] * w[rows, None], t[rows] * w[rows]) for rows in draws]) * layers
        low, high = np.percentile(fits, quantiles, axis=0)
        out[phase] = {term: [float(lo), float(hi)] for term, lo, hi in zip(FIT_TERMS, low, high)}
    return out


def predict(coef: dict, lengths, phase: str) -> float:
    """Seconds of one micro-batch under fitted `coef` ({phase: {term: value}})."""
    c = coef[phase]
    return float(features(lengths) @ np.array([c[t] for t in FIT_TERMS]))


def validate(coef: dict, heldout: list[Sample], layers: int = 1) -> dict:
    """Mean and worst absolute percentage error of fwd + bwd time on `heldout` samples.

    `coef` is scaled for `layers` blocks and the samples were timed on one: both sides are
    compared per block. Returns plain numbers: {"mape": %, "worst": %, "n": count}.
    """
    layers = _check_layers(layers, "validate")
    if not heldout:
        raise ValueError("validate needs at least one held-out sample")
    _check_samples(heldout, "validate")
    errors = []
    for s in heldout:
        predicted = (predict(coef, s.lengths, "fwd") + predict(coef, s.lengths, "bwd")) / layers
        measured = s.fwd_s + s.bwd_s
        errors.append(abs(predicted - measured) / measured)
    errors = np.array(errors)
    return {"mape": round(float(100 * errors.mean()), 2), "worst": round(float(100 * errors.max()), 2),
            "n": int(len(errors))}


def validation_line(validation: dict) -> str:
    """The one line the profile prints: `validation MAPE: x%, worst: y%`."""
    return f"validation MAPE: {validation['mape']:.1f}%, worst: {validation['worst']:.1f}%"


def sample_micro_batches(window: int, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """`n` micro-batches of at most `window` tokens whose token count, document count and
    length spread are drawn independently:

    - tokens T uniform in [window / 4, window];
    - documents k log-uniform in [1, T / 16] (at least 1);
    - lengths: T split into k parts by a Dirichlet draw whose concentration is log-uniform in
      [0.1, 10] (from one long document among short ones to k nearly equal ones).

    The first two samples are the extremes (one document of `window` tokens, `window` / 8
    documents of 8 tokens), so every fit sees the ends of the range.
    """
    # below 16, every micro-batch would hold one document: the terms could not be told apart
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 16:
        raise ValueError(f"window must be an integer >= 16 (tokens) to sample micro-batches of several documents, "
                         f"got {window!r}")
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy Generator (np.random.default_rng(seed)), got {type(rng).__name__}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be an integer >= 0 (micro-batches to sample), got {n!r}")
    out = [np.array([window], dtype=np.int64), np.full(window // 8, 8, dtype=np.int64)]
    while len(out) < n:
        total = int(rng.integers(max(1, window // 4), window + 1))
        k_max = max(1, total // 16)
        k = int(np.clip(np.round(np.exp(rng.uniform(0.0, np.log(k_max)))), 1, k_max))
        alpha = float(np.exp(rng.uniform(np.log(0.1), np.log(10.0))))
        out.append(_split(total, k, alpha, rng))
    return out[:n]


def _split(total: int, k: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """`total` tokens as k documents of >= 1 token, shares drawn from Dirichlet(alpha)."""
    shares = rng.dirichlet(np.full(k, alpha))
    d = 1 + np.floor(shares * (total - k)).astype(np.int64)
    d[np.argmax(d)] += total - int(d.sum())
    return d
