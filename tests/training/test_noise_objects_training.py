"""``loss.noise_objects`` in stage-1 SFT on the tiny models: the GT segments hold noise objects after the
real ones with their coordinate positions out of the loss (label -100 in Hugging Face terms), a fresh
deterministic draw per step, and a short run in both object formats whose loss goes down and whose
checkpoint tells evaluation to drop the noise label."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rollmatch.config.run_file import RUN_FILE
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import load_records
from rollmatch.detection.codec import decode_with_offsets
from rollmatch.detection.json_scan import VALUE
from rollmatch.detection.object_formats import build_codec
from rollmatch.evaluation import run_eval
from rollmatch.training.entry import run_training
from rollmatch.training.segment_producers import GTSegmentProducer

SFT = {"custom": {"trainer_variant": "sft"}}


def noise(**kwargs: Any) -> dict[str, Any]:
    return {**SFT, "loss": {"noise_objects": {"enabled": True, **kwargs}}}


def hf_labels(input_ids: torch.Tensor, weights: torch.Tensor) -> list[int]:
    """The labels a Hugging Face loss would take: the token where it is supervised, else -100."""
    return [int(t) if w > 0 else -100 for t, w in zip(input_ids, weights, strict=True)]


def test_gt_segments_hold_noise_objects_whose_coordinates_are_out_of_the_loss(
    loaded_tiny: tuple[Any, Any], tiny_model_dir: Path, make_config
) -> None:
    model, _ = loaded_tiny
    cfg = make_config(noise(pad_to=6, seed=3))
    plain_cfg = make_config(SFT)
    encoder = PromptEncoder.from_pretrained(str(tiny_model_dir), cfg.data)
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    records = load_records(cfg.data.train_jsonl)[:3]
    out = GTSegmentProducer(model, encoder, codec, cfg).produce(records, global_step=0)
    plain = GTSegmentProducer(model, encoder, codec, plain_cfg).produce(records, global_step=0)
    reals = [len(r.objects) for r in records]
    assert out.sums["target/noise_objects"] == sum(max(0, 6 - n) for n in reals) > 0
    for segment, base, real in zip(out.segments, plain.segments, reals, strict=True):
        prompt = _prompt_length(segment, encoder)
        response = segment.input_ids[prompt:].tolist()
        decoded = decode_with_offsets(encoder.tokenizer, response[:-1])
        parse = codec.parse(response, extent=(1000, 1000), hit_max_tokens=False)
        assert [o.label for o in parse.objects].count("noise") == max(0, 6 - real)
        labels = hf_labels(segment.input_ids, segment.weights)[prompt:]
        roles = codec.char_roles(decoded.text)
        # the first noise object's "{" (past the end when the record already has 6 objects)
        noise_from = (
            decoded.text.rfind("{", 0, decoded.text.index('"noise"')) if real < 6 else len(decoded.text)
        )
        for (start, stop), label in zip(decoded.token_spans(), labels[:-1], strict=True):
            coordinate = VALUE in roles[start:stop]
            if start >= noise_from and coordinate:
                assert label == -100, decoded.text[start:stop]  # a noise coordinate: no loss
            elif start >= noise_from:
                assert label != -100, decoded.text[start:stop]  # its label and the list structure: loss
        assert labels[-1] == encoder.eos_token_id
        # the prompt and the real objects are those of plain SFT, up to the token closing the real list
        shared = base.length - 3
        assert _prompt_length(base, encoder) == prompt
        assert torch.equal(segment.input_ids[:shared], base.input_ids[:shared])
        assert torch.equal(segment.weights[:shared], base.weights[:shared])
    again = GTSegmentProducer(model, encoder, codec, cfg).produce(records, global_step=0)
    later = GTSegmentProducer(model, encoder, codec, cfg).produce(records, global_step=1)
    same = [torch.equal(a.input_ids, b.input_ids) for a, b in zip(out.segments, again.segments, strict=True)]
    moved = [torch.equal(a.input_ids, b.input_ids) for a, b in zip(out.segments, later.segments, strict=True)]
    assert all(same) and not all(moved)  # deterministic per (seed, record, step), fresh every step


def _prompt_length(segment: Any, encoder: PromptEncoder) -> int:
    """Where the response starts: just after the last ``<|im_start|>assistant\\n`` of the segment."""
    ids = segment.input_ids.tolist()
    header = encoder.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for start in range(len(ids) - len(header), -1, -1):
        if ids[start : start + len(header)] == header:
            return start + len(header)
    raise AssertionError("no assistant header in the segment")


@pytest.mark.heavy
@pytest.mark.parametrize("fmt", ["qwen_json", "coord_tokens"])
def test_sft_with_noise_objects_trains_and_its_checkpoint_drops_the_noise_label(
    make_config, coord_model_dir: Path, tiny_model_dir: Path, tmp_path: Path, fmt: str
) -> None:
    model = coord_model_dir if fmt == "coord_tokens" else tiny_model_dir
    cfg = make_config(
        {
            **noise(pad_to=8, label_weight=0.5),
            "model": {"path": str(model)},
            "custom": {"trainer_variant": "sft", "object_format": fmt},
            "training": {"max_steps": 8, "learning_rate": 3e-3, "output_dir": str(tmp_path / fmt)},
        }
    )
    result = run_training(cfg)
    history = result.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    assert all(h["target/noise_objects"] > 0 for h in history if "target/noise_objects" in h)
    final = Path(result.final_model_dir)
    saved = json.loads((final / RUN_FILE).read_text())
    assert saved["settings"]["eval.noise_label"] == "noise"
    # evaluated from its own folder with no noise key in the config, the checkpoint drops the noise label
    from rollmatch.config.load import load_config
    from rollmatch.config.run_file import run_layer

    eval_cfg = load_config(
        None,
        [
            f"model.path={final}",
            f"data.val_jsonl={cfg.data.val_jsonl}",
            "custom.extra.rollout_matching.rollout_backend=hf",
        ],
        under=[(str(final / RUN_FILE), run_layer(saved))],
    )
    evaluated = run_eval(eval_cfg, load_records(cfg.data.val_jsonl)[:2], None)
    assert evaluated.noise_label == "noise" and evaluated.num_samples == 2


def test_the_length_scan_counts_the_noise_objects_in_each_target(tiny_model_dir: Path, make_config) -> None:
    """``data.over_length`` judges the target SFT will train: with noise objects, a longer one."""
    from rollmatch.data.record_lengths import record_lengths

    cfg = make_config(noise(count=4))
    encoder = PromptEncoder.from_pretrained(str(tiny_model_dir), cfg.data)
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    records = load_records(cfg.data.train_jsonl)[:3]
    plain = list(record_lengths(records, encoder, codec))
    padded = list(record_lengths(records, encoder, codec, noise=cfg.loss.noise_objects))
    # one noise element with one-digit coordinates: a lower bound of each noise object's tokens
    shortest = len(encoder.tokenizer.encode(', {"bbox_2d": [1, 2, 3, 4], "label": "noise"}'))
    for a, b in zip(plain, padded, strict=True):
        assert a.prompt_tokens == b.prompt_tokens
        assert b.target_tokens >= a.target_tokens + 4 * (shortest - 2)  # the closing token may fuse
