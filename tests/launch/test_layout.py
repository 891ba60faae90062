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
    launch_overrides,
    parse_devices,
    request_problems,
    server_hosts,
    with_settings,
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


@pytest.fixture
def launched(config: Callable[..., LaunchConfig]) -> Callable[..., list[Any]]:
    """Every problem of a launch as ``rollmatch launch`` finds them: the flags that name a ``launch.*``
    key (``server_devices=(0, 1)``, ``tensor_parallel_size=2``, ...) are overrides of the config, so
    the config's rules judge them with the launcher's own checks (``--cpu``, roles, the machine's
    devices, the runtime rules), all at once; a field error is returned when the config loads."""

    def problems(
        *overrides: str,
        sections: dict[str, Any] | None = None,
        device_count: int | None = None,
        visible_devices: str | None = None,
        cpu: bool = False,
        servers_only: bool = False,
        learner_only: bool = False,
        **flags: Any,
    ) -> list[Any]:
        try:
            launch = config(*overrides, *launch_overrides(flags), **(sections or {}))
        except ConfigError as error:
            return list(error.problems)
        request = with_settings(
            LaunchRequest(config="cfg.yaml", cpu=cpu, servers_only=servers_only, learner_only=learner_only),
            launch.cfg.launch,
        )
        return request_problems(
            request,
            launch.cfg,
            launch.named_servers,
            device_count=device_count,
            visible_devices=visible_devices,
        )

    return problems


def test_six_plus_two_gpus_with_tp2_give_three_servers_and_two_learner_ranks(config, launched):
    launch = config()
    assert launched(device_count=8, **GPU_6_2) == []
    layout = derive_layout(LaunchRequest(config="c", **GPU_6_2), launch.cfg)
    assert layout.server_devices == ((0, 1), (2, 3), (4, 5))
    assert layout.learner_devices == (6, 7) and layout.learner_procs == 2
    assert not layout.on_cpu and layout.num_servers == 3


def test_server_tensor_parallel_size_defaults_to_1_not_the_colocated_engines(config, launched):
    launch = config()  # vllm.tensor_parallel_size keeps its colocate default (4): not the servers'
    request = {"server_devices": (0, 1, 2, 3, 4, 5), "learner_devices": (6, 7)}
    assert launched(**request) == []
    assert derive_layout(LaunchRequest(config="c", **request), launch.cfg).num_servers == 6


def test_tensor_parallel_size_from_the_launch_section_must_divide_the_flag_devices(config, launched):
    """One rule for the key and its flag: `--server-devices` is `launch.server_devices`."""
    request = {"server_devices": (0, 1, 2, 3, 4, 5), "learner_devices": (6, 7)}
    [problem] = launched("launch.tensor_parallel_size=4", **request)
    assert problem.key == "launch.server_devices"
    assert "6 device(s) do not split into servers of launch.tensor_parallel_size 4" in problem.fix
    [flag] = launched(tensor_parallel_size=4, **request)  # the flag, the same rule and message
    assert (flag.key, flag.fix) == (problem.key, problem.fix)
    launch = config("launch.tensor_parallel_size=4")
    assert derive_layout(LaunchRequest(config="c", server_devices=(0, 1, 2, 3)), launch.cfg).num_servers == 1


def test_overlapping_device_sets_are_refused_naming_the_shared_device(launched):
    [problem] = launched(server_devices=(0, 1, 2, 3), learner_devices=(3, 4))
    assert problem.key == "launch.learner_devices"
    assert "device(s) [3] are also in launch.server_devices [0, 1, 2, 3]" in problem.fix


def test_devices_that_do_not_exist_are_refused_unless_dry_run(config, launched):
    problems = launched(device_count=4, **GPU_6_2)
    assert [(p.key, p.value) for p in problems] == [
        ("launch.server_devices", [0, 1, 2, 3, 4, 5]),
        ("launch.learner_devices", [6, 7]),
    ]
    assert "device(s) 4,5 do not exist here: this machine has 4 CUDA device(s) (0-3)" in problems[0].fix
    assert launched(device_count=None, **GPU_6_2) == []  # --dry-run skips only this check
    [visible] = launched(device_count=8, visible_devices="0,1,2,3,4,5,6", **GPU_6_2)
    assert "device(s) 7 do not exist here: this shell's CUDA_VISIBLE_DEVICES='0,1,2,3,4,5,6'" in visible.fix


def test_learner_world_size_goes_through_the_trainers_runtime_rules(launched):
    step = {"stage2_ab": {"channel_b": {"mode": "step"}}}
    [problem] = launched(sections=step, **GPU_6_2)
    assert problem.key == "stage2_ab.channel_b.mode" and "world_size=2" in problem.fix
    assert launched(sections=step, server_devices=(0, 1), learner_devices=(2,), tensor_parallel_size=2) == []
    adapter = (
        "custom.extra.rollout_matching.vllm.enable_lora=true",
        "custom.extra.rollout_matching.vllm.sync.mode=adapter",
        "model.lora.enabled=true",
    )
    [problem] = launched(*adapter, cpu=True, learner_procs=2)
    assert problem.key == "custom.extra.rollout_matching.vllm.sync.mode"
    assert launched(*adapter, cpu=True, learner_procs=1) == []


def test_every_problem_is_reported_at_once(launched):
    """The launch keys' problems, the rules' and the launcher's own together, before any start."""
    step = {"stage2_ab": {"channel_b": {"mode": "step"}}}
    keys = launched(
        sections=step,
        device_count=4,
        server_devices=(0, 1, 2),
        learner_devices=(2, 5),
        tensor_parallel_size=2,
    )
    assert [p.key for p in keys] == [
        "launch.learner_devices",  # device 2 is in both sets
        "launch.server_devices",  # 3 devices do not split into TP-2 servers
        "stage2_ab.channel_b.mode",  # step mode with 2 learner ranks
        "launch.learner_devices",  # device 5 does not exist on a 4-GPU machine
    ]
    rest = launched(
        sections=step, device_count=4, server_devices=(0, 1), learner_devices=(2, 5), tensor_parallel_size=2
    )
    assert [p.key for p in rest] == [
        "stage2_ab.channel_b.mode",  # step mode with 2 learner ranks
        "launch.learner_devices",  # device 5 does not exist on a 4-GPU machine
    ]


def test_only_server_mode_configs_that_roll_out_are_launched(launched):
    [colocate] = launched("custom.extra.rollout_matching.vllm.mode=colocate", cpu=True)
    assert colocate.key == "custom.extra.rollout_matching.vllm.mode" and "server" in colocate.fix
    [hf] = launched("custom.extra.rollout_matching.rollout_backend=hf", cpu=True)
    assert hf.value == "rollout_backend=hf"
    [sft] = launched("custom.trainer_variant=sft", cpu=True)
    assert sft.key == "custom.trainer_variant" and "rollmatch train" in sft.fix


def test_flags_must_fit_the_machine_kind(launched):
    cpu = launched(cpu=True, server_devices=(0, 1), tensor_parallel_size=2)
    assert [p.key for p in cpu] == ["launch.server_devices", "launch.tensor_parallel_size"]
    assert "--cpu" in cpu[0].fix and "--cpu" in cpu[1].fix
    gpu = launched(servers=2, learner_procs=2)  # process counts are --cpu's; on GPUs the devices decide
    assert [p.key for p in gpu] == ["launch.server_devices", "launch.learner_devices"]
    [procs] = launched(learner_procs=3, **GPU_6_2)  # beside devices they must match them
    assert procs.key == "launch.learner_procs_per_node" and "learner_procs_per_node: 2" in procs.fix
    assert launched(servers=3, learner_procs=2, **GPU_6_2) == []
    assert launched(servers_only=True, server_devices=(0, 1), tensor_parallel_size=2) == []
    assert launched(learner_only=True, learner_devices=(0,))[0].key.endswith("server.servers")


def test_the_hf_engine_refuses_what_it_cannot_serve(launched):
    [tp] = launched(engine="hf", **GPU_6_2)
    assert tp.key == "launch.engine" and "unsharded" in tp.fix
    lora = ("custom.extra.rollout_matching.vllm.enable_lora=true", "model.lora.enabled=true")
    [adapters] = launched(*lora, engine="hf", cpu=True)
    assert "cannot serve adapters" in adapters.fix


def test_keyed_flags_become_launch_overrides_after_the_configs_own():
    flags = {"server_devices": (0, 1), "learner_devices": None, "tensor_parallel_size": 2, "servers": None}
    assert launch_overrides(
        {**flags, "engine": "hf", "port_base": 8000, "grace_s": 2.5, "learner_procs": 3}
    ) == [
        "launch.server_devices=[0, 1]",
        "launch.tensor_parallel_size=2",
        "launch.learner_procs_per_node=3",
        "launch.engine=hf",
        "launch.port_base=8000",
        "launch.grace_s=2.5",
    ]


def test_cpu_layout_counts_processes():
    from rollmatch.config.schema import RollmatchConfig

    layout = derive_layout(LaunchRequest(config="c", cpu=True, servers=2, learner_procs=3), RollmatchConfig())
    assert layout.on_cpu and layout.server_devices == ((), ()) and layout.learner_procs == 3
    assert layout.tensor_parallel_size == 1  # the schema default (4) is a GPU setting
    only = derive_layout(LaunchRequest(config="c", cpu=True, servers_only=True), RollmatchConfig())
    assert only.num_servers == 1 and only.learner_procs == 0


def test_servers_left_to_the_launcher_or_named_by_host(config, launched):
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
    assert launched(sections={"custom": named.cfg.custom.model_dump(by_alias=True)}, **GPU_6_2) == []


def test_several_named_hosts_must_match_the_server_count(launched):
    servers = [
        {"base_url": "http://10.0.0.1:9000", "group_port": 9001},
        {"base_url": "http://10.0.0.2:9000", "group_port": 9001},
    ]
    named = {"custom": {"extra": {"rollout_matching": {"vllm": {"server": {"servers": servers}}}}}}
    [problem] = launched(sections=named, **GPU_6_2)
    assert "names 2 hosts for 2 server(s) but launch starts 3" in problem.fix
    assert (
        launched(sections=named, server_devices=(0, 1, 2, 3), learner_devices=(6, 7), tensor_parallel_size=2)
        == []
    )


def test_other_config_problems_still_surface_with_servers_left_to_the_launcher(config):
    with pytest.raises(ConfigError) as caught:
        config("training.max_stepz=3")
    assert [p.key for p in caught.value.problems] == ["training.max_stepz"]


@pytest.mark.parametrize(("text", "message"), [("0,x", "comma-separated"), (",", ">= 0")])
def test_device_lists_are_parsed_strictly(text, message):
    with pytest.raises(ValueError, match=message):
        parse_devices(text)
    assert parse_devices("6, 7") == (6, 7)


@pytest.mark.parametrize(
    ("devices", "key"), [((-1,), "launch.server_devices"), ((1, 1), "launch.server_devices")]
)
def test_device_lists_are_judged_by_the_launch_keys_rule(launched, devices, key):
    """Negative or repeated devices: the rule of `launch.server_devices`, whether flag or key set them."""
    problems = launched(server_devices=devices, learner_devices=(6,))
    assert [p.key for p in problems] == [key]
    assert "each once" in problems[0].fix
