"""DESIGN §5: the step loss is sum(w*ce)/sum(w) over all micro-steps, so neither packing, nor the split
into micro-steps, nor extra rows in a micro-step change the gradient."""

from __future__ import annotations

import pytest
import torch

from rollmatch.collectives import LocalCollectives
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import load_records
from rollmatch.detection.object_formats import build_codec
from rollmatch.training.channel_modes import WindowRows
from rollmatch.training.rows import RowPlanner
from rollmatch.training.segment_producers import GTSegmentProducer
from rollmatch.training.step import ConstantSchedule, StepPlanner


def _step_gradient(train_plan, model, cfg, encoder, records, split, packing, row_tokens=1024):
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    rows = RowPlanner(
        packing=packing, packing_length=row_tokens, carry_limit=16, pad_token_id=encoder.pad_token_id
    )
    planner = StepPlanner(
        schedule=ConstantSchedule("A"),
        channel_a=WindowRows(GTSegmentProducer(model, encoder, codec, cfg).produce, rows),
        channel_b=None,
        sync=None,
        collectives=LocalCollectives(),
        report_ab=False,
    )
    windows, start = [], 0
    for n in split:
        windows.append(records[start : start + n])
        start += n
    plan = planner.plan(windows, global_step=0, final=True)
    model.zero_grad()
    train_plan(model, plan)
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()
    return grads, plan


@pytest.mark.parametrize("packing", [False, True])
def test_micro_step_split_and_packing_do_not_change_gradients(
    train_plan, loaded_tiny, tiny_model_dir, make_config, packing
):
    model, _ = loaded_tiny
    cfg = make_config()
    encoder = PromptEncoder.from_pretrained(str(tiny_model_dir), cfg.data)
    records = load_records(cfg.data.train_jsonl)[:3]
    reference, _ = _step_gradient(train_plan, model, cfg, encoder, records, split=[3], packing=False)
    split, _ = _step_gradient(train_plan, model, cfg, encoder, records, split=[1, 2], packing=packing)
    model.zero_grad()
    assert torch.allclose(split, reference, rtol=1e-4, atol=1e-7)


def test_a_micro_batch_larger_than_a_row_trains_extra_rows_with_the_same_gradient(
    train_plan, loaded_tiny, tiny_model_dir, make_config
):
    # Rows that hold about one segment each: the micro-batch of 3 needs 3 rows in its micro-step.
    model, _ = loaded_tiny
    cfg = make_config()
    encoder = PromptEncoder.from_pretrained(str(tiny_model_dir), cfg.data)
    records = load_records(cfg.data.train_jsonl)[:3]
    reference, _ = _step_gradient(train_plan, model, cfg, encoder, records, split=[3], packing=False)
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    lengths = sorted(
        s.length for s in GTSegmentProducer(model, encoder, codec, cfg).produce(records, 0).segments
    )
    assert lengths[0] + lengths[1] > lengths[-1] + 1  # no two segments share a row
    packed, plan = _step_gradient(
        train_plan, model, cfg, encoder, records, split=[3], packing=True, row_tokens=lengths[-1] + 1
    )
    model.zero_grad()
    assert [len(m.rows) for m in plan.micro_steps] == [3]
    assert plan.sums["packing/rows"] == 3
    assert torch.allclose(packed, reference, rtol=1e-4, atol=1e-7)
