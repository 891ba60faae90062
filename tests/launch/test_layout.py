"""Layout rules: devices -> servers of TP devices, and every refusal before anything starts (pure)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollmatch.errors import ConfigError
from rollmatch.launch.layout import (
    LaunchRequest,
    derive_layout,
    parse_devices,
    request_problems,
    server_hosts,
)
from rollmatch.launch.plan import LaunchConfig, load_launch_config

GPU_6_2 = {"server_devices": (0, 1, 2, 3, 4, 5), "learner_devices": (6, 7), "tensor_parallel_size": 2}


@pytest.fixture
def config(tmp_path: Path, config_writer: Callable[..., Path]) -> Callable[..., LaunchConfig]:
    def load(*overrides: str, **sections: Any) -> LaunchConfig:
        path = config_writer(
            tmp_path / "cfg.yaml",
            model="/ckpt/stage1",
            train_jsonl="/data/train.jsonl",
            output_dir=tmp_path / "out",
            **sections,
        )
        return load_launch_config(str(path), overrides)

    return load


def problems_of(launch: LaunchConfig, device_count: int | None = None, **request: Any) -> list[Any]:
    req = LaunchRequest(config="cfg.yaml", **request)
    return request_problems(req, launch.cfg, launch.named_servers, device_count=device_count)


def test_six_plus_two_gpus_with_tp2_give_three_servers_and_two_learner_ranks(config):
    launch = config()
    assert problems_of(launch, device_count=8, **GPU_6_2) == []
    layout = derive_layout(LaunchRequest(config="c", **GPU_6_2), launch.cfg)
    assert layout.server_devices == ((0, 1), (2, 3), (4, 5))
    assert layout.learner_devices == (6, 7) and layout.learner_procs == 2
    assert not layout.on_cpu and layout.num_servers == 3


def test_server_tensor_parallel_size_defaults_to_1_not_the_colocated_engines(config):
    launch = config()  # vllm.tensor_parallel_size keeps its colocate default (4): not the servers'
    request = {"server_devices": (0, 1, 2, 3, 4, 5), "learner_devices": (6, 7)}
    assert problems_of(launch, **request) == []
    assert derive_layout(LaunchRequest(config="c", **request), launch.cfg).num_servers == 6


def test_tensor_parallel_size_from_the_launch_section_must_divide_the_flag_devices(config):
    launch = config("launch.tensor_parallel_size=4")
    request = {"server_devices": (0, 1, 2, 3, 4, 5), "learner_devices": (6, 7)}
    [problem] = problems_of(launch, **request)
    assert problem.key == "--server-devices"
    assert "6 device(s) do not split into servers of tensor parallel size 4" in problem.fix
    assert "launch.tensor_parallel_size" in problem.fix
    assert derive_layout(LaunchRequest(config="c", server_devices=(0, 1, 2, 3)), launch.cfg).num_servers == 1


def test_overlapping_device_sets_are_refused_naming_the_shared_device(config):
    [problem] = problems_of(config(), server_devices=(0, 1, 2, 3), learner_devices=(3, 4))
    assert problem.key == "--learner-devices"
    assert "device(s) 3 are also in --server-devices 0,1,2,3" in problem.fix


def test_devices_that_do_not_exist_are_refused_unless_dry_run(config):
    launch = config()
    problems = problems_of(launch, device_count=4, **GPU_6_2)
    assert [(p.key, p.value) for p in problems] == [
        ("--server-devices", "0,1,2,3,4,5"),
        ("--learner-devices", "6,7"),
    ]
    assert "device(s) 4,5 do not exist here: this machine has 4 CUDA device(s) (0-3)" in problems[0].fix
    assert problems_of(launch, device_count=None, **GPU_6_2) == []  # --dry-run skips only this check
    req = LaunchRequest(config="c", **GPU_6_2)
    [visible] = request_problems(req, launch.cfg, [], device_count=8, visible_devices="0,1,2,3,4,5,6")
    assert "device(s) 7 do not exist here: this shell's CUDA_VISIBLE_DEVICES='0,1,2,3,4,5,6'" in visible.fix


def test_learner_world_size_goes_through_the_trainers_runtime_rules(config):
    step = config(stage2_ab={"channel_b": {"mode": "step"}})
    [problem] = problems_of(step, **GPU_6_2)
    assert problem.key == "stage2_ab.channel_b.mode" and "world_size=2" in problem.fix
    assert problems_of(step, server_devices=(0, 1), learner_devices=(2,), tensor_parallel_size=2) == []
    adapter = config(
        "custom.extra.rollout_matching.vllm.enable_lora=true",
        "custom.extra.rollout_matching.vllm.sync.mode=adapter",
        "model.lora.enabled=true",
    )
    [problem] = problems_of(adapter, cpu=True, learner_procs=2)
    assert problem.key == "custom.extra.rollout_matching.vllm.sync.mode"
    assert problems_of(adapter, cpu=True, learner_procs=1) == []


def test_every_problem_is_reported_at_once(config):
    launch = config(stage2_ab={"channel_b": {"mode": "step"}})
    problems = problems_of(
        launch, device_count=4, server_devices=(0, 1, 2), learner_devices=(2, 5), tensor_parallel_size=2
    )
    assert [p.key for p in problems] == [
        "--learner-devices",  # device 2 is in both sets
        "--server-devices",  # 3 devices do not split into TP-2 servers
        "stage2_ab.channel_b.mode",  # step mode with 2 learner ranks
        "--learner-devices",  # device 5 does not exist on a 4-GPU machine
    ]


def test_only_server_mode_configs_that_roll_out_are_launched(config):
    [colocate] = problems_of(config("custom.extra.rollout_matching.vllm.mode=colocate"), cpu=True)
    assert colocate.key == "custom.extra.rollout_matching.vllm.mode" and "server" in colocate.fix
    [hf] = problems_of(config("custom.extra.rollout_matching.rollout_backend=hf"), cpu=True)
    assert hf.value == "rollout_backend=hf"
    [sft] = problems_of(config("custom.trainer_variant=sft"), cpu=True)
    assert sft.key == "custom.trainer_variant" and "rollmatch train" in sft.fix


def test_flags_must_fit_the_machine_kind(config):
    launch = config()
    cpu = problems_of(launch, cpu=True, server_devices=(0,), tensor_parallel_size=2)
    assert [p.key for p in cpu] == ["--server-devices", "--tensor-parallel-size"]
    gpu = problems_of(launch, servers=2, learner_procs=2)
    assert [p.key for p in gpu] == ["--servers", "--learner-procs", "--server-devices", "--learner-devices"]
    assert problems_of(launch, servers_only=True, server_devices=(0, 1), tensor_parallel_size=2) == []
    assert problems_of(launch, learner_only=True, learner_devices=(0,))[0].key.endswith("server.servers")


def test_the_hf_engine_refuses_what_it_cannot_serve(config):
    launch = config()
    [tp] = problems_of(launch, engine="hf", **GPU_6_2)
    assert tp.key == "--engine" and "unsharded" in tp.fix
    lora = config("custom.extra.rollout_matching.vllm.enable_lora=true", "model.lora.enabled=true")
    [adapters] = problems_of(lora, engine="hf", cpu=True)
    assert "cannot serve adapters" in adapters.fix


def test_cpu_layout_counts_processes():
    from rollmatch.config.schema import RollmatchConfig

    layout = derive_layout(LaunchRequest(config="c", cpu=True, servers=2, learner_procs=3), RollmatchConfig())
    assert layout.on_cpu and layout.server_devices == ((), ()) and layout.learner_procs == 3
    assert layout.tensor_parallel_size == 1  # the schema default (4) is a GPU setting
    only = derive_layout(LaunchRequest(config="c", cpu=True, servers_only=True), RollmatchConfig())
    assert only.num_servers == 1 and only.learner_procs == 0


def test_servers_left_to_the_launcher_or_named_by_host(config):
    launch = config()
    assert launch.named_servers == []  # validated with a placeholder; the launcher writes them
    assert server_hosts([], 3) == ["127.0.0.1"] * 3
    named = config(
        custom={
            "extra": {
                "rollout_matching": {
                    "vllm": {
                        "server": {"servers": [{"base_url": "http://10.1.2.3:9000", "group_port": 9001}]}
                    }
                }
            }
        }
    )
    assert server_hosts(named.named_servers, 3) == ["10.1.2.3"] * 3
    assert problems_of(named, **GPU_6_2) == []


def test_several_named_hosts_must_match_the_server_count(config):
    servers = [
        {"base_url": "http://10.0.0.1:9000", "group_port": 9001},
        {"base_url": "http://10.0.0.2:9000", "group_port": 9001},
    ]
    launch = config(custom={"extra": {"rollout_matching": {"vllm": {"server": {"servers": servers}}}}})
    [problem] = problems_of(launch, **GPU_6_2)
    assert "names 2 hosts for 2 server(s) but launch starts 3" in problem.fix
    assert (
        problems_of(launch, server_devices=(0, 1, 2, 3), learner_devices=(6, 7), tensor_parallel_size=2) == []
    )


def test_other_config_problems_still_surface_with_servers_left_to_the_launcher(config):
    with pytest.raises(ConfigError) as caught:
        config("training.max_stepz=3")
    assert [p.key for p in caught.value.problems] == ["training.max_stepz"]


@pytest.mark.parametrize(
    ("text", "message"),
    [("0,x", "comma-separated"), ("-1", ">= 0"), ("1,1", "listed twice"), (",", ">= 0")],
)
def test_device_lists_are_parsed_strictly(text, message):
    with pytest.raises(ValueError, match=message):
        parse_devices(text)
    assert parse_devices("6, 7") == (6, 7)
