"""``rollmatch export``: a LoRA checkpoint of a real (tiny) run becomes a folder that transformers
loads with the merged weights, whose model card carries the checkpoint's eval figures, and that the
in-process vLLM engine serves: it answers a detection prompt the project's parser reads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rollmatch.cli import main
from rollmatch.errors import ConfigError


def test_export_refuses_a_folder_without_weights(tmp_path: Path) -> None:
    from rollmatch.models.export import export_checkpoint

    with pytest.raises(ConfigError, match=r"neither config\.json"):
        export_checkpoint(tmp_path, tmp_path / "out")


@pytest.mark.heavy
def test_lora_checkpoint_round_trip(make_config, shapes_small: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForImageTextToText

    from rollmatch.config.schema import DataConfig
    from rollmatch.data.prompts import PromptEncoder
    from rollmatch.data.records import load_records
    from rollmatch.detection.object_formats import build_codec
    from rollmatch.training.entry import run_training

    cfg = make_config(
        {
            "custom": {"trainer_variant": "sft"},
            "model": {"lora": {"enabled": True}},
            "training": {"max_steps": 2, "save_steps": 2, "eval_strategy": "steps", "eval_steps": 2},
            "eval": {"max_samples": 2},
        }
    )
    result = run_training(cfg)
    checkpoint = Path(result.output_dir) / "checkpoint-2"
    assert (checkpoint / "adapter_config.json").is_file()
    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0

    card = (out / "README.md").read_text()
    assert "LoRA adapters merged" in card and "| eval/f1 |" in card
    exported = dict(AutoModelForImageTextToText.from_pretrained(out).named_parameters())
    final = dict(AutoModelForImageTextToText.from_pretrained(result.final_model_dir).named_parameters())
    assert exported.keys() == final.keys() and not any("lora" in name for name in exported)
    for name, tensor in final.items():
        assert torch.equal(exported[name], tensor), name

    encoder = PromptEncoder.from_pretrained(out, DataConfig(coord_frame="norm1000"))
    assert encoder.tokenizer.chat_template  # the chat template travels with the folder
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM not installed: the serving half of the round trip needs it")
    from rollmatch.rollout.types import Decoding
    from rollmatch.rollout.vllm_engine import VllmEngine
    from rollmatch.rollout.vllm_settings import VllmEngineSettings

    record = load_records(shapes_small["val"], max_samples=1)[0]
    encoded = encoder.encode(record)
    engine = VllmEngine(
        VllmEngineSettings(
            model_dir=str(out), enforce_eager=True, kv_cache_space_gib=0.25, max_model_len=1024
        )
    )
    try:
        (output,) = engine.generate([encoded.to_request()], Decoding(max_new_tokens=24), seed=0)
    finally:
        engine.close()
    assert output.token_ids
    codec = build_codec("qwen_json", encoder.tokenizer, [encoder.eos_token_id])
    parsed = codec.parse(
        output.token_ids,
        extent=encoder.frame_extent(encoded),
        hit_max_tokens=output.finish_reason == "length",
    )
    # A 2-step tiny model answers noise: the parser reads it (objects or the reason it is invalid).
    assert parsed.response_text.strip() and isinstance(parsed.objects, list)
    assert parsed.objects or parsed.invalid or not parsed.has_complete_element
