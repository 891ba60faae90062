"""Stage-2 AB configuration: required b_ratio, removed keys, refused combinations, the alias, budgets."""

from __future__ import annotations

import warnings

import pytest
from resolved_runs import resolved_config, unresolved_run

from rollmatch.collectives import LocalCollectives
from rollmatch.config.load import load_config_dict
from rollmatch.config.rules import check_runtime
from rollmatch.config.schema import ChannelBConfig, RollmatchConfig, TrainingConfig
from rollmatch.errors import ConfigError
from rollmatch.training.channel_b.step_mode import rollouts_per_step
from rollmatch.training.variants import BuildContext, build_stage2

STAGE2 = {
    "custom": {
        "trainer_variant": "stage2_ab_training",
        "extra": {"rollout_matching": {"rollout_backend": "hf"}},
    }
}
SERVER = {
    "custom": {
        "trainer_variant": "stage2_ab_training",
        "extra": {
            "rollout_matching": {
                "rollout_backend": "vllm",
                "vllm": {
                    "mode": "server",
                    "server": {"servers": [{"base_url": "http://127.0.0.1:8000", "group_port": 51216}]},
                },
            }
        },
    }
}


def problems_of(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        resolved_config(data)
    return str(info.value)


def test_missing_b_ratio_fails_with_guidance():
    message = problems_of(STAGE2)
    assert "stage2_ab.schedule.b_ratio" in message and "[0, 1]" in message


def test_pattern_is_refused_in_favour_of_b_ratio():
    message = problems_of({**STAGE2, "stage2_ab": {"schedule": {"pattern": ["A", "B"], "b_ratio": 0.5}}})
    assert "stage2_ab.schedule.pattern" in message and "b_ratio" in message


@pytest.mark.parametrize("b_ratio", [-0.01, 1.01])
def test_b_ratio_outside_unit_interval_is_refused(b_ratio):
    assert "b_ratio" in problems_of({**STAGE2, "stage2_ab": {"schedule": {"b_ratio": b_ratio}}})


def test_step_mode_under_two_ranks_points_to_async():
    cfg = resolved_config(
        {**STAGE2, "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "step"}}}
    )
    problems = check_runtime(cfg, world_size=2, device_count=0, device_type="cpu")
    assert [p.key for p in problems] == ["stage2_ab.channel_b.mode"]
    assert "async" in problems[0].fix
    assert check_runtime(cfg, world_size=1, device_count=0, device_type="cpu") == []


def test_training_refuses_step_mode_under_world_size_two(monkeypatch, tmp_path):
    from rollmatch.training.entry import run_training

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = resolved_config(
        {
            **STAGE2,
            "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "step"}},
            "training": {"output_dir": str(tmp_path)},
        }
    )
    with pytest.raises(ConfigError, match=r"stage2_ab\.channel_b\.mode.*async"):
        run_training(cfg)


def test_pipeline_needs_rollout_servers():
    step_pipeline = {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "step", "enable_pipeline": True}}
    message = problems_of({**STAGE2, "stage2_ab": step_pipeline})
    assert "enable_pipeline" in message and "unsafe" in message and "vllm.mode: server" in message
    cfg = resolved_config({**SERVER, "stage2_ab": step_pipeline})
    assert cfg.stage2_ab.channel_b.enable_pipeline


def test_old_section_spelling_is_an_alias_with_a_warning():
    aliased = {
        "custom": {
            "trainer_variant": "stage2_ab_training",
            "extra": {"stage2_ab": {"schedule": {"b_ratio": 0.25}}},
        }
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = resolved_config(aliased)
    assert cfg.stage2_ab.schedule.b_ratio == 0.25
    assert any(issubclass(w.category, DeprecationWarning) and "stage2_ab" in str(w.message) for w in caught)
    both = {**aliased, "stage2_ab": {"schedule": {"b_ratio": 0.5}}}
    assert "custom.extra.stage2_ab" in problems_of(both)


def bare_context(cfg: RollmatchConfig) -> BuildContext:
    # The variant refuses these configs before it touches the model, encoder or backend.
    return BuildContext(
        run=unresolved_run(cfg),
        model=None,
        encoder=None,
        codec=None,
        collectives=LocalCollectives(),
    )


@pytest.mark.parametrize(
    "rollouts",
    [
        {"rollout_backend": "hf"},
        {"rollout_backend": "vllm", "vllm": {"mode": "colocate"}},
    ],
    ids=["hf", "colocate"],
)
def test_async_mode_needs_rollout_servers_at_load_time(rollouts):
    # check-config and train share this verdict: the config never loads.
    config = {
        "custom": {"trainer_variant": "stage2_ab_training", "extra": {"rollout_matching": rollouts}},
        "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "async"}},
    }
    message = problems_of(config)
    assert "stage2_ab.channel_b.mode = 'async'" in message and "vllm.mode: server" in message


def test_async_mode_with_servers_and_full_sync_loads():
    cfg = resolved_config(
        {**SERVER, "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "async"}}}
    )
    assert cfg.stage2_ab.channel_b.mode == "async"
    assert check_runtime(cfg, world_size=2, device_count=0, device_type="cpu") == []


def test_variant_refuses_a_code_built_config_without_b_ratio():
    cfg = RollmatchConfig()
    cfg.custom.trainer_variant = "stage2_ab_training"
    with pytest.raises(ConfigError, match=r"stage2_ab\.schedule\.b_ratio"):  # the one door to a run
        build_stage2(bare_context(cfg))


@pytest.mark.parametrize(
    ("channel_b", "training", "world", "budget"),
    [
        ({}, {"per_device_train_batch_size": 1, "effective_batch_size": 32}, 1, 32),
        # eff 30 with bs 4: GAS = ceil(30 / 4) = 8, so the default budget 32 exceeds the request.
        ({}, {"per_device_train_batch_size": 4, "effective_batch_size": 30}, 1, 32),
        ({}, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3}, 2, 12),
        ({"rollouts_per_step": 5}, {"per_device_train_batch_size": 4}, 1, 5),
    ],
)
def test_rollouts_per_step_default_is_bs_times_world_times_gas(channel_b, training, world, budget):
    t = TrainingConfig(**training)
    assert rollouts_per_step(ChannelBConfig(**channel_b), t, world, t.gradient_accumulation(world)) == budget


def test_async_queue_must_hold_the_packs_the_actor_keeps_ready():
    channel_b = {"mode": "async", "async": {"queue_limit": 2, "prefetch_target_packs": 4}}
    message = problems_of({**SERVER, "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": channel_b}})
    assert "stage2_ab.channel_b.async.prefetch_target_packs = 4" in message and "queue_limit = 2" in message


def test_async_actors_must_keep_a_pack_per_micro_step_ready():
    cfg = load_config_dict(
        {
            **SERVER,
            "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "async"}},
            "training": {"per_device_train_batch_size": 2, "effective_batch_size": 16},
        }
    )
    problems = check_runtime(cfg, world_size=2, device_count=0, device_type="cpu")  # GAS = 16 / (2 * 2) = 4
    assert [p.key for p in problems] == ["stage2_ab.channel_b.async.prefetch_target_packs"]
    assert "gradient_accumulation_steps = 4" in problems[0].fix and ">= 4" in problems[0].fix
    assert check_runtime(cfg, world_size=4, device_count=0, device_type="cpu") == []  # GAS 2 = the default 2
