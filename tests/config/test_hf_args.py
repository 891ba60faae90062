"""``training.hf_args``: any HF TrainingArguments field passes through; bad names, duplicates of typed keys,
trainer-controlled fields, wrong types and what transformers refuses all fail when the config loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollmatch.cli import main
from rollmatch.config.hf_args import CONTROLLED, OWNED, training_argument_fields
from rollmatch.config.load import load_config_dict
from rollmatch.config.rules import check_runtime
from rollmatch.training.entry import training_arguments


def test_pass_through_reaches_training_arguments(tmp_path: Path) -> None:
    cfg = load_config_dict(
        {
            "training": {
                "output_dir": str(tmp_path / "out"),
                "dataloader_num_workers": 2,
                "hf_args": {
                    "optim": "adamw_torch",
                    "adam_beta2": 0.95,
                    "run_name": "ablation-7",
                    "torch_compile": False,
                    "save_strategy": "no",
                    "logging_first_step": True,
                },
            }
        }
    )
    args = training_arguments(cfg, 3, use_cpu=True)
    assert (args.optim, args.adam_beta2, args.run_name) == ("adamw_torch", 0.95, "ablation-7")
    assert args.save_strategy == "no" and args.logging_first_step
    # typed keys and controlled fields are set as before
    assert args.dataloader_num_workers == 2 and args.gradient_accumulation_steps == 3
    assert args.remove_unused_columns is False and args.ddp_find_unused_parameters is False


def test_every_table_entry_is_a_real_field() -> None:
    fields = training_argument_fields()
    assert set(OWNED) - {"warmup_ratio"} <= set(fields)  # warmup_ratio: gone from transformers 5
    assert set(CONTROLLED) <= set(fields)


def test_unknown_name_gets_a_suggestion(problems_of) -> None:
    problem = problems_of({"training": {"hf_args": {"adam_beta_2": 0.9}}}).only(
        "training.hf_args.adam_beta_2"
    )
    assert "did you mean training.hf_args.adam_beta2?" in problem.fix


def test_typed_key_duplicate_names_both(problems_of) -> None:
    problem = problems_of({"training": {"hf_args": {"learning_rate": 1e-4}}}).only(
        "training.hf_args.learning_rate"
    )
    assert "training.learning_rate" in problem.fix
    problem = problems_of({"training": {"hf_args": {"bf16": True}}}).only("training.hf_args.bf16")
    assert "training.mixed_precision" in problem.fix


def test_controlled_field_is_refused_with_the_reason(problems_of) -> None:
    problems = problems_of(
        {"training": {"hf_args": {"remove_unused_columns": True, "per_device_eval_batch_size": 4}}}
    )
    assert "step planner" in problems.only("training.hf_args.remove_unused_columns").fix
    assert "eval.batch_size" in problems.only("training.hf_args.per_device_eval_batch_size").fix


def test_wrong_type_and_what_transformers_refuses(problems_of) -> None:
    problem = problems_of({"training": {"hf_args": {"adam_beta2": "high"}}}).only(
        "training.hf_args.adam_beta2"
    )
    assert "valid number" in problem.fix
    problem = problems_of({"training": {"hf_args": {"optim": "adamw_foo"}}}).only("training.hf_args")
    assert "adamw_foo is not a valid OptimizerNames" in problem.fix


def test_check_config_shows_hf_args_problems(write_yaml, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_yaml("c.yaml", {"training": {"hf_args": {"optimizer": "adamw_torch"}}})
    assert main(["check-config", "--schema-only", str(path)]) == 2
    err = capsys.readouterr().err
    assert "training.hf_args.optimizer" in err and "did you mean training.hf_args.optim?" in err


def test_eval_keys(problems_of, tmp_path: Path) -> None:
    problems = problems_of(
        {
            "data": {"val_jsonl": None},
            "training": {"eval_steps": 2, "metric_for_best_model": "eval/F1"},
        }
    )
    assert "data.val_jsonl" in problems.only("data.val_jsonl").fix
    assert "did you mean eval/f1?" in problems.only("training.metric_for_best_model").fix
    problem = problems_of({"training": {"hf_args": {"load_best_model_at_end": True}}}).only(
        "training.metric_for_best_model"
    )
    assert "set training.metric_for_best_model" in problem.fix
    # transformers' own rule, at load: best-model reloading needs checkpoints on evaluation steps
    problem = problems_of(
        {
            "training": {
                "eval_steps": 3,
                "save_steps": 5,
                "metric_for_best_model": "eval/f1",
                "hf_args": {"load_best_model_at_end": True},
            }
        }
    ).only("training.hf_args")
    assert "round multiple of the evaluation steps" in problem.fix
    cfg = load_config_dict(
        {
            "training": {
                "output_dir": str(tmp_path),
                "eval_steps": 2,
                "save_steps": 4,
                "metric_for_best_model": "eval/truncated_frac",
                "hf_args": {"load_best_model_at_end": True},
            }
        }
    )
    args = training_arguments(cfg, 1, use_cpu=True)
    assert (args.eval_strategy, args.eval_steps, args.metric_for_best_model) == (
        "steps",
        2,
        "eval_truncated_frac",
    )
    assert args.greater_is_better is False  # a lower truncated fraction is better


def test_eval_with_a_colocated_engine_over_ranks_is_refused_at_start() -> None:
    cfg = load_config_dict(  # vLLM colocate over 4 ranks
        {
            "training": {"eval_steps": 2},
            "custom": {"extra": {"rollout_matching": {"vllm": {"tensor_parallel_size": 4}}}},
        }
    )
    problems = check_runtime(cfg, world_size=4, device_count=4, device_type="cuda")
    assert any(p.key == "training.eval_strategy" and "rank 0" in p.fix for p in problems)
    assert not any(
        p.key == "training.eval_strategy"
        for p in check_runtime(cfg, world_size=1, device_count=4, device_type="cuda")
    )


# ------------------------------------------------------------------------------------- sharding
def _deepspeed(tmp_path: Path, stage: int) -> str:
    path = tmp_path / f"zero{stage}.json"
    path.write_text(
        json.dumps({"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"})
    )
    return str(path)


def test_zero3_refuses_what_cannot_gather(problems_of, tmp_path: Path) -> None:
    rm = "custom.extra.rollout_matching"
    problems = problems_of(
        {
            "training": {"deepspeed": _deepspeed(tmp_path, 3)},
            "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}},
        }
    )
    assert "ZeRO-3" in problems.only(f"{rm}.rollout_backend").fix
    problems = problems_of(
        {
            "model": {"lora": {"enabled": True}},
            "training": {"deepspeed": _deepspeed(tmp_path, 3)},
            "custom": {
                "extra": {"rollout_matching": {"vllm": {"enable_lora": True, "sync": {"mode": "adapter"}}}}
            },
        }
    )
    assert "full" in problems.only(f"{rm}.vllm.sync.mode").fix
    assert "LoRA" in problems.only("model.lora.enabled").fix
    problems = problems_of(
        {
            "training": {"hf_args": {"fsdp": "full_shard", "fsdp_config": {"version": 2}}},
            "custom": {"extra": {"rollout_matching": {"vllm": {"sleep_level": 2}}}},
        }
    )
    assert "FSDP2" in problems.only(f"{rm}.vllm.sleep_level").fix


def test_supported_sharding_loads(tmp_path: Path) -> None:
    server = {
        "mode": "server",
        "server": {"servers": [{"base_url": "http://127.0.0.1:8000", "group_port": 51216}]},
    }
    load_config_dict(
        {
            "training": {"deepspeed": _deepspeed(tmp_path, 3)},
            "custom": {"extra": {"rollout_matching": {"vllm": server}}},
        }
    )
    load_config_dict(  # ZeRO-2 keeps full parameters: HF generate is fine
        {
            "training": {"deepspeed": _deepspeed(tmp_path, 2)},
            "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}},
        }
    )
    load_config_dict(  # sft without evaluation never exports weights
        {
            "custom": {"trainer_variant": "sft", "extra": {"rollout_matching": {"rollout_backend": "hf"}}},
            "training": {"deepspeed": _deepspeed(tmp_path, 3)},
        }
    )


def test_fsdp1_and_missing_deepspeed_file(problems_of, tmp_path: Path) -> None:
    problem = problems_of(
        {"training": {"hf_args": {"fsdp": "full_shard", "fsdp_config": {"version": 1}}}}
    ).only("training.hf_args.fsdp_config.version")
    assert "FSDP2" in problem.fix
    problem = problems_of({"training": {"deepspeed": str(tmp_path / "missing.json")}}).only(
        "training.deepspeed"
    )
    assert "not found" in problem.fix
