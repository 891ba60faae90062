"""Loading: defaults, extends chains and cycles, overrides, unknown keys, every problem at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rollmatch.config.load import config_to_yaml, deep_merge, load_config, load_config_dict, parse_overrides
from rollmatch.config.schema import RollmatchConfig
from rollmatch.errors import ConfigError

RM = "custom.extra.rollout_matching"


def test_no_file_gives_schema_defaults() -> None:
    cfg = load_config(None)
    assert cfg == RollmatchConfig()
    assert cfg.rollout.rollout_backend == "vllm"
    assert cfg.rollout.vllm.server.timeout_s == 240.0
    assert cfg.rollout.vllm.server.infer_timeout_s is None
    assert cfg.stage2_ab.channel_b.async_.queue_limit == 8
    assert cfg.training.report_to == ["tensorboard"]


def test_empty_yaml_file_is_an_error(write_yaml) -> None:
    with pytest.raises(ConfigError, match="the file is empty"):  # most likely a wrong or truncated file
        load_config(write_yaml("empty.yaml", ""))


# ------------------------------------------------------------------------------------------ extends
def test_extends_chain_relative_to_each_file(write_yaml) -> None:
    write_yaml(
        "a/root.yaml", {"training": {"max_steps": 1, "seed": 1, "report_to": ["tensorboard", "wandb"]}}
    )
    write_yaml("b/mid.yaml", {"extends": "../a/root.yaml", "training": {"seed": 2}, "model": {"path": "m"}})
    leaf = write_yaml("c/leaf.yaml", {"extends": "../b/mid.yaml", "training": {"report_to": []}})
    cfg = load_config(leaf)
    assert cfg.training.max_steps == 1  # from root
    assert cfg.training.seed == 2  # mid overrides root
    assert cfg.model.path == str(leaf.parent.parent / "b" / "m")  # relative to mid.yaml, which set it
    assert cfg.training.report_to == []  # lists are replaced, not merged


def test_extends_list_merges_in_order(write_yaml) -> None:
    write_yaml("one.yaml", {"training": {"seed": 1, "max_steps": 5}})
    write_yaml("two.yaml", {"training": {"seed": 2}})
    child = write_yaml("child.yaml", {"extends": ["one.yaml", "two.yaml"]})
    cfg = load_config(child)
    assert (cfg.training.seed, cfg.training.max_steps) == (2, 5)


def test_extends_cycle_is_detected(write_yaml) -> None:
    write_yaml("a.yaml", {"extends": "b.yaml"})
    write_yaml("b.yaml", {"extends": "c.yaml"})
    write_yaml("c.yaml", {"extends": "a.yaml"})
    with pytest.raises(ConfigError, match=r"extends cycle: .*a\.yaml -> .*b\.yaml -> .*c\.yaml -> .*a\.yaml"):
        load_config(Path(write_yaml("a.yaml", {"extends": "b.yaml"})))


def test_extends_self_is_a_cycle(write_yaml) -> None:
    with pytest.raises(ConfigError, match="extends cycle"):
        load_config(write_yaml("self.yaml", {"extends": "self.yaml"}))


def test_missing_base_names_the_extending_file(write_yaml) -> None:
    child = write_yaml("child.yaml", {"extends": "nope.yaml"})
    with pytest.raises(ConfigError) as info:
        load_config(child)
    (problem,) = info.value.problems
    assert problem.key == "extends" and problem.value == "nope.yaml"
    assert "file not found" in problem.fix and "child.yaml" in problem.fix


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("training: {max_steps: [\n", "not valid YAML"),
        ("training:\n  seed: 1\n  seed: 2\n", "duplicate key 'seed'"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("extends: 5\n", "extends is a file path"),
    ],
    ids=["syntax", "duplicate-key", "not-a-mapping", "bad-extends"],
)
def test_bad_files(write_yaml, text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(write_yaml("bad.yaml", text))


def test_extends_not_allowed_in_dict() -> None:
    with pytest.raises(ConfigError, match="load_config"):
        load_config_dict({"extends": "base.yaml"})


def test_deep_merge_semantics() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "d": {"e": 1}}
    top = {"a": {"c": [3]}, "d": None}
    assert deep_merge(base, top) == {"a": {"b": 1, "c": [3]}, "d": None}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": {"e": 1}}  # inputs untouched


# ---------------------------------------------------------------------------------------- overrides
def test_overrides_parse_as_yaml_values(write_yaml) -> None:
    path = write_yaml("c.yaml", {"training": {"max_steps": 3, "report_to": ["tensorboard"]}})
    cfg = load_config(
        path,
        [
            "training.max_steps=10",
            "training.report_to=[]",
            "training.learning_rate=0.001",
            "training.packing=true",
            "data.val_jsonl=null",
            f"{RM}.decoding.temperature=0.7",
            "model.lora.target_modules=[q_proj,v_proj]",
        ],
    )
    assert cfg.training.max_steps == 10
    assert cfg.training.report_to == []
    assert cfg.training.learning_rate == pytest.approx(0.001)
    assert cfg.training.packing is True
    assert cfg.data.val_jsonl is None
    assert cfg.rollout.decoding.temperature == 0.7
    assert cfg.model.lora.target_modules == ["q_proj", "v_proj"]


def test_server_url_list_override() -> None:
    layer, problems = parse_overrides([f"{RM}.vllm.server.base_url=[http://a,http://b]"])
    assert problems == []
    assert layer == {
        "custom": {
            "extra": {"rollout_matching": {"vllm": {"server": {"base_url": ["http://a", "http://b"]}}}}
        }
    }


def test_later_override_wins() -> None:
    assert load_config(None, ["training.seed=1", "training.seed=2"]).training.seed == 2


def test_unknown_override_key(problems_of) -> None:
    problem = problems_of({}, ["training.max_step=10"]).only("training.max_step")
    assert problem.value == 10
    assert "unknown key; did you mean training.max_steps?" in problem.fix
    assert "override `training.max_step=10`" in problem.fix


def test_unknown_override_section(problems_of) -> None:
    problem = problems_of({}, ["trainig.seed=1"]).only("trainig")
    assert "did you mean training?" in problem.fix and "override `trainig.seed=1`" in problem.fix


@pytest.mark.parametrize("text", ["training.max_steps", "=3", "training..seed=1", "training.seed x=1"])
def test_malformed_override(problems_of, text: str) -> None:
    (problem,) = problems_of({}, [text])
    assert problem.value == text and "dotted.key=VALUE" in problem.fix


def test_override_with_wrong_type_names_key_and_type(problems_of) -> None:
    problem = problems_of({}, ["training.max_steps=ten"]).only("training.max_steps")
    assert problem.value == "ten" and "valid integer" in problem.fix and "expected int" in problem.fix


# ------------------------------------------------------------------------------------- unknown keys
def test_unknown_key_did_you_mean_in_section(problems_of) -> None:
    problem = problems_of({"matching": {"iou_treshold": 0.3}}).only("matching.iou_treshold")
    assert problem.value == 0.3 and problem.fix == "unknown key; did you mean matching.iou_threshold?"


def test_unknown_key_did_you_mean_other_section(problems_of) -> None:
    problem = problems_of({"max_steps": 5}).only("max_steps")
    assert "did you mean training.max_steps?" in problem.fix


def test_unknown_key_without_close_match_lists_valid_keys(problems_of) -> None:
    problem = problems_of({"loss": {"zzz": 1}}).only("loss.zzz")
    assert "valid keys here: target, prefix_weight, desc_weight" in problem.fix


def test_unknown_key_under_alias_and_list(problems_of) -> None:
    problems = problems_of(
        {
            "stage2_ab": {"channel_b": {"async": {"queue_limt": 3}}},
            RM.split(".")[0]: {
                "extra": {
                    "rollout_matching": {
                        "vllm": {
                            "server": {"servers": [{"base_url": "http://a:1", "group_port": 1, "port": 2}]}
                        }
                    }
                }
            },
        }
    )
    assert (
        "stage2_ab.channel_b.async.queue_limit" in problems.only("stage2_ab.channel_b.async.queue_limt").fix
    )
    assert "group_port" in problems.only(f"{RM}.vllm.server.servers[0].port").fix


def test_union_type_error_is_one_problem(problems_of) -> None:
    problem = problems_of(
        {"custom": {"extra": {"rollout_matching": {"vllm": {"server": {"group_port": "x"}}}}}}
    ).only(f"{RM}.vllm.server.group_port")
    assert problem.value == "x" and "int | list[int] | null" in problem.fix


# ----------------------------------------------------------------------------------- all at once
def test_every_problem_is_reported_at_once(problems_of) -> None:
    data = {
        "custom": {
            "trainer_variant": "stage2_ab_training",
            "extra": {
                "rollout_matching": {"top_p": 0.9, "vllm": {"mode": "sever", "gpu_memory_utilization": 2.0}}
            },
        },
        "stage2_ab": {"channel_b": {"enable_pipeline": True}},
        "matching": {"iou_treshold": 0.3},
        "training": {"max_steps": "ten"},
    }
    problems = problems_of(data, ["model.lora.r=0"])
    assert set(problems.keys()) >= {
        f"{RM}.top_p",  # legacy
        f"{RM}.vllm.mode",  # pydantic literal
        "matching.iou_treshold",  # unknown key
        "training.max_steps",  # pydantic type
        "model.lora.r",  # pydantic range, from an override
        "stage2_ab.schedule.b_ratio",  # rule, still checked although fields failed
        f"{RM}.vllm.gpu_memory_utilization",  # rule
        "stage2_ab.channel_b.enable_pipeline",  # rule
    }
    message = str(ConfigError(list(problems)))
    assert f"({len(problems)} problem(s))" in message and "iou_threshold" in message


def test_resolved_yaml_round_trips() -> None:
    cfg = load_config(None, ["training.max_steps=7", "stage2_ab.channel_b.async.queue_limit=3"])
    text = config_to_yaml(cfg)
    assert "async:" in text and "async_" not in text  # the YAML spelling of the alias
    assert load_config_dict(yaml.safe_load(text)) == cfg
