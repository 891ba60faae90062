"""The one typed config schema: every key, its default and its doc string live in it, once.

Owns: the root :class:`RollmatchConfig`, the ``model`` and ``data`` sections, and the one import of
every section (the other sections live by concept beside it: ``loss_schema``, ``rollout_schema``,
``stage2_schema``, ``training_schema``, ``launch_schema``, on the base ``section.Section``; unknown
keys rejected everywhere). Leaves out: cross-field rules (``config.rules``), reading YAML,
``extends:`` and overrides (``config.load``), the ``rollout:`` short form (``config.spelling``) and
legacy-key translation (``config.legacy``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr

from rollmatch.config.launch_schema import LaunchSettings, NodeRole, NodesConfig, SlurmSettings
from rollmatch.config.loss_schema import (
    GrpoConfig,
    LossConfig,
    MatchingConfig,
    NoiseKindsConfig,
    NoiseObjectsConfig,
)
from rollmatch.config.rollout_schema import (
    ROLLOUT_KEY,
    CustomConfig,
    DecodingConfig,
    ExtraConfig,
    OffloadConfig,
    RolloutMatchingConfig,
    ServerConfig,
    ServerEndpoint,
    SyncConfig,
    VllmConfig,
)
from rollmatch.config.section import Section
from rollmatch.config.stage2_schema import AsyncConfig, ChannelBConfig, ScheduleConfig, Stage2ABConfig
from rollmatch.config.training_schema import (
    DEFAULT_COUNT_BUCKETS,
    EvalConfig,
    PreflightConfig,
    TrainingConfig,
)

__all__ = [
    "DEFAULT_COUNT_BUCKETS",
    "ROLLOUT_KEY",
    "AsyncConfig",
    "ChannelBConfig",
    "CustomConfig",
    "DataConfig",
    "DecodingConfig",
    "EvalConfig",
    "ExtraConfig",
    "GrpoConfig",
    "LaunchSettings",
    "LoraConfig",
    "LossConfig",
    "MatchingConfig",
    "ModelConfig",
    "NodeRole",
    "NodesConfig",
    "NoiseKindsConfig",
    "NoiseObjectsConfig",
    "OffloadConfig",
    "PreflightConfig",
    "RollmatchConfig",
    "RolloutMatchingConfig",
    "ScheduleConfig",
    "Section",
    "ServerConfig",
    "ServerEndpoint",
    "SlurmSettings",
    "Stage2ABConfig",
    "SyncConfig",
    "TrainingConfig",
    "VllmConfig",
]


# --------------------------------------------------------------------------------------------- model
class LoraConfig(Section):
    """LoRA / DoRA adapters on the language model (trained instead of the full weights when enabled)."""

    enabled: bool = Field(False, description="Train LoRA/DoRA adapters instead of full weights.")
    r: int = Field(8, gt=0, description="LoRA rank.")
    alpha: int = Field(16, gt=0, description="LoRA alpha.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout.")
    use_dora: bool = Field(False, description="Use DoRA (weight-decomposed LoRA).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Module names (language model) that get adapters.",
    )


class ModelConfig(Section):
    """The model to train: a Qwen2-VL / Qwen2.5-VL / Qwen3-VL directory."""

    path: str = Field("runs/demo/model", description="Model directory (`from_pretrained`).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Dtype of the trained weights and their AdamW state. `float32` with "
        "training.mixed_precision: bf16 is fp32 master weights with bf16 compute (the recipes' setting); "
        "`bfloat16` trains pure bf16: an update below a weight's bf16 spacing (~4e-3 relative) is lost "
        "(tests/training/test_precision.py).",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernel; `flash_attention_2` needs a GPU."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)


# ---------------------------------------------------------------------------------------------- data
class DataConfig(Section):
    """Training / validation records and how prompts and boxes are encoded."""

    train_jsonl: str = Field(
        "runs/demo/data/train.jsonl", description="Training records (JSONL, docs/data.md)."
    )
    val_jsonl: str | None = Field("runs/demo/data/val.jsonl", description="Validation records, or null.")
    coord_frame: Literal["auto", "norm1000", "pixels"] = Field(
        "auto",
        description="Box coordinate frame: `norm1000` (0..1000 of the image), `pixels` (pixels of the processor-resized image) or `auto`: the frame the checkpoint's family was pretrained in, from `model_type` in model.path's config.json (Qwen2.5-VL: pixels; Qwen2-VL, Qwen3-VL, Qwen3-VL-MoE: norm1000; with `custom.object_format: coord_tokens`: norm1000). `check-config` prints the resolved frame.",
    )
    prompt: str = Field(
        "Detect every object in the image. Answer with a JSON list of "
        '{"bbox_2d": [x1, y1, x2, y2], "label": "..."}.',
        description="User prompt placed after the image.",
    )
    labels: list[str] | str | None = Field(
        None,
        description='The dataset\'s class names that `{labels}` in `data.prompt` lists: the names inline, or a file (a JSON list, or one name per line; relative to the directory of the config file that sets it, like `extends:`) such as the `<out>.labels.json` `rollmatch data convert` writes beside its JSONL. null: with `{labels}` in the prompt, `<data.train_jsonl without .jsonl>.labels.json`. A run saves the list in its checkpoints (`rollmatch_run.json`), so eval and rewards use the same list; a predicted label outside it is counted as `unknown_label` (docs/data.md, "Labels in the prompt").',
    )
    prompt_max_labels: int | None = Field(
        None,
        gt=0,
        description="Most names `{labels}` lists per record (null: every name). With more names than this (LVIS: 1,203), a record lists its own labels plus negatives drawn from the rest up to this many, shuffled; deterministic per record id and `training.seed` (Rex-Omni's prompts). The record's own labels always appear.",
    )
    max_samples: int | None = Field(None, gt=0, description="Use only the first N training records.")
    min_pixels: int | None = Field(None, gt=0, description="Override the processor's min_pixels.")
    max_pixels: int | None = Field(None, gt=0, description="Override the processor's max_pixels.")
    over_length: Literal["error", "drop"] = Field(
        "error",
        description="Training records longer than training.global_max_length (prompt + GT target; for variants "
        "that roll out also prompt + max_new_tokens + 1), found by `check-config` and `train` before the model "
        "loads: `error` refuses the run naming them, `drop` trains without them (counted and named).",
    )


# -------------------------------------------------------------------------------------------- root
class RollmatchConfig(Section):
    """Top-level sections of a run config."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    matching: MatchingConfig = Field(default_factory=MatchingConfig)
    custom: CustomConfig = Field(default_factory=CustomConfig)
    stage2_ab: Stage2ABConfig = Field(default_factory=Stage2ABConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    preflight: PreflightConfig = Field(default_factory=PreflightConfig)
    launch: LaunchSettings = Field(default_factory=LaunchSettings)

    # How the loader saw the file (config.spelling.Spelling): messages name keys as the user wrote them.
    _spelling: Any = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        """Equal keys and values; how a file spelled them (``_spelling``) is not part of the config."""
        if not isinstance(other, RollmatchConfig):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # mutable, like every pydantic model

    @property
    def rollout(self) -> RolloutMatchingConfig:
        return self.custom.extra.rollout_matching
