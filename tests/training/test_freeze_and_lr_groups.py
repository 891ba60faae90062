"""training.freeze / training.lr_multipliers: module groups of real (tiny) Qwen-VL models, frozen
weights unchanged by training, per-group learning rates as configured, and the config rules."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from resolved_runs import resolved_config

from rollmatch.errors import ConfigError
from rollmatch.training.param_groups import GROUPS, freeze_groups, module_group, optimizer_param_groups


def _load(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir)


def test_module_groups_of_each_family(tiny_model_dirs: dict[str, Path]) -> None:
    for family, model_dir in tiny_model_dirs.items():
        model = _load(model_dir)
        sizes: Counter[str] = Counter()
        for name, param in model.named_parameters():
            sizes[module_group(name)] += param.numel()
        assert set(sizes) == set(GROUPS), family
        assert sum(sizes.values()) == sum(p.numel() for p in model.parameters())
    assert module_group("model.visual.deepstack_merger_list.0.norm.weight") == "merger"
    assert module_group("model.visual.blocks.0.attn.qkv.weight") == "vision_tower"
    assert module_group("model.visual.patch_embed.proj.weight") == "vision_tower"
    assert module_group("lm_head.weight") == "language_model"
    assert module_group("model.language_model.layers.0.mlp.up_proj.weight") == "language_model"


def test_optimizer_groups_carry_the_multiplied_rate(tiny_model_dir: Path) -> None:
    model = _load(tiny_model_dir)
    freeze_groups(model, ["vision_tower"])
    groups = optimizer_param_groups(
        model, learning_rate=1e-3, weight_decay=0.1, multipliers={"merger": 0.25}, no_decay=["lm_head.weight"]
    )
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"language_model", "language_model/no_decay", "merger"}
    assert by_name["merger"]["lr"] == pytest.approx(2.5e-4, rel=1e-12)
    assert by_name["language_model"]["lr"] == pytest.approx(1e-3, rel=1e-12)
    assert by_name["language_model/no_decay"]["weight_decay"] == 0.0
    trained = {id(p) for g in groups for p in g["params"]}
    for name, param in model.named_parameters():
        assert (id(param) in trained) == (module_group(name) != "vision_tower"), name


def test_freeze_and_multipliers_rules() -> None:
    def problems(training: dict, lora: bool = False) -> str:
        with pytest.raises(ConfigError) as info:
            resolved_config({"training": training, "model": {"lora": {"enabled": lora}}})
        return str(info.value)

    assert "freezes every group" in problems({"freeze": ["vision_tower", "merger", "language_model"]})
    assert "training.lr_multipliers.merger" in problems(
        {"freeze": ["merger"], "lr_multipliers": {"merger": 0.1}}
    )
    assert "must be > 0" in problems({"lr_multipliers": {"vision_tower": 0.0}})
    assert "LoRA trains only its adapters" in problems({"freeze": ["vision_tower"]}, lora=True)
    assert "training.freeze" in problems({"freeze": ["visual"]})  # not a group name
    cfg = resolved_config({"training": {"freeze": ["vision_tower"], "lr_multipliers": {"merger": 0.5}}})
    assert cfg.training.freeze == ["vision_tower"] and cfg.training.lr_multipliers == {"merger": 0.5}


@pytest.mark.heavy
def test_training_leaves_frozen_weights_and_uses_group_rates(make_config, tiny_model_dir: Path) -> None:
    from rollmatch.training.entry import run_training

    cfg = make_config(
        {
            "custom": {"trainer_variant": "sft"},
            "training": {
                "max_steps": 3,
                "learning_rate": 1e-3,
                "lr_scheduler_type": "constant",
                "freeze": ["vision_tower"],
                "lr_multipliers": {"merger": 0.25},
                "eval_strategy": "no",
            },
        }
    )
    result = run_training(cfg)
    before = dict(_load(tiny_model_dir).named_parameters())
    after = dict(_load(Path(result.final_model_dir)).named_parameters())
    changed = Counter()
    for name, param in after.items():
        same = torch.equal(param, before[name])
        if module_group(name) == "vision_tower":
            assert same, f"frozen {name} changed"
        changed[module_group(name)] += not same
    assert changed["merger"] > 0 and changed["language_model"] > 0
    logged = [h for h in result.log_history if "loss" in h]
    assert len(logged) == 3
    for entry in logged:
        assert entry["lr/language_model"] == pytest.approx(1e-3, rel=1e-9)
        assert entry["lr/merger"] == pytest.approx(2.5e-4, rel=1e-9)
        assert "lr/vision_tower" not in entry


@pytest.mark.heavy
def test_colocated_vllm_syncs_frozen_weights_once(make_config, tmp_path) -> None:
    pytest.importorskip("vllm")
    from rollmatch.training.entry import run_training

    def pushed_bytes(freeze: list[str]) -> list[float]:
        cfg = make_config(
            {
                "custom": {
                    "extra": {
                        "rollout_matching": {
                            "rollout_backend": "vllm",
                            "vllm": {
                                "mode": "colocate",
                                "tensor_parallel_size": 1,
                                "enforce_eager": True,
                                "kv_cache_space_gib": 0.25,
                            },
                        }
                    }
                },
                "training": {  # one output_dir per run: the second would resume the first's checkpoint
                    "output_dir": str(tmp_path / "-".join(["out", *freeze])),
                    "max_steps": 3,
                    "eval_strategy": "no",
                    "freeze": freeze,
                },
            }
        )
        return [h["sync/bytes"] for h in run_training(cfg).log_history if "sync/bytes" in h]

    everything = pushed_bytes([])
    frozen = pushed_bytes(["vision_tower", "merger"])
    print(f"sync/bytes per step: nothing frozen {everything}; vision tower + merger frozen {frozen}")
    assert len(everything) == len(frozen) >= 2
    assert frozen[0] == everything[0]  # the first push brings every tensor
    assert all(b == everything[0] for b in everything)
    assert all(b < 0.8 * everything[0] for b in frozen[1:])  # later ones leave the frozen groups out
