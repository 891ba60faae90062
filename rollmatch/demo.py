"""``rollmatch demo``: the whole pipeline on a tiny model, on CPU, in a few minutes.

build (tiny Qwen2.5-VL + synthetic shapes, reused if present) -> eval before -> stage-1 ``sft``
-> eval -> ``rollout_matching_sft`` from the SFT model -> eval -> summary table,
``summary.json`` and ``summary.png``. Rollouts use the default backend, vLLM colocated, when
vLLM is installed (else HF generate). Its embedded default config is :data:`DEMO_CONFIG`; any key
can be overridden on the command line (``rollmatch demo training.max_steps=5``).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rollmatch.config.load import deep_merge, load_config_dict
from rollmatch.config.schema import RollmatchConfig
from rollmatch.data.records import load_records
from rollmatch.evaluation import EvalResult, run_eval

# Shared by both phases; phase-specific keys are in SFT_PHASE / ROLLOUT_PHASE.
DEMO_CONFIG: dict[str, Any] = {
    "model": {"path": "{out}/model", "dtype": "float32", "attn_implementation": "sdpa"},
    "data": {"train_jsonl": "{out}/data/train.jsonl", "val_jsonl": "{out}/data/val.jsonl"},
    "custom": {
        "extra": {
            "rollout_matching": {
                "rollout_backend": "{backend}",
                "max_new_tokens": 160,
                "vllm": {"tensor_parallel_size": 1, "enforce_eager": True},
            }
        }
    },
    "training": {
        "per_device_train_batch_size": 8,
        "packing": True,
        # one packed row per micro-step must hold the micro-batch: 8 samples x ~250 tokens
        "global_max_length": 2048,
        "carry_buffer_size": 64,
        "logging_steps": 5,
        "save_steps": 1000,
        "report_to": ["tensorboard"],
        "lr_scheduler_type": "cosine",
        "warmup_ratio": 0.05,
        "seed": 0,
    },
    "eval": {"batch_size": 16},
}
SFT_PHASE: dict[str, Any] = {
    "custom": {"trainer_variant": "sft"},
    "training": {"output_dir": "{out}/sft", "max_steps": 240, "learning_rate": 2e-3},
}
ROLLOUT_PHASE: dict[str, Any] = {
    "model": {"path": "{out}/sft/final"},
    "custom": {"trainer_variant": "rollout_matching_sft"},
    # rollouts (up to max_new_tokens) + the missed-object tail: ~425 tokens x 8 per packed row
    "training": {
        "output_dir": "{out}/rollout",
        "max_steps": 30,
        "learning_rate": 3e-4,
        "global_max_length": 4096,
    },
}
SHAPES = {"n_train": 384, "n_val": 48, "size": 224, "seed": 0}


def demo_command(args: argparse.Namespace) -> int:
    summary = run_demo(Path(args.out), args.overrides)
    print(format_table(summary))
    print(f"\nwrote {Path(args.out) / 'summary.json'} and {Path(args.out) / 'summary.png'}")
    return 0


def run_demo(out: Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    from rollmatch.data.shapes import generate_shapes
    from rollmatch.models.tiny import build_tiny_model
    from rollmatch.training.entry import run_training

    out.mkdir(parents=True, exist_ok=True)
    if not (out / "model" / "config.json").exists():
        build_tiny_model("qwen2_5_vl", out / "model", seed=0)
    if not (out / "data" / "val.jsonl").exists():
        generate_shapes(out / "data", **SHAPES)
    sft_cfg = phase_config(out, SFT_PHASE, overrides)
    rollout_cfg = phase_config(out, ROLLOUT_PHASE, overrides)
    val = load_records(sft_cfg.data.val_jsonl)

    start = time.perf_counter()
    phases: dict[str, Any] = {"before": eval_summary(run_eval(sft_cfg, val, str(out / "eval_before.jsonl")))}
    for name, cfg in (("sft", sft_cfg), ("rollout_matching_sft", rollout_cfg)):
        result = run_training(cfg)
        evaluation = run_eval(with_model(cfg, result.final_model_dir), val, str(out / f"eval_{name}.jsonl"))
        losses = [h["loss"] for h in result.log_history if "loss" in h]
        phases[name] = {
            "steps": result.global_step,
            "seconds": round(result.seconds, 1),
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "losses": losses,
            "f1_curve": [h["match/f1"] for h in result.log_history if "match/f1" in h],
            **eval_summary(evaluation),
        }
    summary = {"seconds_total": round(time.perf_counter() - start, 1), "phases": phases}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_summary(summary, out / "summary.png")
    return summary


def phase_config(out: Path, phase: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> RollmatchConfig:
    text = json.dumps(deep_merge(DEMO_CONFIG, phase)).replace("{out}", str(out))
    merged = json.loads(text.replace("{backend}", default_backend()))
    return load_config_dict(merged, overrides, source="rollmatch demo")


def default_backend() -> str:
    """vLLM (colocated) when it is installed, else HF generate."""
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def with_model(cfg: RollmatchConfig, model_dir: str) -> RollmatchConfig:
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model_dir})})


def eval_summary(result: EvalResult) -> dict[str, Any]:
    data = asdict(result)
    data["eval_seconds"] = data.pop("seconds")
    return {
        k: (round(v, 4) if isinstance(v, float) else v) for k, v in data.items() if k != "predictions_path"
    }


def format_table(summary: dict[str, Any]) -> str:
    header = f"{'phase':<22}{'steps':>7}{'seconds':>9}{'loss':>9}{'P@.5':>8}{'R@.5':>8}{'F1@.5':>8}{'mAP':>8}"
    lines = [header, "-" * len(header)]
    for name, p in summary["phases"].items():
        loss = f"{p['loss_last']:.3f}" if p.get("loss_last") is not None else "-"
        lines.append(
            f"{name:<22}{p.get('steps', 0):>7}{p.get('seconds', 0):>9}{loss:>9}"
            f"{p['precision']:>8.3f}{p['recall']:>8.3f}{p['f1']:>8.3f}{p['map']:>8.3f}"
        )
    return "\n".join(lines)


def plot_summary(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_f1) = plt.subplots(1, 2, figsize=(10, 4))
    offset = 0
    for name in ("sft", "rollout_matching_sft"):
        losses = summary["phases"][name]["losses"]
        ax_loss.plot(range(offset, offset + len(losses)), losses, label=name)
        offset += len(losses)
    ax_loss.set(title="training loss (per log line)", xlabel="log line", ylabel="loss")
    ax_loss.legend()
    names = list(summary["phases"])
    ax_f1.bar(names, [summary["phases"][n]["f1"] for n in names], color=["grey", "tab:blue", "tab:orange"])
    ax_f1.set(title="val F1 @ IoU 0.5", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
