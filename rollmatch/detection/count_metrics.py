"""Count-regulation and order metrics (pure: matchings in, floats out).

Owns: :class:`CountOrderCounts` (per image: detection counts by GT count, the signed count error,
recall by third of the canonical GT list, and the Kendall tau of the matched predictions against
canonical order) with additive ``to_sums`` / ``from_sums`` like the other counts of
``detection.metrics``; the GT-count buckets (:func:`count_bucket_label`; the default edges are
``eval.count_buckets``); and the pure pieces :func:`kendall_tau` and :func:`gt_third`.
Leaves out: precision / recall / F1 themselves (``detection.metrics.DetectionCounts``), summing over
ranks and logging.

These are the numbers that show whether a model regulates how many objects it lists: an early stop
shows as a weak last third and a negative count error on crowded images, a repeating model as a
positive one, and a model that lists objects out of canonical order as a low Kendall tau.
Counts are kept per exact GT count, so the buckets are chosen when the metrics are read
(``eval.count_buckets``), not when the counts are made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rollmatch.config.schema import DEFAULT_COUNT_BUCKETS
from rollmatch.detection.matching import MatchResult
from rollmatch.detection.metrics import DetectionCounts

THIRDS = ("first", "middle", "last")
_PREFIX = "count/"
_AT = ("images", "tp", "fp", "fn")  # the per-GT-count sums: count/<name>_at_<n>


def kendall_tau(order: Sequence[int]) -> float | None:
    """Kendall's tau (tau-a; no ties) between ``order`` and its sorted version: 1 for an increasing
    sequence, -1 for a decreasing one; None with fewer than two elements (undefined)."""
    n = len(order)
    if n < 2:
        return None
    concordant = discordant = 0
    for i in range(n):
        for j in range(i + 1, n):
            if order[i] < order[j]:
                concordant += 1
            elif order[i] > order[j]:
                discordant += 1
    return (concordant - discordant) / (n * (n - 1) / 2)


def gt_third(index: int, n: int) -> int:
    """Which third (0 first, 1 middle, 2 last) of a list of ``n`` holds item ``index``: the third that
    holds the centre of its slot, ``(index + 0.5) / n``. One item is the middle; two are first and last."""
    return min(2, (3 * (2 * index + 1)) // (2 * n))


def count_bucket_label(n: int, edges: Sequence[int]) -> str:
    """The bucket of an image with ``n`` GT objects, e.g. ``"4-7"``, ``"31+"``, ``"5"`` for a one-value
    bucket; below the first edge: ``"0-<first - 1>"`` (``"0"`` when the first edge is 1)."""
    lower = [0, *edges] if edges[0] > 0 else list(edges)
    lo = max(edge for edge in lower if edge <= n)
    following = [edge for edge in lower if edge > lo]
    if not following:
        return f"{lo}+"
    hi = following[0] - 1
    return str(lo) if hi == lo else f"{lo}-{hi}"


@dataclass
class CountOrderCounts:
    """The counts behind the count-regulation and order metrics, over many answers."""

    images: int = 0
    count_error_sum: int = 0  # sum over answers of (valid predicted objects - GT objects)
    count_abs_error_sum: int = 0
    tau_sum: float = 0.0  # sum of the Kendall tau of answers with >= 2 matched predictions
    tau_images: int = 0
    gt_by_third: list[int] = field(default_factory=lambda: [0, 0, 0])  # GT objects in each third
    tp_by_third: list[int] = field(default_factory=lambda: [0, 0, 0])  # of them, matched
    at: dict[str, dict[int, int]] = field(default_factory=lambda: {name: {} for name in _AT})

    def add(self, match: MatchResult, n_pred: int, n_gt: int) -> None:
        """Add one answer: its matching to the (canonically ordered) GT and the list lengths."""
        self.images += 1
        self.count_error_sum += n_pred - n_gt
        self.count_abs_error_sum += abs(n_pred - n_gt)
        tau = kendall_tau([g for _, g, _ in sorted(match.pairs)])
        if tau is not None:
            self.tau_sum += tau
            self.tau_images += 1
        matched = {g for _, g, _ in match.pairs}
        for g in range(n_gt):
            third = gt_third(g, n_gt)
            self.gt_by_third[third] += 1
            self.tp_by_third[third] += int(g in matched)
        for name, value in (
            ("images", 1),
            ("tp", len(match.pairs)),
            ("fp", len(match.fp)),
            ("fn", len(match.fn)),
        ):
            self.at[name][n_gt] = self.at[name].get(n_gt, 0) + value

    def to_sums(self) -> dict[str, float]:
        """Additive sums (``count/*``); :meth:`from_sums` reads them back."""
        sums = {
            f"{_PREFIX}images": float(self.images),
            f"{_PREFIX}error_sum": float(self.count_error_sum),
            f"{_PREFIX}abs_error_sum": float(self.count_abs_error_sum),
            f"{_PREFIX}tau_sum": float(self.tau_sum),
            f"{_PREFIX}tau_images": float(self.tau_images),
        }
        for third, name in enumerate(THIRDS):
            sums[f"{_PREFIX}gt_{name}_third"] = float(self.gt_by_third[third])
            sums[f"{_PREFIX}tp_{name}_third"] = float(self.tp_by_third[third])
        for name, by_count in self.at.items():
            sums.update({f"{_PREFIX}{name}_at_{n}": float(v) for n, v in by_count.items()})
        return sums

    @classmethod
    def from_sums(cls, sums: Mapping[str, float]) -> CountOrderCounts:
        """The counts in ``sums`` (missing names count 0), e.g. after summing many :meth:`to_sums`."""
        at: dict[str, dict[int, int]] = {name: {} for name in _AT}
        for key, value in sums.items():
            for name in _AT:
                head = f"{_PREFIX}{name}_at_"
                if key.startswith(head):
                    at[name][int(key.removeprefix(head))] = round(value)
        return cls(
            images=round(sums.get(f"{_PREFIX}images", 0)),
            count_error_sum=round(sums.get(f"{_PREFIX}error_sum", 0)),
            count_abs_error_sum=round(sums.get(f"{_PREFIX}abs_error_sum", 0)),
            tau_sum=float(sums.get(f"{_PREFIX}tau_sum", 0.0)),
            tau_images=round(sums.get(f"{_PREFIX}tau_images", 0)),
            gt_by_third=[round(sums.get(f"{_PREFIX}gt_{name}_third", 0)) for name in THIRDS],
            tp_by_third=[round(sums.get(f"{_PREFIX}tp_{name}_third", 0)) for name in THIRDS],
            at=at,
        )

    def by_bucket(
        self, edges: Sequence[int] = DEFAULT_COUNT_BUCKETS
    ) -> dict[str, tuple[int, DetectionCounts]]:
        """``{bucket label: (images, detection counts)}`` for the buckets that hold images, in order."""
        buckets: dict[str, tuple[int, DetectionCounts]] = {}
        for n in sorted(self.at["images"]):
            label = count_bucket_label(n, edges)
            images, counts = buckets.get(label, (0, DetectionCounts()))
            here = DetectionCounts(
                tp=self.at["tp"].get(n, 0), fp=self.at["fp"].get(n, 0), fn=self.at["fn"].get(n, 0)
            )
            buckets[label] = (images + self.at["images"][n], counts.merge(here))
        return buckets

    def summary(self) -> dict[str, float]:
        """``count_error`` (mean signed: valid predicted minus GT objects per answer), ``count_mae``,
        ``recall_<first|middle|last>_third`` and ``kendall_tau`` (mean over answers with >= 2 matched
        predictions; 0.0 when there is none). Ratios with a zero denominator are 0.0."""
        values = {
            "count_error": self.count_error_sum / self.images if self.images else 0.0,
            "count_mae": self.count_abs_error_sum / self.images if self.images else 0.0,
        }
        for third, name in enumerate(THIRDS):
            gt = self.gt_by_third[third]
            values[f"recall_{name}_third"] = self.tp_by_third[third] / gt if gt else 0.0
        values["kendall_tau"] = self.tau_sum / self.tau_images if self.tau_images else 0.0
        return values

    def bucket_metrics(
        self, prefix: str, edges: Sequence[int] = DEFAULT_COUNT_BUCKETS, per: float = 1.0
    ) -> dict[str, float]:
        """``<prefix>gt_count_<bucket>/{precision,recall,f1,images}`` (images divided by ``per``)."""
        out: dict[str, float] = {}
        for label, (images, counts) in self.by_bucket(edges).items():
            head = f"{prefix}gt_count_{label}/"
            out.update(
                {
                    f"{head}precision": counts.precision,
                    f"{head}recall": counts.recall,
                    f"{head}f1": counts.f1,
                    f"{head}images": images / per,
                }
            )
        return out
