"""The studies' statistics, pure: per-image counts (or per-image values) in, numbers out.

Every study driver and summary imports these (none defines its own):

- :func:`f1_of`: micro F1 of summed tp / fp / fn counts;
- :func:`paired_bootstrap`: F1(arm) - F1(base) over seeds x images, resampling seeds and images (the
  same images on both sides), with its 95% interval and the per-seed differences;
  :func:`bucket_bootstrap`, the same on the images of one GT-count bucket (:func:`images_in_bucket`);
  :func:`bootstrap_spread`, one seed's spread of the paired difference over image resamples;
- :func:`paired_t`: the paired t-test over seeds of per-seed differences;
- :func:`paired_mean_bootstrap`: the mean of paired per-image differences of any value (a reward),
  with its interval over image resamples;
- :func:`count_oracle_counts` / :func:`count_oracle_f1` / :func:`count_oracle_headroom`: the F1 if every
  image's count error were fixed, and how far above the real F1 that is.

Leaves out: the decision rules these numbers feed (``studies/study_rules.py``, each driver's own rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats


# --------------------------------------------------------------------------------------- F1 deltas
def f1_of(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> float:
    denominator = 2 * tp.sum() + fp.sum() + fn.sum()
    return float(2 * tp.sum() / denominator) if denominator else 1.0


def paired_bootstrap(
    arm: list[dict[str, list[int]]],
    base: list[dict[str, list[int]]],
    resamples: int,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """F1(arm) - F1(base) over seeds x images, resampling seeds and images (the same images for both)."""
    stack = {k: np.asarray([run[k] for run in arm]) for k in ("tp", "fp", "fn")}
    base_stack = {k: np.asarray([run[k] for run in base]) for k in ("tp", "fp", "fn")}
    seeds, images = stack["tp"].shape
    per_seed = [
        f1_of(*(stack[k][s] for k in ("tp", "fp", "fn")))
        - f1_of(*(base_stack[k][s] for k in ("tp", "fp", "fn")))
        for s in range(seeds)
    ]
    deltas = np.empty(resamples)
    for r in range(resamples):
        chosen_seeds = rng.integers(0, seeds, seeds)
        chosen_images = rng.integers(0, images, images)
        deltas[r] = np.mean(
            [
                f1_of(*(stack[k][s, chosen_images] for k in ("tp", "fp", "fn")))
                - f1_of(*(base_stack[k][s, chosen_images] for k in ("tp", "fp", "fn")))
                for s in chosen_seeds
            ]
        )
    return {
        "delta_f1": round(float(np.mean(per_seed)), 4),
        "ci95": [round(float(np.percentile(deltas, 2.5)), 4), round(float(np.percentile(deltas, 97.5)), 4)],
        "per_seed": [round(d, 4) for d in per_seed],
    }


def paired_t(per_seed: Sequence[float]) -> dict[str, Any]:
    """Paired t-test over seeds of the per-seed differences (H0: mean 0): t, two-sided p, 95% interval.
    None values with fewer than 2 seeds; a zero spread gives an interval of width 0."""
    d = np.asarray(per_seed, dtype=np.float64)
    if len(d) < 2:
        return {"seeds": len(d), "mean": round(float(d.mean()), 4) if len(d) else None, "t": None, "p": None}
    mean, se = float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))
    half = float(stats.t.ppf(0.975, len(d) - 1)) * se
    if se == 0.0:
        t, p = (0.0, 1.0) if mean == 0.0 else (float(np.sign(mean) * np.inf), 0.0)
    else:
        t = mean / se
        p = float(2 * stats.t.sf(abs(t), len(d) - 1))
    return {
        "seeds": len(d),
        "mean": round(mean, 4),
        "t": round(t, 3) if np.isfinite(t) else t,
        "p": round(p, 4),
        "ci95": [round(mean - half, 4), round(mean + half, 4)],
    }


def images_in_bucket(gt_counts: Sequence[int], bucket: str) -> np.ndarray:
    """Indices of the images whose GT count falls in ``bucket`` (``"8-12"``, ``"31+"`` or ``"5"``)."""
    low, _, high = bucket.partition("-")
    lo = int(low.rstrip("+"))
    hi = np.inf if bucket.endswith("+") else int(high or low)
    counts = np.asarray(gt_counts)
    return np.flatnonzero((counts >= lo) & (counts <= hi))


def bucket_bootstrap(
    arm: list[Mapping[str, list[int]]],
    base: list[Mapping[str, list[int]]],
    bucket: str,
    resamples: int,
    rng: np.random.Generator,
) -> dict[str, Any] | None:
    """The paired bootstrap (seeds x images) of F1, on the images of one GT-count bucket (the same
    images on both sides: GT count = tp + fn). None when the bucket holds no image."""
    gt = np.asarray(base[0]["tp"]) + np.asarray(base[0]["fn"])
    chosen = images_in_bucket(gt, bucket)
    if not len(chosen):
        return None

    def subset(run: Mapping[str, list[int]]) -> dict[str, list[int]]:
        return {k: list(np.asarray(run[k])[chosen]) for k in ("tp", "fp", "fn")}

    result = paired_bootstrap([subset(r) for r in arm], [subset(r) for r in base], resamples, rng)
    return {"images": len(chosen), **result}


def bootstrap_spread(
    arm: Mapping[str, list[int]], base: Mapping[str, list[int]], resamples: int, rng: np.random.Generator
) -> float:
    """Standard deviation of one seed's paired F1 difference over image resamples (the pilot's spread)."""
    a = {k: np.asarray(arm[k]) for k in ("tp", "fp", "fn")}
    b = {k: np.asarray(base[k]) for k in ("tp", "fp", "fn")}
    images = len(a["tp"])
    deltas = []
    for _ in range(resamples):
        idx = rng.integers(0, images, images)
        deltas.append(f1_of(*(a[k][idx] for k in a)) - f1_of(*(b[k][idx] for k in b)))
    return float(np.std(deltas, ddof=1))


def paired_mean_bootstrap(
    after: Sequence[float], before: Sequence[float], resamples: int, rng: np.random.Generator
) -> dict[str, Any]:
    """Mean of ``after - before`` over images, with a 95% percentile interval from resampling images."""
    if len(after) != len(before) or not after:
        raise ValueError(
            f"paired bootstrap needs two equal non-empty lists; got {len(after)} and {len(before)}"
        )
    differences = np.asarray(after, dtype=float) - np.asarray(before, dtype=float)
    draws = rng.integers(0, len(differences), (resamples, len(differences)))
    means = differences[draws].mean(axis=1)
    return {
        "delta": round(float(differences.mean()), 4),
        "ci95": [round(float(np.percentile(means, 2.5)), 4), round(float(np.percentile(means, 97.5)), 4)],
        "images": len(differences),
        "images_up": int((differences > 0).sum()),
        "images_down": int((differences < 0).sum()),
    }


# ----------------------------------------------------------------------------- count-oracle F1
def count_oracle_counts(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per image, the counts if its count error were fixed and nothing else.

    An image with ``n_pred = tp + fp`` valid predictions and ``n_gt = tp + fn`` GT objects. Over-counted
    (``n_pred > n_gt``): the ``n_pred - n_gt`` surplus predictions are removed, false positives first,
    so ``fp' = fn`` and ``tp`` stays. Under-counted (``n_pred < n_gt``): ``n_gt - n_pred`` predictions
    are added, each a correct box of a missed object (the best an added prediction can be), so
    ``tp' = tp + fn - fp`` and ``fn' = fp``. Both cases: ``fp' = fn' = min(fp, fn)``,
    ``tp' = tp + fn - min(fp, fn)``; an exact count changes nothing. An upper bound on what stopping at
    the right length alone could give: boxes and labels stay as they are."""
    tp, fp, fn = (np.asarray(a, dtype=np.int64) for a in (tp, fp, fn))
    if (tp < 0).any() or (fp < 0).any() or (fn < 0).any():
        raise ValueError("per-image tp / fp / fn counts must be >= 0")
    wrong = np.minimum(fp, fn)
    return tp + fn - wrong, wrong, wrong.copy()


def count_oracle_f1(tp: Sequence[int], fp: Sequence[int], fn: Sequence[int]) -> float:
    """Micro F1 over the images with every count error fixed (:func:`count_oracle_counts`)."""
    return f1_of(*count_oracle_counts(np.asarray(tp), np.asarray(fp), np.asarray(fn)))


def count_oracle_headroom(per_image: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """``f1``, ``count_oracle_f1`` and ``headroom`` (their difference, >= 0) of one evaluation."""
    tp, fp, fn = (np.asarray(per_image[k]) for k in ("tp", "fp", "fn"))
    real, oracle = f1_of(tp, fp, fn), count_oracle_f1(tp, fp, fn)
    return {"f1": round(real, 4), "count_oracle_f1": round(oracle, 4), "headroom": round(oracle - real, 4)}
