"""The async actor-learner end to end: a real ``rollmatch serve`` process and a real 2-rank learner
(``rollmatch train`` in two gloo ranks forked from the test process, ``fork_ranks.py``: what runs across
the ranks is ours, not torchrun's) on 127.0.0.1, ``channel_b.mode: async`` with ``b_ratio: 1.0``.

- B steps actually run, every rank's accounting balances (each pack produced was trained or counted as
  dropped), and the run exits 0 in bounded time;
- fault: the server is killed mid-run; every learner rank exits non-zero within the configured
  timeouts, with a message naming the server.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from fork_ranks import train_in_forked_ranks
from local_ports import free_tcp_port

pytestmark = pytest.mark.heavy
RUN_TIMEOUT_S = 420
SERVER_TIMEOUT_S = 20.0
COLLECTIVE_TIMEOUT_S = 40.0


def async_config(
    tiny_model_dir: Path,
    data: dict[str, Path],
    out: Path,
    url: str,
    group_port: int,
    max_steps: int,
    max_wait_s: float = 0.0,
    gradient_accumulation_steps: int = 1,
    save_steps: int = 1000,
) -> dict[str, Any]:
    return {
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_jsonl": str(data["train"]), "val_jsonl": None},
        "custom": {
            "trainer_variant": "stage2_ab_training",
            "extra": {
                "rollout_matching": {
                    "rollout_backend": "vllm",
                    "max_new_tokens": 12,
                    "decode_batch_size": 2,
                    "vllm": {
                        "mode": "server",
                        "sync": {"mode": "full"},
                        "server": {
                            "servers": [{"base_url": url, "group_port": group_port}],
                            "timeout_s": SERVER_TIMEOUT_S,
                        },
                    },
                }
            },
        },
        "stage2_ab": {
            "schedule": {"b_ratio": 1.0},
            "channel_b": {
                "mode": "async",
                "async": {
                    "queue_limit": 4,
                    "prefetch_target_packs": 2,
                    "version_window": 2,
                    "sync_every_steps": 1,
                    "max_wait_s": max_wait_s,
                    "record_trace": True,
                },
            },
        },
        "preflight": {"records": 0},  # rollout training from an untrained model: no format check
        "training": {
            "output_dir": str(out),
            "per_device_train_batch_size": 1,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "max_steps": max_steps,
            "learning_rate": 1e-3,
            "logging_steps": 1,  # the tests read every step's metrics
            "report_to": [],
            "save_steps": save_steps,
            "packing": True,
            "global_max_length": 320,
            "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
        },
    }


def train_to_the_end(config: dict[str, Any], tmp_path: Path, name: str) -> None:
    """Run the 2-rank learner on ``config`` (logs under ``tmp_path/logs-<name>``); it must exit 0."""
    config_path = tmp_path / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    ranks = train_in_forked_ranks(config_path, tmp_path / f"logs-{name}")
    try:
        codes = ranks.wait(RUN_TIMEOUT_S, check=False)
    finally:
        ranks.kill()  # interrupted while waiting (the test's timeout): no rank left behind
    logs = rank_logs(tmp_path / f"logs-{name}")
    assert codes == {0: 0, 1: 0}, (codes, {r: text[-3000:] for r, text in logs.items()})


def step_metrics(out: Path) -> list[dict[str, Any]]:
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [h for h in logged if "loss" in h]


def rank_logs(log_dir: Path) -> dict[int, str]:
    """``{rank: stdout + stderr}`` from the ``<log_dir>/<rank>/*.log`` layout (also torchrun's)."""
    logs: dict[int, str] = {}
    for path in sorted(log_dir.rglob("*.log")):
        rank = int(path.parent.name)
        logs[rank] = logs.get(rank, "") + path.read_text(errors="replace")
    return logs


def make_shapes(folder: Path) -> dict[str, Path]:
    from rollmatch.data.shapes import generate_shapes

    return generate_shapes(folder / "shapes", n_train=24, n_val=1, size=112, seed=3)


@pytest.fixture
def shapes(tmp_path: Path) -> dict[str, Path]:
    return make_shapes(tmp_path)


@pytest.fixture(scope="module")
def vllm_server(start_server: Callable[..., Any], tiny_model_dir: Path) -> Any:
    """One vLLM server for the runs that leave it running (each run pushes its weights first)."""
    pytest.importorskip("vllm")
    return start_server(tiny_model_dir, "--engine", "vllm")


# The target that trains after the model's own mistakes, with the unlikelihood flags riding in the
# ready packs (docs/detection.md).
AFTER_MISTAKES_LOSS = {
    "keep_prefix": "all",
    "matched_prefix": "supervise",
    "missed_weight": 0.5,
    "fp_unlikelihood_weight": 0.5,
}
VLLM_RUN_STEPS, VLLM_RUN_GAS = 4, 2


@dataclass
class AsyncRun:
    """A finished 2-rank async run: its config and output directory."""

    config: dict[str, Any]
    out: Path


@pytest.fixture(scope="module")
def vllm_run(vllm_server: Any, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncRun:
    """One async run on the vLLM server, read by two tests (one 2-rank learner start instead of three):
    ``VLLM_RUN_STEPS`` steps of ``VLLM_RUN_GAS`` micro-steps whose B steps wait for their packs, on the
    after-mistakes target, with a checkpoint after step 2 (the resume test's starting point)."""
    folder = tmp_path_factory.mktemp("vllm_run")
    config = async_config(
        tiny_model_dir,
        make_shapes(folder),
        folder / "first",
        vllm_server.url,
        free_tcp_port(),
        max_steps=VLLM_RUN_STEPS,
        max_wait_s=30.0,
        gradient_accumulation_steps=VLLM_RUN_GAS,
        save_steps=2,
    )
    config["loss"] = dict(AFTER_MISTAKES_LOSS)
    started = time.monotonic()
    train_to_the_end(config, folder, "first")
    assert time.monotonic() - started < RUN_TIMEOUT_S
    return AsyncRun(config, folder / "first")


# hf: the spec's gate (no waiting: steps without packs run A). vllm: 2 micro-steps per step, and B
# steps wait for their packs (async.max_wait_s), so every step is B and fewer steps suffice; the run
# trains the after-mistakes target (AFTER_MISTAKES_LOSS) and is the one the resume test starts from.
# vllm-coord: the same on a model with the coordinate tokens (custom.object_format: coord_tokens); the
# server's /info/ says it can decode them, else the learner would refuse it at start-up.
@pytest.mark.parametrize(
    ("engine", "steps", "max_wait_s", "gas"),
    [
        ("hf", 14, 0.0, 1),
        ("vllm", VLLM_RUN_STEPS, 30.0, VLLM_RUN_GAS),
        ("vllm-coord", 3, 30.0, 1),
    ],
)
def test_async_learner_runs_b_steps_and_accounts_for_every_pack(
    engine: str,
    steps: int,
    max_wait_s: float,
    gas: int,
    request: pytest.FixtureRequest,
    start_server: Callable[..., Any],
    tiny_model_dir: Path,
    tmp_path: Path,
    free_port: Callable[[], int],
) -> None:
    if engine == "vllm":
        out = request.getfixturevalue("vllm_run").out
    else:
        out = tmp_path / "out"
        coord = engine == "vllm-coord"
        if coord:
            pytest.importorskip("vllm")
            model_dir = request.getfixturevalue("coord_model_dir")
            server = start_server(model_dir, "--engine", "vllm")
            assert server.get("/info/")["object_formats"] == ["qwen_json", "coord_tokens"]
        else:
            model_dir, server = tiny_model_dir, request.getfixturevalue("hf_sync_server")
        config = async_config(
            model_dir,
            make_shapes(tmp_path),
            out,
            server.url,
            free_port(),
            max_steps=steps,
            max_wait_s=max_wait_s,
            gradient_accumulation_steps=gas,
        )
        if coord:
            config["custom"]["object_format"] = "coord_tokens"
            config["custom"]["extra"]["rollout_matching"]["max_new_tokens"] = 24
        started = time.monotonic()
        train_to_the_end(config, tmp_path, "async")
        assert time.monotonic() - started < RUN_TIMEOUT_S
    logged = step_metrics(out)
    assert len(logged) == steps
    b_steps = [h for h in logged if h["stage2_ab/step_kind_b"] == 1.0]
    assert b_steps, "no Channel-B step ran: the actors never fed the learner"
    if max_wait_s:
        assert len(b_steps) == steps  # every step waited for its packs
    assert all(h["stage2_ab/micro_steps_b"] == 2 * gas for h in b_steps)  # one pack per micro-step, 2 ranks
    skipped = [h for h in logged if h["stage2_ab/async/b_step_skipped_due_to_queue"]]
    assert len(skipped) + len(b_steps) == steps  # b_ratio 1.0: every step wanted B
    assert all(h["stage2_ab/async/ver_lag_max"] <= 2 for h in b_steps)  # version_window 2
    assert [h["stage2_ab/async/ver"] for h in logged] == list(range(steps))  # one sync per step

    accounting = [json.loads((out / "async" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank_counts in accounting:
        assert rank_counts["balance"] == 0, rank_counts
        assert rank_counts["produced"] == (
            rank_counts["trained"]
            + rank_counts["dropped_stale"]
            + rank_counts["dropped_oldest"]
            + rank_counts["discarded_at_exit"]
        )
        assert rank_counts["trained"] == gas * len(b_steps)  # one pack per micro-step on every rank
        assert rank_counts["actor_failure"] is None
        assert_rollouts_balance(rank_counts)
    last = logged[-1]
    # Logged at the step's start, a pack counts as trained once its backward pass ran: the last B step's
    # packs are in the accounting files, not yet in the last logged total.
    last_b = 1 if last["stage2_ab/step_kind_b"] == 1.0 else 0
    assert last["stage2_ab/async/packs_trained_total"] == 2 * gas * (len(b_steps) - last_b)
    assert last["stage2_ab/async/packs_produced_total"] <= sum(c["produced"] for c in accounting)


def trace(out: Path, rank: int) -> list[dict[str, Any]]:
    return [
        json.loads(line) for line in (out / "async" / f"rank{rank}.records.jsonl").read_text().splitlines()
    ]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_an_async_run_resumed_from_a_checkpoint_neither_repeats_nor_skips_a_record(
    vllm_run: AsyncRun, tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """Stop after a checkpoint (run 1, ``vllm_run``: 4 steps, a checkpoint after 2), resume from it (run 2:
    steps 2-4): on every rank no record is trained or dropped twice, none is skipped (below the
    checkpoint's frontier, nor at or above it: every stream position up to the last one the resumed run
    read was trained, dropped or discarded at its end by exactly one of the runs), ``ver`` continues and
    the lag stays within the window."""
    import torch

    config = copy.deepcopy(vllm_run.config)
    config["training"].update(
        output_dir=str(tmp_path / "resumed"),
        max_steps=5,
        resume_from_checkpoint=str(vllm_run.out / "checkpoint-2"),
    )
    config["custom"]["extra"]["rollout_matching"]["vllm"]["server"]["servers"][0]["group_port"] = free_port()
    train_to_the_end(config, tmp_path, "resumed")
    runs = {"first": vllm_run.out, "resumed": tmp_path / "resumed"}
    resumed = step_metrics(runs["resumed"])
    assert [h["stage2_ab/async/ver"] for h in resumed] == [2, 3, 4]  # ver continues from global_step 2
    assert all(h["stage2_ab/async/ver_lag_max"] <= 2 for h in resumed if h["stage2_ab/step_kind_b"] == 1.0)
    for rank in (0, 1):
        saved = torch.load(
            runs["first"] / "checkpoint-2" / f"rollmatch_state_rank{rank}.pt", weights_only=False
        )
        ledger = saved["channel_b"]["ledger"]
        first = [line for line in trace(runs["first"], rank) if line["event"] != "discarded"]
        before = [r for line in first if line["step"] < 2 for r in line["records"]]
        after = [r for line in trace(runs["resumed"], rank) for r in line["records"]]  # discarded ones too
        done_before = {position for position, _, _ in before}
        done_after = {position for position, _, _ in after}
        assert len(done_before) == len(before) and len(done_after) == len(after)  # nothing twice within a run
        assert not done_before & done_after, sorted(done_before & done_after)  # nor across the resume
        frontier = ledger["frontier"]
        assert set(range(frontier)) | set(ledger["done_ahead"]) == done_before  # the checkpoint's ledger
        assert min(done_after) >= frontier  # the resumed actor read on from the frontier
        # Nothing skipped at or above the frontier either: the resumed run's trace ends with what it still
        # held, so every position up to the last one it read is accounted for by exactly one of the runs.
        last_read = max(done_after)
        assert last_read > max(done_before, default=0)
        missing = set(range(last_read + 1)) - done_before - done_after
        assert not missing, (sorted(missing), frontier, ledger["done_ahead"])
        for line in trace(runs["resumed"], rank):  # every trained rollout within version_window (2)
            if line["event"] == "trained":
                assert all(line["step"] - version <= 2 for _, _, version in line["records"]), line


def assert_rollouts_balance(rank_counts: dict[str, Any]) -> None:
    """Every rollout a rank's actor got back was trained, dropped (stale, oldest) or discarded at exit."""
    rollouts = rank_counts["rollouts"]
    assert rollouts["balance"] == 0, rollouts
    assert rollouts["rolled_out"] == (
        rollouts["trained"]
        + rollouts["dropped_stale"]
        + rollouts["dropped_oldest"]
        + rollouts["discarded_at_exit"]
    )


def test_killing_the_server_fails_every_learner_rank_naming_it(
    start_server: Callable[..., Any],
    tiny_model_dir: Path,
    shapes: dict[str, Path],
    tmp_path: Path,
    free_port: Callable[[], int],
) -> None:
    server = start_server(tiny_model_dir, "--engine", "hf")
    out = tmp_path / "out"
    config = async_config(tiny_model_dir, shapes, out, server.url, free_port(), max_steps=500)
    config_path = tmp_path / "async.yaml"
    config_path.write_text(yaml.safe_dump(config))
    learner = train_in_forked_ranks(config_path, tmp_path / "logs")
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert learner.running(), "the learner stopped before the fault was injected"
            assert time.monotonic() < deadline, "the learner never logged 3 steps"
            time.sleep(0.2)
        server.process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        codes = learner.wait(SERVER_TIMEOUT_S + COLLECTIVE_TIMEOUT_S + 60, check=False)
        elapsed = time.monotonic() - killed_at
    finally:
        learner.kill()
    assert all(code not in (0, None) for code in codes.values()), codes  # every rank failed, none hung
    assert elapsed < SERVER_TIMEOUT_S + COLLECTIVE_TIMEOUT_S + 30, elapsed
    logs = rank_logs(tmp_path / "logs")
    assert sorted(logs) == [0, 1]
    for rank, text in logs.items():
        assert server.url in text, (rank, text[-3000:])
    for path in sorted((out / "async").glob("rank*.json")):  # written by the ranks that got to close
        assert_rollouts_balance(json.loads(path.read_text()))
