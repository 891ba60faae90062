"""``rollmatch check-config``: resolved config on stdout (exit 0) or every problem on stderr (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollmatch.cli import main
from rollmatch.config.load import load_config, load_config_dict
from rollmatch.config.rules import check_runtime

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "configs").glob("*.yaml"))


def test_prints_resolved_yaml_with_defaults(write_yaml, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_yaml("c.yaml", {"training": {"max_steps": 3}})
    assert main(["check-config", "--schema-only", str(path), "training.seed=5"]) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out)
    assert resolved["training"]["max_steps"] == 3 and resolved["training"]["seed"] == 5
    assert (
        resolved["custom"]["extra"]["rollout_matching"]["vllm"]["server"]["timeout_s"] == 240.0
    )  # a default
    assert load_config_dict(resolved) == load_config(path, ["training.seed=5"])


def test_json_output(write_yaml, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_yaml("c.yaml", {"stage2_ab": {"channel_b": {"async": {"queue_limit": 3}}}})
    assert main(["check-config", "--schema-only", str(path), "--json"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["stage2_ab"]["channel_b"]["async"]["queue_limit"] == 3


def test_json_output_holds_the_resolved_values(
    write_yaml, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`data.coord_frame: auto` is printed as the frame it resolves to, beside the other resolved values."""
    server = {"base_url": ["http://127.0.0.1:9001", "http://127.0.0.1:9002"], "group_port": 7000}
    path = write_yaml(
        "c.yaml",
        {
            "model": {"path": str(tiny_model_dir)},
            "training": {"effective_batch_size": 8, "per_device_train_batch_size": 2},
            "custom": {
                "extra": {
                    "rollout_matching": {
                        "vllm": {"mode": "server", "server": server},
                        "decoding": {"temperature": 0.7},
                        "max_new_tokens": 300,
                    }
                }
            },
        },
    )
    assert main(["check-config", "--schema-only", str(path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["data"]["coord_frame"] == "auto"  # the config as written
    assert (
        printed["resolved"]
        == {
            "world_size": 1,
            "sync_mode": "full",
            "servers": [  # the legacy form, normalised: group_port + i
                {"base_url": "http://127.0.0.1:9001", "group_port": 7000},
                {"base_url": "http://127.0.0.1:9002", "group_port": 7001},
            ],
            "coord_frame": "pixels",  # the tiny model is a Qwen2.5-VL
            "min_pixels": None,
            "max_pixels": None,
            "gradient_accumulation_steps": 4,
            "rollout_decode_batch_size": None,  # rollout_matching_sft: a micro-batch's records per call
            "resume_from": None,  # training.resume_from_checkpoint: auto, nothing saved yet: step 0
            "decoding": {  # the rollouts' ...
                "temperature": 0.7,
                "top_p": 1.0,
                "top_k": -1,
                "repetition_penalty": 1.0,
                "max_new_tokens": 300,
            },
            "eval_decoding": {  # ... and evaluation's own: greedy, with the rollouts' budget (eval.max_new_tokens null)
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": -1,
                "repetition_penalty": 1.0,
                "max_new_tokens": 300,
            },
        }
    )
    missing = write_yaml("m.yaml", {"model": {"path": str(tmp_path / "not_yet")}})
    assert main(["check-config", "--schema-only", str(missing), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["resolved"]["coord_frame"] == "auto"  # resolved at start


def test_every_problem_on_stderr_exit_2(write_yaml, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_yaml(
        "bad.yaml",
        {"custom": {"trainer_variant": "stage2_ab_training"}, "matching": {"iou_treshold": 0.3}},
    )
    assert main(["check-config", "--schema-only", str(path), "training.max_steps=ten"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "(3 problem(s))" in captured.err
    for key, fix in [
        ("stage2_ab.schedule.b_ratio", "float in [0, 1]"),
        ("matching.iou_treshold", "did you mean matching.iou_threshold?"),
        ("training.max_steps", "valid integer"),
    ]:
        assert key in captured.err and fix in captured.err


STAGE2 = {"custom": {"trainer_variant": "stage2_ab_training"}}


@pytest.mark.parametrize(
    ("channel_b", "training", "key"),
    [
        ({"mode": "step"}, {"deepspeed": "ds.json"}, "training.deepspeed"),
        ({"mode": "async"}, {}, "stage2_ab.channel_b.mode"),  # async without rollout servers
        ({"mode": "micro", "rollouts_per_step": 8}, {}, "stage2_ab.channel_b.rollouts_per_step"),
    ],
    ids=["step-deepspeed", "async-colocate", "rollouts_per_step-micro"],
)
def test_check_config_refuses_what_train_refuses(
    write_yaml, capsys: pytest.CaptureFixture[str], channel_b: dict, training: dict, key: str
) -> None:
    stage2_ab = {"schedule": {"b_ratio": 0.5}, "channel_b": channel_b}
    path = write_yaml("c.yaml", {**STAGE2, "stage2_ab": stage2_ab, "training": training})
    assert main(["check-config", "--schema-only", str(path)]) == 2
    assert f"- {key} = " in capsys.readouterr().err


def test_deprecation_warning_goes_to_stderr(write_yaml, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_yaml("old.yaml", {"custom": {"extra": {"stage2_ab": {"schedule": {"b_ratio": 0.5}}}}})
    assert main(["check-config", "--schema-only", str(path)]) == 0
    captured = capsys.readouterr()
    assert "warning:" in captured.err and "custom.extra.stage2_ab" in captured.err
    assert yaml.safe_load(captured.out)["stage2_ab"]["schedule"]["b_ratio"] == 0.5


def test_installed_cli_subprocess(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("rollmatch")
    assert exe.exists(), f"console script missing: {exe} (pip install -e .)"
    good = subprocess.run(
        [
            str(exe),
            "check-config",
            "--schema-only",
            str(REPO / "configs" / "stage2_ab_server.yaml"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["custom"]["trainer_variant"] == "stage2_ab_training"
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text("training:\n  max_stepz: 3\n", encoding="utf-8")
    bad = subprocess.run(
        [str(exe), "check-config", str(bad_file)], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert "training.max_stepz" in bad.stderr and "did you mean training.max_steps?" in bad.stderr


def test_example_configs_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"base.yaml", "demo_sft.yaml", "demo_rollout.yaml", "stage2_ab_server.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_passes_check_config(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "--schema-only", str(path)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("name", ["demo_sft.yaml", "demo_rollout.yaml"])
def test_demo_configs_run_on_one_cpu_process(name: str) -> None:
    cfg = load_config(REPO / "configs" / name)
    assert cfg.rollout.rollout_backend == "hf"
    assert cfg.rollout.vllm.tensor_parallel_size == 1
    assert cfg.training.global_max_length <= 1024 and cfg.rollout.max_new_tokens <= 256
    assert check_runtime(cfg, world_size=1, device_count=0, device_type="cpu") == []


def test_demo_rollout_continues_from_sft() -> None:
    sft = load_config(REPO / "configs" / "demo_sft.yaml")
    rollout = load_config(REPO / "configs" / "demo_rollout.yaml")
    assert (sft.custom.trainer_variant, rollout.custom.trainer_variant) == ("sft", "rollout_matching_sft")
    # model.path resolves against configs/, output_dir against the working directory (the repository root)
    assert Path(rollout.model.path) == REPO / sft.training.output_dir / "final"


def test_a_healthy_floor_above_the_listed_servers_exits_2_naming_the_key(
    write_yaml, capsys: pytest.CaptureFixture[str]
) -> None:
    """`min_healthy` is checked where the servers are known: the resolved run (check-config, train) and a
    launch's plan (tests/launch/test_plan.py); a config that leaves the list to the launcher loads."""
    server = {"servers": [{"base_url": "http://127.0.0.1:9001", "group_port": 7000}], "min_healthy": 2}
    rollout = {"vllm": {"mode": "server", "server": server}}
    path = write_yaml("c.yaml", {"custom": {"extra": {"rollout_matching": rollout}}})
    assert main(["check-config", "--schema-only", str(path)]) == 2
    err = capsys.readouterr().err
    assert "custom.extra.rollout_matching.vllm.server.min_healthy = 2" in err
    assert "the run has 1 rollout server(s)" in err
    key = "custom.extra.rollout_matching.vllm.server.min_healthy"
    assert main(["check-config", "--schema-only", str(path), f"{key}=1"]) == 0
