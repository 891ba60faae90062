"""Losses on coordinate positions (``coord_tokens``): Gaussian soft CE, gate, Wasserstein, geometry,
and packed rows training exactly like separate forwards with them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from float_compare import REASSOCIATION_ULPS, assert_equal_up_to_reassociation, ulps_apart

from rollmatch.config.load import load_config_dict
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import load_records
from rollmatch.detection.coord_tokens import NUM_BINS
from rollmatch.detection.object_formats import build_codec
from rollmatch.models.pretrained import load_pretrained
from rollmatch.packing.collate import model_inputs, pack_row, pad_batch
from rollmatch.training.coord_loss import CoordLoss, gaussian_targets
from rollmatch.training.entry import coord_loss_for
from rollmatch.training.losses import per_segment_ce, weighted_ce_sum
from rollmatch.training.segment_producers import GTSegmentProducer

VOCAB = NUM_BINS + 10  # ids 0..9 are text tokens, 10.. the coordinate tokens
IDS = list(range(10, 10 + NUM_BINS))


def coord(**settings: float) -> CoordLoss:
    return CoordLoss(token_ids=torch.tensor(IDS), **settings)


def peaked_logits(bin_: int, height: float = 8.0) -> torch.Tensor:
    logits = torch.zeros(1, VOCAB)
    logits[0, IDS[bin_]] = height
    return logits


def test_gaussian_targets_sum_to_one_and_peak_at_their_bin() -> None:
    bins = torch.tensor([0, 500, 999])
    for sigma in (0.0, 0.5, 2.0, 20.0):
        q = gaussian_targets(bins, sigma)
        assert torch.allclose(q.sum(-1), torch.ones(3)) and q.argmax(-1).tolist() == [0, 500, 999]
    assert gaussian_targets(bins, 0.0)[1, 500] == 1.0


def test_a_nearer_bin_costs_less() -> None:
    for settings in (
        {"sigma_bins": 2.0},
        {"sigma_bins": 0.0, "w1_weight": 1.0},
        {"sigma_bins": 2.0, "w1_weight": 1.0},
    ):
        loss = coord(**settings)
        costs = [
            float(loss.position_losses(peaked_logits(500), torch.tensor([t]))[0])
            for t in (500, 503, 520, 900)
        ]
        assert costs == sorted(costs) and costs[0] < costs[-1], (settings, costs)


def test_sigma_zero_with_the_gate_is_exactly_cross_entropy() -> None:
    logits = torch.randn(6, VOCAB)
    bins = torch.tensor([0, 3, 500, 998, 999, 42])
    losses, _ = coord(sigma_bins=0.0, gate_weight=1.0).position_losses(logits, bins)
    assert torch.allclose(
        losses, F.cross_entropy(logits, torch.tensor(IDS)[bins], reduction="none"), atol=1e-5
    )


def test_the_gate_term_keeps_mass_on_coordinate_tokens() -> None:
    on_coords = peaked_logits(500)
    leaking = on_coords.clone()
    leaking[0, 3] = 9.0  # most mass on a text token at a coordinate position
    target = torch.tensor([500])
    with_gate, without_gate = coord(gate_weight=1.0), coord(gate_weight=0.0)
    gap = float(
        with_gate.position_losses(leaking, target)[0] - with_gate.position_losses(on_coords, target)[0]
    )
    assert gap > 1.0
    leaking_loss = without_gate.position_losses(leaking, target)[0]
    on_coords_loss = without_gate.position_losses(on_coords, target)[0]
    # Without the gate only the distribution within coordinate tokens counts: the same loss.
    assert ulps_apart(leaking_loss, on_coords_loss) <= REASSOCIATION_ULPS


def test_geometry_is_zero_for_exact_boxes_and_grows_with_the_error() -> None:
    loss = coord(geometry_l1_weight=1.0, geometry_giou_weight=1.0)
    target = torch.tensor([100, 200, 400, 600])
    exact = F.one_hot(target, NUM_BINS).float()
    assert float(loss.geometry_sum(exact, target, torch.ones(4))) == pytest.approx(0.0, abs=1e-6)
    shifted = F.one_hot(target + 30, NUM_BINS).float()
    assert float(loss.geometry_sum(shifted, target, torch.ones(4))) > 0.05
    assert float(loss.geometry_sum(shifted, target, torch.zeros(4))) == 0.0  # weight 0: not trained


def test_weighted_sum_mixes_plain_ce_and_coordinate_losses_by_position() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 5, VOCAB)
    input_ids = torch.tensor([[1, 2, IDS[7], IDS[900], 4]])
    weights = torch.tensor([[0.0, 0.5, 1.0, 2.0, 1.0]])
    loss = coord(sigma_bins=1.5, w1_weight=0.3)
    total = weighted_ce_sum(logits, input_ids, weights, loss)
    text_positions = F.cross_entropy(logits[0, [0, 3]], torch.tensor([2, 4]), reduction="none")
    coords, _ = loss.position_losses(logits[0, [1, 2]], torch.tensor([7, 900]))
    expected = 0.5 * text_positions[0] + 1.0 * text_positions[1] + 1.0 * coords[0] + 2.0 * coords[1]
    assert float(total) == pytest.approx(float(expected), rel=1e-5)


def test_packed_rows_equal_separate_forwards_with_the_coordinate_losses(
    coord_model_dir: Path, shapes_small: dict[str, Path], tmp_path: Path
) -> None:
    cfg = load_config_dict(
        {
            "model": {"path": str(coord_model_dir)},
            "data": {"train_jsonl": str(shapes_small["train"]), "val_jsonl": None},
            "custom": {"trainer_variant": "sft", "object_format": "coord_tokens"},
            "loss": {
                "coord_sigma_bins": 2.0,
                "coord_w1_weight": 0.5,
                "geometry_l1_weight": 1.0,
                "geometry_giou_weight": 1.0,
            },
            "training": {"output_dir": str(tmp_path), "report_to": []},
        }
    )
    encoder = PromptEncoder.from_pretrained(str(coord_model_dir), cfg.data, object_format="coord_tokens")
    codec = build_codec("coord_tokens", encoder.tokenizer, [encoder.eos_token_id])
    model = load_pretrained(cfg).eval()
    segments = (
        GTSegmentProducer(model, encoder, codec, cfg)
        .produce(load_records(cfg.data.train_jsonl)[:3], 0)
        .segments
    )
    loss = coord_loss_for(cfg.loss, codec)
    assert loss is not None and loss.has_geometry
    assert all(any(int(t) in set(codec.coord_ids) for t in s.input_ids) for s in segments)

    row = pack_row(segments)
    packed = per_segment_ce(
        model(**model_inputs(row)).logits, row["input_ids"], row["weights"], row["segment_lengths"], loss
    )
    separate = []
    for segment in segments:
        batch = pad_batch([segment], pad_token_id=0)
        separate.append(
            weighted_ce_sum(model(**model_inputs(batch)).logits, batch["input_ids"], batch["weights"], loss)
        )
    # Sums over each segment's tokens, equal up to reassociation (float_compare): relative to their size.
    assert_equal_up_to_reassociation(packed, separate, "packed vs separate per-segment coordinate loss")
