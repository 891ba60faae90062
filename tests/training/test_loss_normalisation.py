"""DESIGN §5: the step loss is sum(w*ce)/sum(w) over all micro-steps, so neither packing nor the
split into micro-steps changes the gradient."""

from __future__ import annotations

import pytest
import torch

from rollmatch.collectives import LocalCollectives
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import load_records
from rollmatch.detection.codec import build_codec
from rollmatch.packing.collate import model_inputs
from rollmatch.training.channels import GTChannel
from rollmatch.training.losses import weighted_ce_sum
from rollmatch.training.window import RowBuilder, WindowBuilder


def _step_gradient(model, cfg, encoder, records, split: list[int], packing: bool) -> torch.Tensor:
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    channel = GTChannel(model, encoder, codec, cfg)
    rows = RowBuilder(packing=packing, packing_length=1024, carry_limit=16, pad_token_id=encoder.pad_token_id)
    windows = WindowBuilder(producer=channel.produce, rows=rows, collectives=LocalCollectives())
    batches, start = [], 0
    for n in split:
        batches.append(records[start : start + n])
        start += n
    window = windows.build(batches, global_step=0)
    model.zero_grad()
    for batch in window.micro_batches:
        logits = model(**model_inputs(batch)).logits
        (weighted_ce_sum(logits, batch["input_ids"], batch["weights"]) / window.total_weight).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()


@pytest.mark.parametrize("packing", [False, True])
def test_micro_step_split_and_packing_do_not_change_gradients(
    loaded_tiny, tiny_model_dir, make_config, packing
):
    model, _ = loaded_tiny
    cfg = make_config()
    encoder = PromptEncoder.from_pretrained(str(tiny_model_dir), cfg.data)
    records = load_records(cfg.data.train_jsonl)[:3]
    reference = _step_gradient(model, cfg, encoder, records, split=[3], packing=False)
    split = _step_gradient(model, cfg, encoder, records, split=[1, 2], packing=packing)
    model.zero_grad()
    assert torch.allclose(split, reference, rtol=1e-4, atol=1e-7)
