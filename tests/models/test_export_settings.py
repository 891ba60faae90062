"""``rollmatch export`` of a LoRA checkpoint: merged weights saved in the base checkpoint's dtype (not
float32), the run's pixel bounds and settings kept, a model card that says how to prompt the model and
read its boxes, and no path of this machine anywhere in the folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from rollmatch.config.run_file import RUN_FILE, write_run_file

SETTINGS = {
    "rollmatch_run_version": 1,
    "trainer_variant": "rollout_matching_sft",
    "objective": "rollout_matching",
    "settings": {
        "custom.object_format": "qwen_json",
        "data.coord_frame": "norm1000",
        "data.prompt": "Detect {labels}.",
        "data.labels": ["couch", "person"],
        "data.prompt_max_labels": None,
        "data.min_pixels": 3136,
        "data.max_pixels": 6272,
        "eval.max_new_tokens": 64,
        "training.seed": 0,
    },
    "coord_tokens": None,
}


def test_lora_export_keeps_the_base_dtype_pixels_and_settings(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from rollmatch.models.export import export_checkpoint

    base = tmp_path / "base-bf16"
    AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(base)
    for name in tiny_model_dir.iterdir():  # the processor and tokenizer files
        if (
            name.suffix in (".json", ".jinja")
            and name.name != "config.json"
            and not (base / name.name).exists()
        ):
            shutil.copy(name, base / name.name)
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    lora = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    )
    checkpoint = tmp_path / "run" / "checkpoint-2"
    lora.save_pretrained(checkpoint)
    write_run_file(checkpoint, SETTINGS)

    out = export_checkpoint(checkpoint, tmp_path / "exported")
    assert json.loads((out / "config.json").read_text()).get("dtype") == "bfloat16"
    exported = AutoModelForImageTextToText.from_pretrained(out, dtype="auto")
    assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}
    processor = json.loads((out / "processor_config.json").read_text())
    assert '"longest_edge": 6272' in json.dumps(processor)
    assert json.loads((out / RUN_FILE).read_text()) == SETTINGS
    card = (out / "README.md").read_text()
    assert (
        "Detect {labels}." in card and "`couch`" in card and "norm1000" in card and "max_pixels 6272" in card
    )
    for file in out.iterdir():
        if file.suffix in (".json", ".md", ".jinja"):
            assert str(tmp_path) not in file.read_text(), file.name
