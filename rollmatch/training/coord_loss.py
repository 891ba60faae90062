"""Losses on coordinate positions of ``custom.object_format: coord_tokens`` targets.

Owns: :class:`CoordLoss` (the settings of ``loss.coord_*`` / ``loss.geometry_*`` and the 1,000
coordinate-token ids) and :meth:`CoordLoss.position_losses` / :meth:`CoordLoss.geometry_sum`.
Leaves out: which positions are trained and with what weight (``detection.targets``) and the step
normalisation (``training.losses``).

At a position whose target is a coordinate token (bin ``t``), with ``p`` the model's distribution
over the whole vocabulary and ``p_c`` its distribution renormalised over the 1,000 coordinate
tokens, the loss is::

    soft_ce  = -sum_k q_k log p_c(k),     q = Gaussian over bins centred on t (loss.coord_sigma_bins),
                                              normalised; sigma 0 is one-hot
    gate     = -log sum_k p(coord_k)      (mass kept on coordinate tokens; weight loss.coord_gate_weight)
    w1       = sum_k |F_pc(k) - F_q(k)| / 999   (1-D Wasserstein between the bin distributions, in
                                              units of the image side; weight loss.coord_w1_weight)

With sigma 0 and gate weight 1, ``soft_ce + gate`` is exactly the plain cross-entropy of ``t``, so
the coordinate loss generalises CE: predicting 499 for a GT of 500 costs less than predicting 9.
The optional geometry term (``loss.geometry_l1_weight``, ``loss.geometry_giou_weight``) groups every
four consecutive trained coordinate positions into a box ``(x1, y1, x2, y2)`` (targets always hold
whole boxes, with one weight per box), takes the expected coordinates under ``p_c`` and adds
SmoothL1 + (1 - GIoU) against the target box, weighted by the box's weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollmatch.detection.coord_tokens import NUM_BINS

_SMOOTH_L1_BETA = 0.02  # in units of the image side: quadratic within 2% of the side


@dataclass(frozen=True)
class CoordLoss:
    token_ids: torch.Tensor  # (NUM_BINS,) long: the id of <|coord_k|> at index k
    sigma_bins: float = 1.0
    gate_weight: float = 1.0
    w1_weight: float = 0.0
    geometry_l1_weight: float = 0.0
    geometry_giou_weight: float = 0.0

    @classmethod
    def from_config(cls, token_ids: list[int], loss_cfg) -> CoordLoss:  # type: ignore[no-untyped-def]
        return cls(
            token_ids=torch.tensor(token_ids, dtype=torch.long),
            sigma_bins=loss_cfg.coord_sigma_bins,
            gate_weight=loss_cfg.coord_gate_weight,
            w1_weight=loss_cfg.coord_w1_weight,
            geometry_l1_weight=loss_cfg.geometry_l1_weight,
            geometry_giou_weight=loss_cfg.geometry_giou_weight,
        )

    def bins_of(self, targets: torch.Tensor) -> torch.Tensor:
        """Bin index per target id, -1 where the target is not a coordinate token."""
        ids = self.token_ids.to(targets.device)
        lookup = torch.full((int(max(int(ids.max()), int(targets.max())) + 1),), -1, device=targets.device)
        lookup[ids] = torch.arange(NUM_BINS, device=targets.device)
        return lookup[targets]

    def position_losses(self, logits: torch.Tensor, bins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss per position, p_c per position)`` for (N, V) logits at coordinate positions with
        target bins (N,); float32."""
        log_p = torch.log_softmax(logits.float(), dim=-1)
        log_coord = log_p[:, self.token_ids.to(logits.device)]  # (N, NUM_BINS)
        log_mass = torch.logsumexp(log_coord, dim=-1)
        log_within = log_coord - log_mass[:, None]
        target = gaussian_targets(bins, self.sigma_bins)
        loss = -(target * log_within).sum(-1) - self.gate_weight * log_mass
        p_within = log_within.exp()
        if self.w1_weight:
            cdf_gap = (p_within.cumsum(-1) - target.cumsum(-1)).abs().sum(-1) / (NUM_BINS - 1)
            loss = loss + self.w1_weight * cdf_gap
        return loss, p_within

    @property
    def has_geometry(self) -> bool:
        return bool(self.geometry_l1_weight or self.geometry_giou_weight)

    def geometry_sum(self, p_within: torch.Tensor, bins: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted SmoothL1 + (1 - GIoU) of the boxes formed by consecutive groups of four positions."""
        if p_within.shape[0] % 4:
            raise ValueError(
                f"{p_within.shape[0]} trained coordinate positions do not form whole boxes; every target "
                "box must be trained with one weight on all four coordinates"
            )
        scale = torch.arange(NUM_BINS, device=p_within.device, dtype=torch.float32) / (NUM_BINS - 1)
        expected = (p_within * scale).sum(-1).view(-1, 4)
        target = (bins.float() / (NUM_BINS - 1)).view(-1, 4)
        box_weights = weights.view(-1, 4)[:, 0]
        smooth_l1 = torch.nn.functional.smooth_l1_loss(
            expected, target, reduction="none", beta=_SMOOTH_L1_BETA
        )
        total = self.geometry_l1_weight * smooth_l1.sum(-1) + self.geometry_giou_weight * (
            1 - giou(expected, target)
        )
        return (total * box_weights).sum()


def gaussian_targets(bins: torch.Tensor, sigma: float) -> torch.Tensor:
    """(N, NUM_BINS) distributions: a Gaussian over bins centred on each bin, normalised (one-hot at 0)."""
    if sigma <= 0:
        return torch.nn.functional.one_hot(bins, NUM_BINS).float()
    grid = torch.arange(NUM_BINS, device=bins.device, dtype=torch.float32)
    density = torch.exp(-0.5 * ((grid[None, :] - bins[:, None].float()) / sigma) ** 2)
    return density / density.sum(-1, keepdim=True)


def giou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Generalised IoU of (N, 4) xyxy boxes; a predicted box with x2 < x1 counts as empty."""
    area_a = (a[:, 2] - a[:, 0]).clamp(min=0) * (a[:, 3] - a[:, 1]).clamp(min=0)
    area_b = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    inter_w = (torch.minimum(a[:, 2], b[:, 2]) - torch.maximum(a[:, 0], b[:, 0])).clamp(min=0)
    inter_h = (torch.minimum(a[:, 3], b[:, 3]) - torch.maximum(a[:, 1], b[:, 1])).clamp(min=0)
    inter = inter_w * inter_h
    union = area_a + area_b - inter
    hull = (torch.maximum(a[:, 2], b[:, 2]) - torch.minimum(a[:, 0], b[:, 0])) * (
        torch.maximum(a[:, 3], b[:, 3]) - torch.minimum(a[:, 1], b[:, 1])
    )
    eps = 1e-7
    return inter / (union + eps) - (hull - union) / (hull + eps)
