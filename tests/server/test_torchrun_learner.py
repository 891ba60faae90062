"""A 2-rank (gloo) learner in server mode: optimizer steps with syncs in between, no deadlock. The ranks
run ``rollmatch train`` forked from the test process (``fork_ranks.py``); tests/launch runs torchrun.

Only rank 0 pushes: the server must see exactly one push per synced version, while both ranks
send their own rollout requests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from fork_ranks import train_in_forked_ranks

pytestmark = pytest.mark.heavy
MAX_STEPS = 3  # versions 1 and 2 are pushed before steps 1 and 2
RUN_TIMEOUT_S = 420


def test_two_rank_learner_pushes_once_per_sync_and_finishes(
    hf_sync_server: Any, tiny_model_dir: Path, tmp_path: Path, free_port: Callable[[], int]
) -> None:
    from rollmatch.data.shapes import generate_shapes

    data = generate_shapes(tmp_path / "shapes", n_train=4, n_val=1, size=112, seed=0)
    config = {
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_jsonl": str(data["train"]), "val_jsonl": None},
        "custom": {
            "trainer_variant": "rollout_matching_sft",
            "extra": {
                "rollout_matching": {
                    "rollout_backend": "vllm",
                    "max_new_tokens": 12,
                    "vllm": {
                        "mode": "server",
                        "sync": {"mode": "full"},
                        "server": {
                            "servers": [{"base_url": hf_sync_server.url, "group_port": free_port()}],
                            "timeout_s": 120,
                        },
                    },
                }
            },
        },
        "preflight": {"records": 0},  # rollout training from an untrained model: no format check
        "training": {
            "output_dir": str(tmp_path / "out"),
            "per_device_train_batch_size": 1,
            "max_steps": MAX_STEPS,
            "learning_rate": 3e-3,
            "report_to": [],
            "save_steps": 1000,
            "packing": True,
            "global_max_length": 1024,
            "collective_timeout_s": 140,  # leaves the first push's group init (timeout_s 120) its margin
        },
    }
    config_path = tmp_path / "server_mode.yaml"
    config_path.write_text(yaml.safe_dump(config))
    before = hf_sync_server.get("/stats/")

    ranks = train_in_forked_ranks(config_path, tmp_path / "logs")
    try:
        codes = ranks.wait(RUN_TIMEOUT_S, check=False)
    finally:
        ranks.kill()
    output = "".join(path.read_text(errors="replace") for path in sorted((tmp_path / "logs").rglob("*.log")))
    assert codes == {0: 0, 1: 0}, (codes, output[-4000:])
    assert output.count(f"trained {MAX_STEPS} steps") == 2, output[-4000:]

    after = hf_sync_server.get("/stats/")
    pushes = {v: n - before["pushes_by_version"].get(v, 0) for v, n in after["pushes_by_version"].items()}
    assert pushes["1"] == 1 and pushes["2"] == 1, pushes  # rank 0 only, once per sync
    assert sum(pushes.values()) <= 3  # plus at most a v0 re-alignment of a server an earlier test changed
    assert after["weight_version"] == 2 and after["failed_pushes"] == before["failed_pushes"]
    assert after["infer_calls"] - before["infer_calls"] == 2 * MAX_STEPS  # both ranks generate every step
