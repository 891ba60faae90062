"""Static and runtime cross-field rules: each problem names its key, the value and the replacement."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from resolved_runs import resolve_for, resolved_config

from rollmatch.config.load import load_config_dict
from rollmatch.config.rollout_rules import resolve_sync_mode
from rollmatch.config.rules import check_runtime
from rollmatch.config.schema import ServerConfig, ServerEndpoint
from rollmatch.config.server_rules import resolve_servers
from rollmatch.errors import ConfigError

RM = "custom.extra.rollout_matching"
VLLM = f"{RM}.vllm"
SERVER = f"{VLLM}.server"


def rollout(**rollout_matching: Any) -> dict[str, Any]:
    return {"custom": {"extra": {"rollout_matching": rollout_matching}}}


def server_mode(server: dict[str, Any], **vllm: Any) -> dict[str, Any]:
    return rollout(vllm={"mode": "server", "server": server, **vllm})


SERVERS = {"servers": [{"base_url": "http://127.0.0.1:8000", "group_port": 51216}]}


# -------------------------------------------------------------------------------------------- loss
@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        ({}, "supervise"),
        ({"target": "reordered_gt"}, "none"),
        ({"keep_prefix": "all"}, "none"),
        ({"matched_prefix": "none"}, "none"),
    ],
)
def test_matched_prefix_is_supervised_where_it_applies_unless_set(
    loss: dict[str, Any], expected: str
) -> None:
    assert resolved_config({"loss": loss}).loss.matched_prefix == expected


def test_supervision_set_where_it_cannot_apply_is_refused(problems_of) -> None:
    problem = problems_of({"loss": {"matched_prefix": "supervise", "target": "reordered_gt"}}).only(
        "loss.matched_prefix"
    )
    assert problem.value == "supervise" and "matched_prefix: none" in problem.fix


def test_supervision_after_own_mistakes_is_a_whole_config() -> None:
    loss = resolved_config({"loss": {"matched_prefix": "supervise", "keep_prefix": "all"}}).loss
    assert (loss.keep_prefix, loss.matched_prefix) == ("all", "supervise")


@pytest.mark.parametrize(
    "loss",
    [
        {"fp_unlikelihood_weight": 0.5},  # keep_prefix: matched keeps no false positive
        {"fp_unlikelihood_weight": 0.5, "keep_prefix": "all", "target": "reordered_gt"},
    ],
)
def test_unlikelihood_without_kept_false_positives_is_refused(problems_of, loss: dict[str, Any]) -> None:
    problem = problems_of({"loss": loss}).only("loss.fp_unlikelihood_weight")
    assert problem.value == 0.5 and "keep_prefix: all" in problem.fix


@pytest.mark.parametrize(("key", "value"), [("missed_weight", 0.5), ("fp_unlikelihood_weight", 0.5)])
def test_rollout_loss_knobs_under_sft_are_refused(problems_of, key: str, value: float) -> None:
    loss = {key: value, "keep_prefix": "all", "matched_prefix": "supervise"}
    problems = problems_of({"custom": {"trainer_variant": "sft"}, "loss": loss})
    assert "trainer_variant: rollout_matching_sft" in problems.only(f"loss.{key}").fix


def test_unlikelihood_after_own_mistakes_is_accepted() -> None:
    cfg = resolved_config(
        {"loss": {"keep_prefix": "all", "matched_prefix": "supervise", "fp_unlikelihood_weight": 0.5}}
    )
    assert cfg.loss.fp_unlikelihood_weight == 0.5 and cfg.loss.missed_weight == 1.0


# --------------------------------------------------------------------------------------- stage2_ab
def test_stage2_ab_requires_b_ratio(problems_of) -> None:
    problem = problems_of({"custom": {"trainer_variant": "stage2_ab_training"}}).only(
        "stage2_ab.schedule.b_ratio"
    )
    assert problem.value is None
    assert "stage2_ab_training" in problem.fix and "[0, 1]" in problem.fix


def test_stage2_ab_with_b_ratio_loads() -> None:
    cfg = resolved_config(
        {"custom": {"trainer_variant": "stage2_ab_training"}, "stage2_ab": {"schedule": {"b_ratio": 0.25}}}
    )
    assert cfg.stage2_ab.schedule.b_ratio == 0.25


def test_b_ratio_out_of_range_names_the_key(problems_of) -> None:
    problem = problems_of({"stage2_ab": {"schedule": {"b_ratio": 1.5}}}).only("stage2_ab.schedule.b_ratio")
    assert problem.value == 1.5 and "less than or equal to 1" in problem.fix


def test_pipeline_needs_server_mode(problems_of) -> None:
    data = {"stage2_ab": {"channel_b": {"mode": "step", "enable_pipeline": True}}}
    problem = problems_of(data).only("stage2_ab.channel_b.enable_pipeline")
    assert "unsafe" in problem.fix and f"{VLLM}.mode: server" in problem.fix
    ok = {**server_mode(SERVERS), **data}
    assert resolved_config(ok).stage2_ab.channel_b.enable_pipeline


def test_pipeline_needs_step_mode(problems_of) -> None:
    data = {**server_mode(SERVERS), "stage2_ab": {"channel_b": {"mode": "micro", "enable_pipeline": True}}}
    problem = problems_of(data).only("stage2_ab.channel_b.enable_pipeline")
    assert "stage2_ab.channel_b.mode: step" in problem.fix


@pytest.mark.parametrize(
    "data",
    [
        rollout(rollout_backend="hf"),  # no server
        rollout(vllm={"mode": "colocate"}),
        server_mode(SERVERS, enable_lora=True, sync={"mode": "auto"})
        | {"model": {"lora": {"enabled": True}}},
    ],
    ids=["hf", "colocate", "adapter-sync"],
)
def test_async_needs_server_mode_and_full_sync(problems_of, data: dict[str, Any]) -> None:
    data = {**data, "stage2_ab": {"channel_b": {"mode": "async"}}}
    problem = problems_of(data).only("stage2_ab.channel_b.mode")
    assert problem.value == "async"
    assert f"{VLLM}.mode: server" in problem.fix and f"{VLLM}.sync.mode: full" in problem.fix


@pytest.mark.parametrize("mode", ["micro", "async"])
def test_rollouts_per_step_outside_step_mode_is_refused(problems_of, mode: str) -> None:
    data = {**server_mode(SERVERS), "stage2_ab": {"channel_b": {"mode": mode, "rollouts_per_step": 16}}}
    problem = problems_of(data).only("stage2_ab.channel_b.rollouts_per_step")
    assert problem.value == 16 and "only step mode reads it" in problem.fix
    step = {"stage2_ab": {"channel_b": {"mode": "step", "rollouts_per_step": 16}}}
    assert resolved_config(step).stage2_ab.channel_b.rollouts_per_step == 16


def deepspeed_file(tmp_path: Path, stage: int) -> str:
    path = tmp_path / f"ds_zero{stage}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    return str(path)


def test_step_mode_with_deepspeed_is_refused(problems_of, tmp_path) -> None:
    zero2 = deepspeed_file(tmp_path, 2)
    data = {"stage2_ab": {"channel_b": {"mode": "step"}}, "training": {"deepspeed": zero2}}
    problem = problems_of(data).only("training.deepspeed")
    assert "stage2_ab.channel_b.mode: micro" in problem.fix
    micro = {"stage2_ab": {"channel_b": {"mode": "micro"}}, "training": {"deepspeed": zero2}}
    assert resolved_config(micro).training.deepspeed == zero2


def test_rollout_offload_with_deepspeed_is_refused(problems_of, tmp_path) -> None:
    offload = {"enabled": True, "offload_model": True}
    data = rollout(offload=offload) | {"training": {"deepspeed": deepspeed_file(tmp_path, 2)}}
    problem = problems_of(data).only("training.deepspeed")
    assert "offload.enabled: false" in problem.fix and "rollout_backend: hf" in problem.fix
    # only a colocated engine offloads: with HF rollouts the same keys are fine
    hf = rollout(rollout_backend="hf", offload=offload) | {
        "training": {"deepspeed": deepspeed_file(tmp_path, 2)}
    }
    assert resolved_config(hf)


def test_min_pixels_above_max_pixels_is_refused_at_load(problems_of) -> None:
    problem = problems_of({"data": {"min_pixels": 50_000, "max_pixels": 40_000}}).only("data.min_pixels")
    assert problem.value == 50_000 and "data.max_pixels (= 40000)" in problem.fix
    assert resolved_config({"data": {"min_pixels": 40_000, "max_pixels": 40_000}})


def test_async_in_server_mode_loads() -> None:
    cfg = resolved_config({**server_mode(SERVERS), "stage2_ab": {"channel_b": {"mode": "async"}}})
    assert cfg.stage2_ab.channel_b.async_.queue_limit == 8


@pytest.mark.parametrize(
    ("wait", "timeout", "most"),
    [
        (20.5, 30.0, 20.0),
        (30.0, 30.0, 20.0),
        (45.0, 30.0, 20.0),
        (599.9, 600.0, 540.0),
        (541.0, 600.0, 540.0),
    ],
)
def test_async_max_wait_leaves_the_collective_timeout_its_margin(
    problems_of, wait: float, timeout: float, most: float
) -> None:
    """A tenth of the collective timeout, at least 10 s: 599.9 s against 600 s would time the vote out."""
    data = {
        **server_mode(SERVERS),
        "stage2_ab": {"channel_b": {"mode": "async", "async": {"max_wait_s": wait}}},
        "training": {"collective_timeout_s": timeout},
    }
    problem = problems_of(data).only("stage2_ab.channel_b.async.max_wait_s")
    assert problem.value == wait and f"training.collective_timeout_s = {timeout:g}" in problem.fix
    assert f"max_wait_s <= {most:g}" in problem.fix
    data["stage2_ab"]["channel_b"]["async"]["max_wait_s"] = most
    assert resolved_config(data).stage2_ab.channel_b.async_.max_wait_s == most


def test_async_on_policy_without_a_wait_is_refused_naming_max_wait_s(problems_of) -> None:
    data = {
        **server_mode(SERVERS),
        "stage2_ab": {"channel_b": {"mode": "async", "async": {"version_window": 0}}},
    }
    problem = problems_of(data).only("stage2_ab.channel_b.async.max_wait_s")
    assert (
        problem.value == 0.0
        and "version_window: 0" in problem.fix
        and "never trains Channel-B" in problem.fix
    )
    data["stage2_ab"]["channel_b"]["async"]["max_wait_s"] = 60.0
    assert resolved_config(data).stage2_ab.channel_b.async_.version_window == 0


# ------------------------------------------------------------------------------------ lora / sync
def test_adapter_sync_needs_enable_lora(problems_of) -> None:
    problem = problems_of(rollout(vllm={"sync": {"mode": "adapter"}})).only(f"{VLLM}.sync.mode")
    assert f"{VLLM}.enable_lora: true" in problem.fix and f"{VLLM}.sync.mode: full" in problem.fix


def test_enable_lora_needs_model_lora(problems_of) -> None:
    problem = problems_of(rollout(vllm={"enable_lora": True})).only(f"{VLLM}.enable_lora")
    assert "model.lora.enabled: true" in problem.fix


@pytest.mark.parametrize(
    ("mode", "enable_lora", "expected"),
    [
        ("full", False, "full"),
        ("full", True, "full"),
        ("auto", False, "full"),
        ("auto", True, "adapter"),
        ("adapter", True, "adapter"),
    ],
)
def test_resolve_sync_mode(mode: str, enable_lora: bool, expected: str) -> None:
    data = rollout(vllm={"sync": {"mode": mode}, "enable_lora": enable_lora}) | {
        "model": {"lora": {"enabled": True}}
    }
    assert resolve_sync_mode(resolved_config(data)) == expected


# ------------------------------------------------------------------------------------ engine memory
@pytest.mark.parametrize("value", [0.0, -0.1, 1.01])
def test_gpu_memory_utilization_range(problems_of, value: float) -> None:
    problem = problems_of(rollout(vllm={"gpu_memory_utilization": value})).only(
        f"{VLLM}.gpu_memory_utilization"
    )
    assert problem.value == value and "(0, 1]" in problem.fix


def test_gpu_memory_utilization_one_is_allowed() -> None:
    assert (
        resolved_config(rollout(vllm={"gpu_memory_utilization": 1.0})).rollout.vllm.gpu_memory_utilization
        == 1.0
    )


def test_max_model_len_below_global_max_length(problems_of) -> None:
    data = {**rollout(vllm={"max_model_len": 1024}), "training": {"global_max_length": 2048}}
    problem = problems_of(data).only(f"{VLLM}.max_model_len")
    assert problem.value == 1024 and "training.global_max_length=2048" in problem.fix
    assert resolved_config({**rollout(vllm={"max_model_len": 2048}), "training": {"global_max_length": 2048}})


# ------------------------------------------------------------------------------------------ servers
def test_both_server_forms(problems_of) -> None:
    server = {**SERVERS, "base_url": "http://127.0.0.1:8001", "group_port": 51217}
    problem = problems_of(server_mode(server)).only(f"{SERVER}.servers")
    assert "keep only `servers`" in problem.fix


def test_legacy_lists_of_different_lengths(problems_of) -> None:
    server = {"base_url": ["http://a:1", "http://b:1"], "group_port": [51216, 51217, 51218]}
    problem = problems_of(server_mode(server)).only(f"{SERVER}.group_port")
    assert problem.value == [51216, 51217, 51218] and "3 group_port(s) for 2 base_url(s)" in problem.fix


def test_legacy_base_url_without_group_port(problems_of) -> None:
    problem = problems_of(server_mode({"base_url": "http://a:1"})).only(f"{SERVER}.base_url")
    assert "group_port" in problem.fix and f"{SERVER}.servers" in problem.fix


def test_legacy_group_port_without_base_url(problems_of) -> None:
    problem = problems_of(server_mode({"group_port": 51216})).only(f"{SERVER}.group_port")
    assert "base_url" in problem.fix


def test_server_mode_without_servers(problems_of) -> None:
    for server in ({}, {"servers": []}):
        problem = problems_of(server_mode(server)).only(f"{SERVER}.servers")
        assert "no rollout server is configured" in problem.fix and "vllm.mode: colocate" in problem.fix


@pytest.mark.parametrize("timeout", [0, -5.0])
def test_timeout_must_be_positive(problems_of, timeout: float) -> None:
    problem = problems_of(server_mode({**SERVERS, "timeout_s": timeout})).only(f"{SERVER}.timeout_s")
    assert problem.value == timeout and "greater than 0" in problem.fix


def test_duplicate_base_url(problems_of) -> None:
    server = {
        "servers": [
            {"base_url": "http://a:8000", "group_port": 1},
            {"base_url": "http://a:8000/", "group_port": 2},
        ]
    }
    problem = problems_of(server_mode(server)).only(f"{SERVER}.servers")
    assert problem.value == "http://a:8000/" and "duplicate" in problem.fix


def test_url_needs_scheme(problems_of) -> None:
    problem = problems_of(server_mode({"servers": [{"base_url": "a:8000", "group_port": 1}]})).only(
        f"{SERVER}.servers"
    )
    assert "http://" in problem.fix


def test_resolve_servers_legacy_int_port_counts_up() -> None:
    cfg = ServerConfig(base_url=["http://a:8000", "http://b:8000", "http://c:8000"], group_port=51216)
    assert resolve_servers(cfg) == [
        ServerEndpoint(base_url="http://a:8000", group_port=51216),
        ServerEndpoint(base_url="http://b:8000", group_port=51217),
        ServerEndpoint(base_url="http://c:8000", group_port=51218),
    ]


def test_resolve_servers_forms() -> None:
    assert resolve_servers(ServerConfig(base_url="http://a:8000", group_port=[9])) == [
        ServerEndpoint(base_url="http://a:8000", group_port=9)
    ]
    preferred = ServerConfig(servers=[ServerEndpoint(base_url="http://a:8000", group_port=7)])
    assert resolve_servers(preferred) == [ServerEndpoint(base_url="http://a:8000", group_port=7)]
    assert resolve_servers(ServerConfig()) == []


def test_resolve_servers_raises_on_bad_pairing() -> None:
    with pytest.raises(ConfigError, match=r"server\.group_port.*2 group_port\(s\) for 1 base_url"):
        resolve_servers(ServerConfig(base_url="http://a:8000", group_port=[1, 2]))


def test_legacy_lists_via_override() -> None:
    cfg = resolved_config(
        server_mode({}),
        [f"{SERVER}.base_url=[http://a:8000,http://b:8000]", f"{SERVER}.group_port=51216"],
    )
    assert [(s.base_url, s.group_port) for s in resolve_servers(cfg.rollout.vllm.server)] == [
        ("http://a:8000", 51216),
        ("http://b:8000", 51217),
    ]


# ------------------------------------------------------------------------------------------ runtime
def test_runtime_adapter_sync_under_several_ranks() -> None:
    for sync in ("adapter", "auto"):
        data = rollout(vllm={"sync": {"mode": sync}, "enable_lora": True, "tensor_parallel_size": 1})
        cfg = load_config_dict(data | {"model": {"lora": {"enabled": True}}})
        assert check_runtime(cfg, world_size=1, device_count=0, device_type="cpu") == []
        (problem,) = check_runtime(cfg, world_size=2, device_count=0, device_type="cpu")
        assert problem.key == f"{VLLM}.sync.mode" and problem.value == sync
        assert f"{VLLM}.sync.mode: full" in problem.fix


def test_runtime_step_mode_under_several_ranks() -> None:
    cfg = load_config_dict(rollout(rollout_backend="hf") | {"stage2_ab": {"channel_b": {"mode": "step"}}})
    assert check_runtime(cfg, world_size=1, device_count=0, device_type="cpu") == []
    (problem,) = check_runtime(cfg, world_size=4, device_count=0, device_type="cpu")
    assert problem.key == "stage2_ab.channel_b.mode" and "stage2_ab.channel_b.mode: async" in problem.fix


def test_runtime_first_push_leaves_the_collective_timeout_its_margin() -> None:
    """Several ranks wait in a collective while rank 0 forms the weight-sync groups of its first push."""
    data = server_mode({**SERVERS, "timeout_s": 240.0})
    data["custom"]["trainer_variant"] = "stage2_ab_training"
    data |= {"stage2_ab": {"schedule": {"b_ratio": 0.5}}, "training": {"collective_timeout_s": 250.0}}
    cfg = load_config_dict(data)
    assert check_runtime(cfg, world_size=1, device_count=0, device_type="cpu") == []
    (problem,) = check_runtime(cfg, world_size=2, device_count=0, device_type="cpu")
    assert problem.key == f"{SERVER}.timeout_s" and problem.value == 240.0
    assert "timeout_s <= 225" in problem.fix and "training.collective_timeout_s = 250" in problem.fix
    data["training"]["collective_timeout_s"] = 600.0  # the defaults: 240 s leaves 360 s
    assert check_runtime(load_config_dict(data), world_size=2, device_count=0, device_type="cpu") == []


def test_runtime_a_failover_push_forms_groups_twice_within_the_collective_timeout() -> None:
    """With min_healthy a push whose group formation failed goes once more to the other servers."""
    two = [{"base_url": f"http://127.0.0.1:{port}", "group_port": port + 1} for port in (8000, 8002)]
    data = server_mode({"servers": two, "timeout_s": 280.0})
    data["custom"]["trainer_variant"] = "stage2_ab_training"
    data |= {"stage2_ab": {"schedule": {"b_ratio": 0.5}}}  # collective_timeout_s 600: margin 60
    assert check_runtime(load_config_dict(data), world_size=2, device_count=0, device_type="cpu") == []
    data["custom"]["extra"]["rollout_matching"]["vllm"]["server"]["min_healthy"] = 1
    (problem,) = check_runtime(load_config_dict(data), world_size=2, device_count=0, device_type="cpu")
    assert problem.key == f"{SERVER}.timeout_s" and problem.value == 280.0
    assert "timeout_s <= 270" in problem.fix and "min_healthy set" in problem.fix


def test_runtime_tensor_parallel_size() -> None:
    cfg = load_config_dict(rollout(vllm={"tensor_parallel_size": 4}))
    (cpu,) = check_runtime(cfg, world_size=1, device_count=0, device_type="cpu")
    assert (
        cpu.key == f"{VLLM}.tensor_parallel_size" and cpu.value == 4 and "tensor_parallel_size: 1" in cpu.fix
    )
    (gpu,) = check_runtime(cfg, world_size=1, device_count=2, device_type="cuda")
    assert "tensor_parallel_size <= 2" in gpu.fix
    assert check_runtime(cfg, world_size=4, device_count=4, device_type="cuda") == []
    (world,) = check_runtime(cfg, world_size=2, device_count=4, device_type="cuda")
    assert "spans 4 learner ranks" in world.fix and "multiple of 4" in world.fix


def test_runtime_tensor_parallel_only_for_colocated_vllm() -> None:
    # stage-1 makes no rollouts: a colocated engine's size is not checked against the devices
    cfg = load_config_dict(
        {**rollout(vllm={"tensor_parallel_size": 4}), "custom": {"trainer_variant": "sft"}}
    )
    assert check_runtime(cfg, world_size=1, device_count=0, device_type="cpu") == []


@pytest.mark.parametrize(
    ("data", "key", "fix"),
    [
        (server_mode(SERVERS, tensor_parallel_size=4), "tensor_parallel_size", "launch.tensor_parallel_size"),
        (server_mode(SERVERS, sleep_level=1), "sleep_level", "never sleeps"),
    ],
    ids=["server-tp", "server-sleep"],
)
def test_an_engine_key_without_effect_in_its_mode_is_refused(
    data: dict[str, Any], key: str, fix: str
) -> None:
    with pytest.raises(ConfigError) as info:
        resolved_config(data)
    (problem,) = [p for p in info.value.problems if p.key == f"{VLLM}.{key}"]
    assert "no effect" in problem.fix and fix in problem.fix


def test_server_mode_takes_the_engine_keys_launch_passes_on() -> None:
    cfg = resolved_config(
        server_mode(SERVERS, gpu_memory_utilization=0.85, max_num_seqs=64, enforce_eager=True)
    )
    assert cfg.rollout.vllm.max_num_seqs == 64
    with pytest.raises(ConfigError, match=r"launch\.engine: hf"):
        resolved_config({**server_mode(SERVERS, max_num_seqs=64), "launch": {"engine": "hf"}})


def test_defaults_run_without_extends_on_one_gpu() -> None:
    """The schema's engine defaults fit one GPU (no tensor parallel 4 on one device), as configs/base.yaml."""
    import yaml

    assert check_runtime(load_config_dict({}), world_size=1, device_count=1, device_type="cuda") == []
    base = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "base.yaml").read_text())
    engine = base["rollout"]["vllm"]  # the short form of custom.extra.rollout_matching
    defaults = load_config_dict({}).rollout.vllm.model_dump()
    assert {k: v for k, v in engine.items() if not isinstance(v, dict)} == {
        k: defaults[k] for k in engine if not isinstance(engine[k], dict)
    }


def test_the_door_raises_every_runtime_problem() -> None:
    data = rollout(vllm={"sync": {"mode": "adapter"}, "enable_lora": True, "tensor_parallel_size": 4}) | {
        "model": {"lora": {"enabled": True}},
        "stage2_ab": {"channel_b": {"mode": "step"}},
    }
    with pytest.raises(ConfigError) as info:
        resolve_for(load_config_dict(data), world_size=2)
    assert sorted(p.key for p in info.value.problems) == sorted(
        [f"{VLLM}.sync.mode", "stage2_ab.channel_b.mode", f"{VLLM}.tensor_parallel_size"]
    )
