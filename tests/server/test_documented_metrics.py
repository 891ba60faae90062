"""Every metric docs/metrics.md and docs/stage2.md promise is emitted, and every emitted metric is documented.

One short real training per variant (sft with in-training evaluation, rollout_matching_sft, stage2_ab in
micro, step and async mode; async against a real ``rollmatch serve`` process), each with tiny settings.
Each documented row says when it is logged (its "logged" column, from a fixed vocabulary); a row whose
condition a run meets must appear in that run's metrics, and every row must appear in some run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from local_ports import free_tcp_port

from rollmatch.config.load import deep_merge, load_config_dict
from rollmatch.training.entry import run_training

pytestmark = pytest.mark.heavy
REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "docs" / "metrics.md", REPO / "docs" / "stage2.md")

# "logged" column -> the runs that must log the row (None: not bound to a run, but some run must log it).
CONDITIONS: dict[str, set[str] | None] = {
    "every step": {"sft", "rollout_matching", "micro", "step", "async", "grpo"},
    "rollouts": {"rollout_matching", "micro", "step", "async", "grpo"},
    "packing": {"sft", "rollout_matching", "micro", "step", "async", "grpo"},
    "weight push": {"rollout_matching", "micro", "step", "async", "grpo"},
    "grpo": {"grpo"},
    "stage2_ab": {"micro", "step", "async"},
    "step mode": {"step"},
    "micro mode": {"micro"},
    "async": {"async"},
    "rollout servers": {"async"},
    "evaluation": {"sft"},
    "SFT steps with noise objects": {"sft_noise"},
    "evaluation with a noise label": {"sft_noise"},
    "invalid elements": None,
}
# HF's end-of-training summary line, and metrics.jsonl's own step field
HF_SUMMARY = {
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "total_flos",
    "train_loss",
}
NOT_METRICS = HF_SUMMARY | {"step"}
NAME = re.compile(r"`([^`]+)`")


def documented_rows() -> list[tuple[list[str], str, str]]:
    """``(names, logged, source)`` of every metric row in the docs' tables with a "logged" column."""
    rows = []
    for doc in DOCS:
        in_table = False
        for line in doc.read_text().splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if line.startswith("| name |"):
                in_table = cells[-1] == "logged"
                continue
            if not in_table or not line.startswith("| `"):
                in_table = in_table and line.startswith("|")
                continue
            names = NAME.findall(cells[0])
            family = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0] else ""
            expanded = []
            for name in names:
                name = name if "/" in name else family + name  # `packs_trained_total` after a full name
                match = re.fullmatch(r"(.*)\{(.*)\}", name)
                expanded += [match.group(1) + part for part in match.group(2).split(",")] if match else [name]
            rows.append((expanded, cells[-1], doc.name))
    return rows


def is_logged(name: str, keys: set[str]) -> bool:
    if "<" in name:  # parse/invalid_<reason>
        return any(key.startswith(name.split("<")[0]) for key in keys)
    return name in keys


def is_documented(key: str, names: list[str]) -> bool:
    return any(is_logged(name, {key}) for name in names)


# ----------------------------------------------------------------------------------------- runs
def base_config(tiny_model_dir: Path, data: dict[str, Path], out: Path) -> dict[str, Any]:
    return {
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_jsonl": str(data["train"]), "val_jsonl": str(data["val"]), "max_samples": 4},
        "custom": {"extra": {"rollout_matching": {"rollout_backend": "hf", "max_new_tokens": 8}}},
        "eval": {"max_samples": 2, "max_new_tokens": 8},
        "preflight": {"records": 0},  # rollout training from an untrained model: no format check
        "training": {
            "output_dir": str(out),
            "per_device_train_batch_size": 2,
            "max_steps": 2,
            "learning_rate": 1e-3,
            "report_to": [],
            "logging_steps": 1,
            "save_steps": 1000,
            "packing": True,
            "global_max_length": 512,
        },
    }


VARIANTS: dict[str, dict[str, Any]] = {
    "sft": {"custom": {"trainer_variant": "sft"}, "training": {"eval_steps": 1}},
    "sft_noise": {  # noise objects in the target; evaluation drops them by their label
        "custom": {"trainer_variant": "sft"},
        "loss": {"noise_objects": {"enabled": True, "pad_to": 4}},
        "training": {"eval_steps": 1},
    },
    "rollout_matching": {"custom": {"trainer_variant": "rollout_matching_sft"}},
    "micro": {
        "custom": {"trainer_variant": "stage2_ab_training"},
        "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "micro"}},
    },
    "step": {
        "custom": {"trainer_variant": "stage2_ab_training"},
        "stage2_ab": {"schedule": {"b_ratio": 0.5}, "channel_b": {"mode": "step", "rollouts_per_step": 2}},
    },
    "grpo": {
        "custom": {
            "trainer_variant": "rollout_matching_sft",
            "extra": {"rollout_matching": {"rollouts_per_record": 2, "decoding": {"temperature": 1.0}}},
        },
        "loss": {"objective": "grpo"},
    },
}


def async_variant(url: str, group_port: int) -> dict[str, Any]:
    server = {"servers": [{"base_url": url, "group_port": group_port}], "timeout_s": 30.0}
    return {
        "custom": {
            "trainer_variant": "stage2_ab_training",
            "extra": {
                "rollout_matching": {"rollout_backend": "vllm", "vllm": {"mode": "server", "server": server}}
            },
        },
        "stage2_ab": {
            "schedule": {"b_ratio": 0.5},  # A, B, A: both channels' metrics
            "channel_b": {
                "mode": "async",
                "async": {
                    "queue_limit": 4,
                    "prefetch_target_packs": 2,
                    "version_window": 4,
                    "sync_every_steps": 4,
                    "max_wait_s": 50.0,  # the B step waits for its packs: deterministic
                },
            },
        },
        "training": {"per_device_train_batch_size": 1, "max_steps": 3, "collective_timeout_s": 60.0},
    }


@pytest.fixture(scope="module")
def logged_keys(
    tiny_model_dir: Path,
    hf_sync_server: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, set[str]]:
    """Every metric key each variant's short run logged (metrics.jsonl), by run name."""
    from rollmatch.data.shapes import generate_shapes

    data = generate_shapes(tmp_path_factory.mktemp("shapes"), n_train=4, n_val=2, size=112, seed=0)
    variants = dict(VARIANTS, **{"async": async_variant(hf_sync_server.url, free_tcp_port())})
    keys: dict[str, set[str]] = {}
    for name, extra in variants.items():
        out = tmp_path_factory.mktemp(f"metrics-{name}")
        run_training(load_config_dict(deep_merge(base_config(tiny_model_dir, data, out), extra)))
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        keys[name] = {key for line in lines for key in line} - NOT_METRICS
    return keys


def test_every_documented_metric_is_logged_when_its_condition_holds(logged_keys: dict[str, set[str]]) -> None:
    rows = documented_rows()
    assert len(rows) > 30, "the docs' metric tables were not found (header `| name | meaning | logged |`)"
    missing = []
    for names, logged, source in rows:
        assert logged in CONDITIONS, f"{source}: {names}: logged column {logged!r} not in {list(CONDITIONS)}"
        runs = CONDITIONS[logged]
        for name in names:
            for run in sorted(runs or ()):
                if not is_logged(name, logged_keys[run]):
                    missing.append(f"{source}: {name} ({logged}) not logged by the {run} run")
            if not any(is_logged(name, keys) for keys in logged_keys.values()):
                missing.append(f"{source}: {name} ({logged}) logged by no run")
    assert not missing, "\n".join(missing)


def test_every_logged_metric_is_documented(logged_keys: dict[str, set[str]]) -> None:
    names = [name for row_names, _, _ in documented_rows() for name in row_names]
    undocumented = sorted(
        f"{key} (logged by {run})"
        for run, keys in logged_keys.items()
        for key in keys
        if not is_documented(key, names)
    )
    assert not undocumented, "add these to docs/metrics.md:\n" + "\n".join(undocumented)
