"""Tiny offline Qwen-VL models: tokenizer, build/reload for every family, forward/backward, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from rollmatch.cli import main as cli_main
from rollmatch.errors import ConfigError
from rollmatch.models.tiny import FAMILIES, SPECIAL_TOKENS, TinySize, build_tiny_model, build_tokenizer

DETECTION_TEXT = (
    '[{"bbox_2d": [12, 345, 999, 1000], "label": "red square"}, '
    '{"bbox_2d": [0, 7, 80, 96], "label": "raccoon"}]'
)


def _image_prompt(processor, size: tuple[int, int] = (224, 224)) -> dict[str, torch.Tensor]:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Detect."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    image = Image.new("RGB", size, (200, 40, 10))
    return processor(text=[text], images=[image], return_tensors="pt")


def test_tokenizer_is_deterministic_and_covers_detection_json() -> None:
    first, second = build_tokenizer(seed=0), build_tokenizer(seed=0)
    assert first.get_vocab() == second.get_vocab()
    assert 1000 <= len(first) <= 2000
    ids = first.encode(DETECTION_TEXT)
    assert first.decode(ids) == DETECTION_TEXT
    tokens = first.convert_ids_to_tokens(ids)
    # Like Qwen's tokenizer: every digit is its own token, JSON punctuation and words are merged.
    assert "9" in tokens and not any(t.strip("Ġ").isdigit() and len(t.strip("Ġ")) > 1 for t in tokens)
    assert {"bbox", "label", '[{"', "Ġsquare"} <= set(tokens)
    assert len(ids) < 0.6 * len(DETECTION_TEXT)  # digits cost one token each, the rest merges


def test_tokenizer_special_tokens_and_chat_template() -> None:
    tokenizer = build_tokenizer()
    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(token) == [tokenizer.convert_tokens_to_ids(token)], token
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    messages = [
        {"role": "user", "content": [{"type": "image", "image": "a.jpg"}, {"type": "text", "text": "Find."}]}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not plain.endswith("<|im_start|>assistant\n")


def test_special_tokens_follow_the_bpe_vocab_for_every_seed() -> None:
    for seed in (0, 1):
        tokenizer = build_tokenizer(seed=seed)
        first_special = len(tokenizer) - len(SPECIAL_TOKENS)
        assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(
            range(first_special, len(tokenizer))
        )
        assert tokenizer.decode(tokenizer.encode(DETECTION_TEXT)) == DETECTION_TEXT


@pytest.mark.parametrize("family", FAMILIES)
def test_build_reload_forward_backward(family: str, tiny_model_dirs: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs[family]
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    processor = AutoProcessor.from_pretrained(model_dir)
    assert model.config.model_type == family
    assert model.dtype == torch.float32
    text_config = model.config.text_config
    head_dim = (
        getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    )
    assert head_dim >= 32 and head_dim % 16 == 0  # vLLM's CPU attention kernels
    assert text_config.vocab_size % 64 == 0 and text_config.vocab_size >= len(processor.tokenizer)
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert sum(p.numel() for p in model.parameters()) < 2_000_000

    batch = _image_prompt(processor)
    assert "mm_token_type_ids" in batch
    image_token_id = model.config.image_token_id
    is_image = batch["input_ids"] == image_token_id
    assert torch.equal(batch["mm_token_type_ids"].bool(), is_image)
    merge = processor.image_processor.merge_size
    assert int(is_image.sum()) == int(batch["image_grid_thw"].prod()) // merge**2 > 16

    model.train()
    out = model(**batch, labels=batch["input_ids"])
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert any(name.startswith("model.visual.") and g.abs().sum() > 0 for name, g in grads.items())
    assert any("language_model" in name and g.abs().sum() > 0 for name, g in grads.items())


def test_patch_size_per_family(tiny_model_dirs: dict[str, Path]) -> None:
    for family, model_dir in tiny_model_dirs.items():
        config = json.loads((model_dir / "processor_config.json").read_text())
        expected = 16 if family == "qwen3_vl" else 14
        assert config["image_processor"]["patch_size"] == expected, family
        processor = AutoProcessor.from_pretrained(model_dir)
        grid = _image_prompt(processor)["image_grid_thw"][0].tolist()
        assert grid == [1, 224 // expected, 224 // expected], family


def test_generate_is_deterministic_and_stops_at_eos(loaded_tiny) -> None:
    model, processor = loaded_tiny
    batch = _image_prompt(processor, size=(320, 200))
    with torch.no_grad():
        first = model.generate(**batch, max_new_tokens=6, do_sample=False)
        second = model.generate(**batch, max_new_tokens=6, do_sample=False)
    assert torch.equal(first, second)
    assert first.shape[1] <= batch["input_ids"].shape[1] + 6
    assert model.generation_config.eos_token_id == processor.tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path) -> None:
    a = build_tiny_model("qwen2_5_vl", tmp_path / "a", seed=3)
    b = build_tiny_model("qwen2_5_vl", tmp_path / "b", seed=3)
    c = build_tiny_model("qwen2_5_vl", tmp_path / "c", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert AutoTokenizer.from_pretrained(a).get_vocab() == build_tokenizer(seed=3).get_vocab()


def test_unknown_family_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="qwen2_vl, qwen2_5_vl, qwen3_vl"):
        build_tiny_model("llava", tmp_path / "x")  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()


def test_make_tiny_model_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli_model"
    assert cli_main(["make-tiny-model", "--family", "qwen3_vl", "--out", str(out), "--seed", "1"]) == 0
    assert str(out) in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_vl"
    assert (out / "tokenizer.json").exists() and (out / "processor_config.json").exists()


def test_size_flags_set_widths_depths_and_rope_theta(tmp_path: Path) -> None:
    flags = ["--text-hidden", "256", "--text-layers", "3", "--text-intermediate", "512"]
    flags += ["--vision-hidden", "96", "--vision-depth", "3", "--rope-theta", "10"]
    out = tmp_path / "sized"
    assert cli_main(["make-tiny-model", "--out", str(out), *flags]) == 0
    config = json.loads((out / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["intermediate_size"]) == (256, 3, 512)
    assert (text["num_attention_heads"], text["num_key_value_heads"]) == (8, 4)  # head_dim stays 32
    assert text["rope_parameters"]["rope_theta"] == 10.0
    assert (vision["hidden_size"], vision["depth"], vision["out_hidden_size"]) == (96, 3, 256)
    model = AutoModelForImageTextToText.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 2_000_000


def test_bad_sizes_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="text_hidden") as caught:
        build_tiny_model("qwen2_5_vl", tmp_path / "x", size=TinySize(text_hidden=100, text_layers=0))
    assert "text_layers" in str(caught.value)


def test_shared_fixtures_cover_every_family(tiny_model_dirs: dict[str, Path], tiny_model_dir: Path) -> None:
    assert tuple(tiny_model_dirs) == FAMILIES
    assert tiny_model_dirs["qwen2_5_vl"] == tiny_model_dir
