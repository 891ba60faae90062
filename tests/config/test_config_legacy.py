"""Legacy spellings: moved / removed keys are problems naming the new key; the old stage2_ab spot warns."""

from __future__ import annotations

import warnings

import pytest

from rollmatch.config.load import load_config, load_config_dict
from rollmatch.errors import ConfigError

RM = "custom.extra.rollout_matching"


@pytest.mark.parametrize(("key", "value"), [("temperature", 0.7), ("top_p", 0.9), ("top_k", 20)])
def test_decoding_keys_moved(problems_of, key: str, value: float) -> None:
    problem = problems_of({"custom": {"extra": {"rollout_matching": {key: value}}}}).only(f"{RM}.{key}")
    assert problem.value == value
    assert f"moved to {RM}.decoding.{key}" in problem.fix


def test_decoding_keys_moved_also_from_overrides(problems_of) -> None:
    problem = problems_of({}, [f"{RM}.temperature=0.5"]).only(f"{RM}.temperature")
    assert f"{RM}.decoding.temperature" in problem.fix and "<overrides>" in problem.fix


def test_rollout_buffer_removed(problems_of) -> None:
    problems = problems_of({"custom": {"extra": {"rollout_matching": {"rollout_buffer": {"size": 4}}}}})
    problem = problems.only(f"{RM}.rollout_buffer")
    assert problem.value == {"size": 4}
    assert "removed" in problem.fix and "stage2_ab.channel_b" in problem.fix and "async" in problem.fix
    assert len(problems) == 1, "the removed key must not also be reported as unknown"


def test_schedule_pattern_removed(problems_of) -> None:
    data = {
        "custom": {"trainer_variant": "stage2_ab_training"},
        "stage2_ab": {"schedule": {"pattern": "AAB"}},
    }
    problems = problems_of(data)
    assert "stage2_ab.schedule.b_ratio" in problems.only("stage2_ab.schedule.pattern").fix
    assert problems.only("stage2_ab.schedule.b_ratio").value is None  # and b_ratio is still missing


def test_old_stage2_ab_spelling_is_an_alias_with_warning() -> None:
    data = {
        "custom": {
            "trainer_variant": "stage2_ab_training",
            "extra": {"stage2_ab": {"schedule": {"b_ratio": 0.5}}},
        }
    }
    with pytest.warns(DeprecationWarning, match=r"custom\.extra\.stage2_ab.*top-level `stage2_ab`"):
        cfg = load_config_dict(data)
    assert cfg.stage2_ab.schedule.b_ratio == 0.5


def test_old_stage2_ab_spelling_keeps_legacy_checks(problems_of) -> None:
    data = {"custom": {"extra": {"stage2_ab": {"schedule": {"pattern": "AB"}}}}}
    with pytest.warns(DeprecationWarning):
        problems = problems_of(data)
    assert "b_ratio" in problems.only("stage2_ab.schedule.pattern").fix


def test_both_stage2_ab_spellings_is_a_problem(problems_of) -> None:
    data = {
        "custom": {"extra": {"stage2_ab": {"schedule": {"b_ratio": 0.5}}}},
        "stage2_ab": {"schedule": {"b_ratio": 0.25}},
    }
    problem = problems_of(data).only("custom.extra.stage2_ab")
    assert "keep only `stage2_ab`" in problem.fix and "<dict>" in problem.fix


def test_both_spellings_in_different_files_fail_naming_both(write_yaml) -> None:
    # The deprecated spelling in a child would silently override the base's `stage2_ab` on merge.
    base = write_yaml(
        "base.yaml", {"stage2_ab": {"schedule": {"b_ratio": 0.25}, "channel_b": {"mode": "micro"}}}
    )
    child = write_yaml(
        "child.yaml",
        {
            "extends": "base.yaml",
            "custom": {
                "trainer_variant": "stage2_ab_training",
                "extra": {"stage2_ab": {"schedule": {"b_ratio": 0.75}}},
            },
        },
    )
    with pytest.raises(ConfigError) as info:
        load_config(child)
    (problem,) = [p for p in info.value.problems if p.key == "custom.extra.stage2_ab"]
    assert f"(deprecated spelling, in {child.resolve()})" in problem.fix
    assert f"`stage2_ab` (in {base.resolve()})" in problem.fix


def test_both_spellings_across_a_file_and_the_overrides_fail(write_yaml) -> None:
    path = write_yaml("c.yaml", {"stage2_ab": {"schedule": {"b_ratio": 0.25}}})
    with pytest.raises(ConfigError, match=r"custom\.extra\.stage2_ab.*<overrides>.*c\.yaml"):
        load_config(path, ["custom.extra.stage2_ab.schedule.b_ratio=0.5"])


def test_new_spelling_warns_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config_dict({"stage2_ab": {"schedule": {"b_ratio": 0.5}}})
