"""One door to a run: ``rollmatch check-config`` and ``rollmatch train`` refuse and accept alike, because
both resolve the run through ``config.resolved.resolve_run`` (every rule, static and runtime), and
``config/rules.py`` is entered once per run.

The two commands run for real: ``check-config`` through the CLI (its printed problems, or its
``--json``), ``train`` in this process (``training.entry.run_training``), whose resolution is recorded
on its way (the real function, wrapped) and which is stopped right after it, before the model loads.
:data:`REFUSALS` holds one refusing config per rule, static and runtime (a test checks that every
rule in ``config.rules.STATIC_RULES`` refuses one of them), and every config in configs/ is compared
as it stands on this machine.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import yaml

import rollmatch.config.rules as rules_module
import rollmatch.training.entry as entry
from rollmatch.cli import main
from rollmatch.config.load import load_config
from rollmatch.config.resolved import ResolvedRun
from rollmatch.config.rules import STATIC_RULES, check_runtime
from rollmatch.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SERVER = "custom.extra.rollout_matching.vllm.server"
ONE_SERVER = f"{SERVER}.servers=[{{base_url: 'http://127.0.0.1:8000', group_port: 51216}}]"
STAGE2 = ["custom.trainer_variant=stage2_ab_training", "stage2_ab.schedule.b_ratio=0.5"]
HF = ["custom.extra.rollout_matching.rollout_backend=hf"]
SERVER_MODE = ["custom.extra.rollout_matching.vllm.mode=server", ONE_SERVER]
ASYNC = [*STAGE2, *SERVER_MODE, "stage2_ab.channel_b.mode=async"]

# id -> (overrides, learner world size). Each is refused by check-config and train alike.
REFUSALS: dict[str, tuple[list[str], int]] = {
    "b_ratio_required": (["custom.trainer_variant=stage2_ab_training", *HF], 1),
    "freeze_everything": (["training.freeze=[vision_tower,merger,language_model]"], 1),
    "noise_objects_outside_sft": (
        [
            "custom.trainer_variant=rollout_matching_sft",
            "loss.noise_objects.enabled=true",
            "loss.noise_objects.pad_to=4",
        ],
        1,
    ),
    "server_mode_without_servers": (["custom.extra.rollout_matching.vllm.mode=server"], 1),
    "adapter_sync_without_lora": (["custom.extra.rollout_matching.vllm.sync.mode=adapter"], 1),
    "pipeline_without_servers": (
        [*STAGE2, *HF, "stage2_ab.channel_b.mode=step", "stage2_ab.channel_b.enable_pipeline=true"],
        1,
    ),
    "async_without_servers": ([*STAGE2, *HF, "stage2_ab.channel_b.mode=async"], 1),
    "async_queue_below_prefetch": (
        [
            *ASYNC,
            "stage2_ab.channel_b.async.queue_limit=2",
            "stage2_ab.channel_b.async.prefetch_target_packs=4",
        ],
        1,
    ),
    "async_wait_over_collective": ([*ASYNC, "stage2_ab.channel_b.async.max_wait_s=590"], 1),
    "async_on_policy_without_wait": ([*ASYNC, "stage2_ab.channel_b.async.version_window=0"], 1),
    "rollouts_per_step_outside_step_mode": ([*STAGE2, *HF, "stage2_ab.channel_b.rollouts_per_step=4"], 1),
    "offload_under_deepspeed": (
        [
            "custom.extra.rollout_matching.offload.enabled=true",
            "custom.extra.rollout_matching.offload.offload_model=true",
            f"training.deepspeed={REPO / 'configs' / 'recipes' / 'zero2.json'}",
        ],
        1,
    ),
    "min_pixels_above_max": (["data.min_pixels=40000", "data.max_pixels=30000"], 1),
    "supervise_without_prefix_fn": (["loss.matched_prefix=supervise", "loss.target=reordered_gt"], 1),
    "coord_loss_without_coord_tokens": (["loss.coord_w1_weight=0.5"], 1),
    "engine_shorter_than_a_sample": (["custom.extra.rollout_matching.vllm.max_model_len=16"], 1),
    "colocate_key_in_server_mode": (
        [*SERVER_MODE, "custom.extra.rollout_matching.vllm.tensor_parallel_size=2"],
        1,
    ),
    "mixed_precision_over_bf16_weights": (["training.mixed_precision=bf16", "model.dtype=bfloat16"], 1),
    "k_rollouts_greedy": (["custom.extra.rollout_matching.rollouts_per_record=2"], 1),
    "grpo_with_one_rollout": (["loss.objective=grpo"], 1),
    "hf_args_owned_name": (["training.hf_args={lr_scheduler_type: cosine}"], 1),
    "hf_args_transformers_refuses": (["training.hf_args={optim: bogus}"], 1),
    "best_metric_without_eval": (["training.metric_for_best_model=eval/f1"], 1),
    "deepspeed_file_missing": (["training.deepspeed=/nonexistent/zero.json"], 1),
    "launch_devices_twice": (["launch.server_devices=[0,1]", "launch.learner_devices=[1,2]"], 1),
    # the runtime rules, for the world size of the launch
    "adapter_sync_on_two_ranks": (
        [
            "model.lora.enabled=true",
            "custom.extra.rollout_matching.vllm.enable_lora=true",
            "custom.extra.rollout_matching.vllm.sync.mode=adapter",
            *HF,
        ],
        2,
    ),
    "step_mode_on_two_ranks": ([*STAGE2, *HF, "stage2_ab.channel_b.mode=step"], 2),
    "async_prefetch_below_gas": (
        [*ASYNC, "training.effective_batch_size=16", "stage2_ab.channel_b.async.max_wait_s=30"],
        2,
    ),
    # The divergence this door closes: check-config used to pass it, train refused it on 2 ranks.
    "first_push_over_collective_timeout": (
        [*STAGE2, *SERVER_MODE, f"{SERVER}.timeout_s=120", "training.collective_timeout_s=120"],
        2,
    ),
    "colocated_engine_sharded_on_cpu": (["custom.extra.rollout_matching.vllm.tensor_parallel_size=2"], 1),
}


class _Resolved(Exception):
    """Stops ``run_training`` right after its resolution, before anything heavy."""

    def __init__(self, run: ResolvedRun):
        super().__init__("resolved")
        self.run = run


@pytest.fixture
def inputs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Overrides that point a config at a real tiny model and real records (the input checks pass)."""
    from rollmatch.data.shapes import generate_shapes

    paths = generate_shapes(tmp_path_factory.mktemp("door_records"), n_train=4, n_val=2, size=112, seed=0)
    return [
        f"model.path={tiny_model_dir}",
        f"data.train_jsonl={paths['train']}",
        f"data.val_jsonl={paths['val']}",
    ]


@pytest.fixture
def train(
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[[Path, list[str], int], tuple[ResolvedRun | None, set[str]]]:
    """``train``'s verdict: (its resolved run, no problems) or (None, its problems)."""
    resolve = entry.resolve_checked_run

    def recorded(*args: Any, **kwargs: Any) -> Any:
        run, _ = resolve(*args, **kwargs)
        raise _Resolved(run)

    monkeypatch.setattr(entry, "resolve_checked_run", recorded)

    def verdict(config: Path, overrides: list[str], world_size: int) -> tuple[ResolvedRun | None, set[str]]:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        try:
            entry.run_training(load_config(config, overrides))
        except _Resolved as stop:
            return stop.run, set()
        except ConfigError as error:
            return None, {f"{p.key} = {p.shown_value} | {p.fix}" for p in error.problems}
        finally:
            monkeypatch.delenv("WORLD_SIZE")
        raise AssertionError("train neither resolved nor refused")

    return verdict


def check_config(
    capsys: pytest.CaptureFixture[str], config: Path, overrides: list[str], world_size: int
) -> tuple[dict[str, Any] | None, set[str]]:
    """``check-config``'s verdict: (its ``--json`` resolved values, no problems) or (None, its problems)."""
    code = main(["check-config", str(config), *overrides, "--json", "--world-size", str(world_size)])
    out = capsys.readouterr()
    if code == 0:
        return json.loads(out.out)["resolved"], set()
    assert code == 2, out.err
    lines = out.err.splitlines()
    problems = set()
    for i, line in enumerate(lines):
        if line.startswith("  - "):
            problems.add(f"{line[4:]} | {lines[i + 1].strip().removeprefix('fix: ')}")
    assert problems, out.err
    return None, problems


def base_config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"training": {"output_dir": str(tmp_path / "out")}}), encoding="utf-8")
    return path


def test_every_static_rule_refuses_one_of_the_refusals() -> None:
    configs = [load_config(None, overrides) for overrides, _ in REFUSALS.values()]
    silent = [rule.__name__ for rule in STATIC_RULES if not any(rule(cfg) for cfg in configs)]
    assert silent == []
    runtime = [
        check_runtime(load_config(None, overrides), world_size=world, device_count=0, device_type="cpu")
        for overrides, world in REFUSALS.values()
    ]
    assert sum(1 for problems in runtime if problems) >= 5  # every runtime rule above


@pytest.mark.heavy
@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_check_config_and_train_refuse_alike(
    refusal: str, inputs: list[str], train: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    overrides, world_size = REFUSALS[refusal]
    config = base_config(tmp_path)
    checked, check_problems = check_config(capsys, config, [*inputs, *overrides], world_size)
    run, train_problems = train(config, [*inputs, *overrides], world_size)
    assert checked is None and run is None, f"{refusal} passed: check-config {checked}, train {run}"
    assert check_problems == train_problems


@pytest.mark.heavy
@pytest.mark.parametrize(
    "overrides",
    [[], HF, [*STAGE2, *HF], [*ASYNC, "stage2_ab.channel_b.async.max_wait_s=30"]],
    ids=["defaults", "hf", "stage2", "async-servers"],
)
def test_check_config_prints_the_run_train_resolves(
    overrides: list[str], inputs: list[str], train: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = base_config(tmp_path)
    checked, check_problems = check_config(capsys, config, [*inputs, *overrides], 1)
    run, train_problems = train(config, [*inputs, *overrides], 1)
    assert check_problems == train_problems == set()
    assert run is not None and checked is not None
    assert {**run.as_dict(), "resume_from": None} == checked


@pytest.mark.parametrize(
    "config", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.yaml"))
)
def test_every_shipped_config_gets_one_verdict(
    config: str, train: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """As they stand here (their checkpoints and data are elsewhere): refused alike, naming the same problems."""
    from rollmatch.config.launch_rules import launch_world_size

    world_size = launch_world_size(load_config(REPO / config)) or 1
    checked, check_problems = check_config(capsys, REPO / config, [], world_size)
    run, train_problems = train(REPO / config, [], world_size)
    assert check_problems == train_problems
    if run is not None:
        assert {**run.as_dict(), "resume_from": None} == checked


def test_check_config_refuses_the_first_push_over_the_collective_timeout_for_the_launch(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No flag, no WORLD_SIZE: configs/stage2_ab_server.yaml's launch gives the learner 2 ranks."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = REPO / "configs" / "stage2_ab_server.yaml"
    tight = [f"{SERVER}.timeout_s=120", "training.collective_timeout_s=120"]
    assert main(["check-config", "--schema-only", str(config), *tight]) == 2
    err = capsys.readouterr().err
    assert f"{SERVER}.timeout_s = 120" in err and "world_size=2" in err
    assert main(["check-config", "--schema-only", str(config)]) == 0


@contextmanager
def traced_rules() -> Iterator[list[tuple[str, str]]]:
    """(caller file name, function) of every call into config/rules.py from outside it, on this thread."""
    rules_file = Path(rules_module.__file__).resolve()
    entries: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call" or Path(frame.f_code.co_filename).resolve() != rules_file:
            return
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if Path(caller).resolve() != rules_file:
            entries.append((Path(caller).name, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        yield entries
    finally:
        sys.setprofile(None)


@pytest.mark.heavy
def test_rules_are_entered_once_per_run(inputs: list[str], train: Any, tmp_path: Path) -> None:
    """``train`` from the config file to its resolved run: config/rules.py is entered once (``check_run``)."""
    config = base_config(tmp_path)
    with traced_rules() as entries:
        run, problems = train(config, [*inputs, *STAGE2, *HF], 1)
    assert run is not None and problems == set()
    assert Counter(entries) == {("resolved.py", "check_run"): 1}
