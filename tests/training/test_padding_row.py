"""The padding row a rank trains when it has fewer rows than the step: it must train nothing."""

from __future__ import annotations

import torch

from rollmatch.packing.collate import pack_row
from rollmatch.packing.segment import Segment
from rollmatch.training.losses import weighted_ce_sum
from rollmatch.training.rows import padding_row


def _segment_with_unlikelihood(length: int = 6) -> Segment:
    return Segment(
        sample_id="fp-record",
        input_ids=torch.arange(length, dtype=torch.long) + 3,
        weights=torch.ones(length),
        pixel_values=None,
        image_grid_thw=None,
        mm_token_type_ids=torch.zeros(length, dtype=torch.long),
        position_ids=torch.arange(length).expand(3, -1).clone(),
        unlikelihood_weights=torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 0.0]),
    )


def test_padding_row_trains_no_unlikelihood_term() -> None:
    segment = _segment_with_unlikelihood()
    (padding,) = padding_row(segment)
    row = pack_row([padding])
    logits = torch.randn(1, segment.length, 16, requires_grad=True)
    loss = weighted_ce_sum(logits, row["input_ids"], row["weights"], None, row.get("unlikelihood_weights"))
    loss.backward()
    assert float(loss) == 0.0
    assert logits.grad is not None and float(logits.grad.abs().sum()) == 0.0
    assert segment.unlikelihood_weights is not None and float(segment.unlikelihood_weights.sum()) == 2.0, (
        "padding_row must not modify the real segment"
    )
