"""The one typed config schema: every key, its default and its doc string live here, once.

Owns: the pydantic models (unknown keys rejected) and the cross-field rules that need only the
config itself. Leaves out: reading YAML, ``extends:`` and overrides (``config.load``), legacy-key
translation (``config.legacy``) and rules that need the runtime (world size, devices: checked where
those are known, with the same :class:`~rollmatch.errors.ConfigProblem` shape).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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


# ----------------------------------------------------------------------------------------------- loss
class GrpoConfig(Section):
    """`loss.objective: grpo`: rewards, advantages and the clipped policy-gradient loss (docs/detection.md, "Objectives")."""

    reward: Literal["f1", "f1_iou"] = Field(
        "f1",
        description="Reward of a valid rollout from the strict parse + Hungarian match (training `matching.*`): `f1` = 2 TP / (predictions + GT); `f1_iou` weighs each match by its IoU. Invalid elements count as predictions (false positives); no GT and no prediction scores 1.",
    )
    invalid_reward: float = Field(
        0.0,
        description="The floor: reward of a rollout that is truncated (hit `max_new_tokens` or ended inside the list) or whose list is malformed (not a list, bad structure, text after it, unclosed).",
    )
    duplicate_penalty: float = Field(
        0.0,
        ge=0.0,
        description="Subtracted times the rollout's duplicate rate (valid predictions with the label of an earlier one and IoU >= 0.7 with it, over all predictions).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantage of sample k of a record: `r_k - mean` over the record's K rewards, divided by `std + 1e-4` with `group` (the record's K rewards, unbiased std as TRL and verl) or `batch` (every reward scored with it: the step's, or the ready pack's in async mode); `none`: not divided (Dr. GRPO).",
    )
    loss_type: Literal["dapo", "bnpo", "grpo", "dr_grpo"] = Field(
        "dapo",
        description="How token losses are averaged (TRL's `loss_type`). `dapo`: over every trained token of the optimizer step (all rows, micro-steps and ranks); `bnpo`: the same here (rollmatch's batch is the optimizer step; TRL's is each micro-batch, equal with one micro-batch on one process); `grpo`: each rollout's token mean, then the mean over the step's rollouts (short rollouts weigh more per token); `dr_grpo`: the step's token sum over (rollouts x `max_new_tokens`).",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="Rollouts cut by `max_new_tokens` still get their (floor) reward and count in their group's advantages, but train no token (TRL's option of the same name); they still count in the `grpo` / `dr_grpo` normalisers, as in TRL.",
    )
    is_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        Field(
            "token_truncate",
            description="Engine/learner correction of fresh tokens (TRL's `vllm_importance_sampling_mode`): the ratio `exp(learner - engine log-prob)` per token (`token_*`) or its product over the rollout (`sequence_*`) weighs the token's loss, capped at `is_cap` (`*_truncate`) or zeroed above it (`*_mask`); no gradient through it. The PPO ratio of such a token is then taken against the learner (1 on a fresh rollout). Tokens trained a step or more after sampling keep the engine's log-prob in the PPO ratio and weigh 1. `none`: every ratio against the engine's log-prob (engine mismatch and staleness in one ratio).",
        )
    )
    is_cap: float = Field(
        3.0,
        gt=1.0,
        description="Cap of the engine/learner correction (TRL's `vllm_importance_sampling_clip_max`, default 3).",
    )
    clip_eps: float = Field(
        0.2,
        gt=0.0,
        lt=1.0,
        description="PPO clip: the ratio to the behaviour policy is clipped to [1 - clip_eps, 1 + clip_eps_high] (TRL: `epsilon`).",
    )
    clip_eps_high: float | None = Field(
        None,
        gt=0.0,
        description="Upper clip (asymmetric, e.g. 0.28; TRL: `epsilon_high`); null: equal to `clip_eps`.",
    )
    max_ratio: float = Field(
        3.0,
        gt=1.0,
        description="Dual clip (verl's `clip_ratio_c`, TRL's `delta`): a token with a negative advantage whose ratio to the behaviour policy exceeds this gets the constant loss `-max_ratio * A` and no gradient, bounding how far stale rollouts (packing carry, async packs) can push.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of the per-token KL (k3 estimator) to the starting weights (TRL: `beta`), at the sampling temperature; > 0 keeps a frozen copy of the model (one more copy of the weights in memory, one more forward per row). Refused with ZeRO-3 / FSDP (the frozen copy is not sharded).",
    )


class LossConfig(Section):
    """The rollout-matching target and its per-token loss weights (prompt tokens always weigh 0).

    Targets, weights and why the default is what it is: docs/detection.md, "Targets and loss weights".
    """

    target: Literal["prefix_fn", "reordered_gt"] = Field(
        "prefix_fn",
        description="Rollout-matching target. `prefix_fn`: the rollout's own prefix (`keep_prefix`) + the GT objects not in it + EOS. `reordered_gt`: the GT objects the rollout matched, in the rollout's order, with GT coordinates and labels, then the missed GT (canonical order); false positives, duplicates and invalid elements left out; every token supervised.",
    )
    prefix_weight: float = Field(
        0.0, ge=0.0, description="Weight of the rollout prefix's structure tokens (0: no loss on the prefix)."
    )
    desc_weight: float = Field(1.0, ge=0.0, description="Weight of label-value tokens in the appended tail.")
    keep_prefix: Literal["matched", "all"] = Field(
        "matched",
        description="`prefix_fn` only: `matched` keeps the rollout up to its first element that is not a matched prediction (false positive, duplicate, invalid), then appends every GT object not yet in it; `all` keeps every complete element and appends the missed GT (the list can only grow, see docs/detection.md).",
    )
    coord_sigma_bins: float = Field(
        1.0,
        ge=0.0,
        le=100.0,
        description="`coord_tokens`: width (in bins of 1/999 of the side) of the Gaussian soft target over coordinate tokens at a coordinate position; 0 = one-hot (plain CE with `coord_gate_weight: 1`).",
    )
    coord_gate_weight: float = Field(
        1.0,
        ge=0.0,
        description="`coord_tokens`: weight of `-log P(any coordinate token)` at coordinate positions (keeps the mass on coordinate tokens).",
    )
    coord_w1_weight: float = Field(
        0.0,
        ge=0.0,
        description="`coord_tokens`: weight of the 1-D Wasserstein distance between the predicted and the target bin distribution (in units of the image side).",
    )
    geometry_l1_weight: float = Field(
        0.0,
        ge=0.0,
        description="`coord_tokens`: weight of SmoothL1 between each trained box's expected coordinates (softmax over bins) and its target box (units of the side).",
    )
    geometry_giou_weight: float = Field(
        0.0, ge=0.0, description="`coord_tokens`: weight of 1 - GIoU of the same expected and target boxes."
    )
    matched_prefix: Literal["none", "supervise"] = Field(
        "supervise",
        description="`prefix_fn` only: `supervise` rewrites each kept matched element to its GT's serialization and supervises its coordinate tokens (weight 1) and label tokens (`desc_weight`); structure tokens keep `prefix_weight`. With `keep_prefix: all` every matched element is rewritten, also after a false positive, and the kept false positives, duplicates and invalid elements stay in the context at weight 0 (training after the model's own mistakes). `none`: the prefix is the rollout's own tokens, unsupervised. Unset, it is `supervise` with `keep_prefix: matched` (the learning-signal study's best target, docs/detection.md) and `none` elsewhere; `target: reordered_gt` refuses `supervise`.",
    )
    missed_weight: float = Field(
        1.0,
        ge=0.0,
        description="Rollout-matching targets: factor on the weights of the appended missed-GT objects (their separators, coordinates and labels); the closing `]` and EOS keep weight 1.",
    )
    fp_unlikelihood_weight: float = Field(
        0.0,
        ge=0.0,
        description="`keep_prefix: all` only: weight of an unlikelihood term `-log(1 - p(token))` on the first token of each kept false positive or duplicate that no correct continuation shares (its first wrong coordinate character, its separator when no GT is left); summed with the CE and divided by the same step total of CE weights. 0: off. docs/detection.md.",
    )

    objective: Literal["rollout_matching", "grpo"] = Field(
        "rollout_matching",
        description="Channel-B objective. `rollout_matching`: teacher-forced CE on the targets below. `grpo`: policy gradient on the rollout tokens with a detection reward (`loss.grpo`), advantages normalised within each record's `rollouts_per_record` samples (K >= 2, sampling decoding).",
    )
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)

    @model_validator(mode="before")
    @classmethod
    def _matched_prefix_where_it_applies(cls, data: Any) -> Any:
        """Unset ``matched_prefix``: ``supervise`` where it applies, else ``none``, so ``target:
        reordered_gt`` or ``keep_prefix: all`` alone is a whole config; an explicit value is kept (and a
        combination that cannot apply is refused by check-config)."""
        if isinstance(data, dict) and "matched_prefix" not in data:
            applies = (
                data.get("target", "prefix_fn") == "prefix_fn"
                and data.get("keep_prefix", "matched") == "matched"
            )
            data = {**data, "matched_prefix": "supervise" if applies else "none"}
        return data


class MatchingConfig(Section):
    """Hungarian matching of parsed predictions to ground truth."""

    iou_threshold: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="A pair can match iff IoU > 0 and IoU >= this (0: any overlap; boxes that only touch never match).",
    )
    label_mode: Literal["ignore", "require"] = Field(
        "require",
        description="`require`: a label mismatch is no match (label-aware F1, what detection papers report); `ignore`: geometry only.",
    )
    fp_cost: float = Field(1.0, ge=0.0, description="Cost of leaving a prediction unmatched (dummy column).")
    fn_cost: float = Field(1.0, ge=0.0, description="Cost of leaving a GT object unmatched (dummy row).")


# ------------------------------------------------------------------------------------ rollout_matching
# Where RolloutMatchingConfig sits in a config file (``cfg.rollout``): the prefix of its keys in messages.
ROLLOUT_KEY = "custom.extra.rollout_matching"


class DecodingConfig(Section):
    """Rollout decoding; greedy iff temperature == 0."""

    temperature: float = Field(0.0, ge=0.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass in (0, 1]; 1 = disabled.")
    top_k: int = Field(-1, description="-1 = disabled.")
    repetition_penalty: float = Field(1.0, gt=0.0, description="> 1 penalises repeated tokens; 1 = off.")


class ServerEndpoint(Section):
    """One rollout server: its HTTP URL and the port of its weight-sync group."""

    base_url: str = Field(..., description="Rollout server URL, e.g. http://127.0.0.1:8000")
    group_port: int = Field(..., gt=0, lt=65536, description="TCPStore port of the weight-sync group.")


class ServerConfig(Section):
    """Rollout servers (`vllm.mode: server`): set exactly one form, `servers` or legacy `base_url` + `group_port`."""

    servers: list[ServerEndpoint] | None = Field(None, description="Preferred form: one entry per server.")
    base_url: str | list[str] | None = Field(None, description="Legacy form (use `servers`).")
    group_port: int | list[int] | None = Field(
        None, description="Legacy form: int -> group_port + i for server i, or one per base_url."
    )
    timeout_s: float = Field(
        240.0,
        gt=0.0,
        description="Reachability (/health/ polling) and communicator init timeout (s). With several learner ranks at most `training.collective_timeout_s` minus a margin (a tenth of it, at least 10 s): the other ranks wait while rank 0 forms the weight-sync groups.",
    )
    infer_timeout_s: float | None = Field(None, description="HTTP timeout of /infer/; null or <= 0: none.")
    min_healthy: int | None = Field(
        None,
        ge=1,
        description="Keep training while at least this many servers answer: a server that stops answering "
        "(connection, 5xx, timeout, unhealthy /health/) is dropped, its calls re-sent to the others, and it "
        "is used again once re-synced to the learner's weights. null: every server (the first failure ends "
        "the run). docs/runbook.md 'When a server dies'.",
    )
    rotate_servers: bool = Field(
        False,
        description="Opt-in departure from the seed's distribution rule. false (the rule): server i gets "
        "requests [i*chunk : (i+1)*chunk] of every call, so the same requests always reach the same server "
        "indices (calls of fewer requests than servers use only the first ones). true: each call starts one "
        "server further on, and each async actor starts at its learner rank, spreading small calls over every "
        "server (bench/server_distribution.py measures the split).",
    )
    image_wire: Literal["png", "resized_bmp"] = Field(
        "png",
        description="How /infer/ carries images. png: each original image as PNG (any swift-style server). "
        "resized_bmp (opt-in, faster): the pixels the trainer's processor already resized, uncompressed, "
        "bit-exact for the server's processor (docs/server.md).",
    )


class SyncConfig(Section):
    """How trained weights reach the rollout engine after each optimizer step."""

    mode: Literal["full", "adapter", "auto"] = Field(
        "full",
        description="full: merged weights; adapter: LoRA only (needs enable_lora); auto: adapter iff enable_lora.",
    )
    fallback_to_full: bool = Field(True, description="On adapter-sync failure: warn once and use full sync.")


class VllmConfig(Section):
    """The vLLM rollout engine: in-process (`colocate`) or behind HTTP rollout servers (`server`)."""

    mode: Literal["colocate", "server"] = Field(
        "colocate", description="In-process engine or HTTP rollout servers."
    )
    gpu_memory_utilization: float = Field(
        0.45,
        gt=0.0,
        le=1.0,
        description="Fraction of device memory for vLLM, in (0, 1]: the colocated engine's share beside "
        "training, or each rollout server's (`launch` passes it as `rollmatch serve --gpu-memory-utilization`; "
        "a server owns its GPUs, so 0.85-0.9 there).",
    )
    tensor_parallel_size: int = Field(
        1,
        gt=0,
        description="The colocated engine's tensor parallel size (CPU: 1). Server mode refuses a value other "
        "than 1: the servers' size is launch.tensor_parallel_size.",
    )
    max_num_seqs: int | None = Field(
        None,
        gt=0,
        description="Sequences per vLLM batch (null: vLLM's default); colocated engine, or each rollout server "
        "through `launch` (`--max-num-seqs`).",
    )
    enable_lora: bool = Field(False, description="Serve LoRA adapters (needed by sync.mode adapter).")
    max_model_len: int | None = Field(
        None, gt=0, description="Engine context length; >= training.global_max_length."
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse KV cache across requests sharing a prompt prefix (colocated engine, or each rollout "
        "server through `launch`).",
    )
    enforce_eager: bool = Field(
        False,
        description="Disable CUDA graphs / compilation (colocated engine, or each rollout server through `launch`).",
    )
    kv_cache_space_gib: float = Field(
        1.0,
        gt=0.0,
        description="CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE) of the colocated engine, or of each CPU "
        "rollout server through `launch`.",
    )
    sleep_level: Literal[0, 1, 2] = Field(
        0,
        description="The colocated engine's sleep mode between generations (0: off); server mode refuses "
        "other values (a server keeps its GPUs).",
    )
    server: ServerConfig = Field(default_factory=ServerConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)


class OffloadConfig(Section):
    """Moving training state off the device while a colocated engine generates."""

    enabled: bool = Field(False, description="Offload training state while a colocated engine generates.")
    offload_model: bool = Field(False, description="Offload model weights (needs enabled).")
    offload_optimizer: bool = Field(False, description="Offload optimizer state (needs enabled).")


class RolloutMatchingConfig(Section):
    """Rollouts for rollout-matching SFT (Channel-B): backend, length, decoding, engine."""

    rollout_backend: Literal["vllm", "hf"] = Field("vllm", description="Rollout engine.")
    max_new_tokens: int = Field(512, gt=0, description="Rollout length limit (truncation is reported).")
    decoding: DecodingConfig = Field(default_factory=DecodingConfig)
    rollouts_per_record: int = Field(
        1,
        ge=1,
        description="K: rollouts sampled per record, each with its own target (and, with `loss.objective: grpo`, the group its advantages are normalised in). K > 1 needs sampling decoding (`decoding.temperature` > 0); request `k` of record `i` in a call samples with seed `call seed + i * K + k`. Step mode: `stage2_ab.channel_b.rollouts_per_step` counts rollouts (records per step = rollouts_per_step / K).",
    )
    decode_batch_size: int | None = Field(
        None,
        gt=0,
        description="Records per rollout call (each brings `rollouts_per_record` requests), for every trainer "
        "variant and backend (the HF backend generates this many at once). null: a micro-batch's records in one "
        "call under `rollout_matching_sft`, 2 under `stage2_ab_training` (whose Channel-B calls do not follow the "
        "micro-batches). Replaces `stage2_ab.channel_b.rollout_decode_batch_size` (still read, with a warning).",
    )
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)


class ExtraConfig(Section):
    """Trainer-specific extensions."""

    rollout_matching: RolloutMatchingConfig = Field(default_factory=RolloutMatchingConfig)


class CustomConfig(Section):
    """Which trainer runs and how objects are serialized."""

    trainer_variant: Literal["rollout_matching_sft", "stage2_ab_training", "sft"] = Field(
        "rollout_matching_sft",
        description="rollout_matching_sft: every step on rollouts; stage2_ab_training: A/B schedule; sft: GT teacher forcing only.",
    )
    object_format: Literal["qwen_json", "coord_tokens"] = Field(
        "qwen_json",
        description="Serialization of the object list: `qwen_json` (coordinates as digits) or `coord_tokens` (each coordinate one of 1,000 bin tokens `<|coord_k|>`; needs a checkpoint with the tokens, `rollmatch add-coord-tokens`, and `data.coord_frame` `norm1000` or `auto` (norm1000 here); docs/detection.md).",
    )
    extra: ExtraConfig = Field(default_factory=ExtraConfig)


# ----------------------------------------------------------------------------------------- stage2_ab
class ScheduleConfig(Section):
    """Deterministic A/B schedule: step s is Channel-B iff floor((s+1)*b_ratio) > floor(s*b_ratio)."""

    b_ratio: float | None = Field(
        None, ge=0.0, le=1.0, description="Fraction of optimizer steps on Channel-B."
    )


class AsyncConfig(Section):
    """Async actor-learner (`channel_b.mode: async`): ready-pack queue per learner rank."""

    queue_limit: int = Field(
        8,
        gt=0,
        description="Max ready packs held per rank, counting those reserved for or trained by the current step; beyond it the queued pack of the oldest weight version is dropped.",
    )
    prefetch_target_packs: int = Field(2, gt=0, description="Eligible packs the actor keeps ready.")
    version_window: int = Field(
        2, ge=0, description="A pack is eligible iff its weight version >= current - version_window."
    )
    sync_every_steps: int = Field(1, gt=0, description="Push weights to the servers every N optimizer steps.")
    max_wait_s: float = Field(
        0.0,
        ge=0.0,
        le=3600.0,
        description="A step that wants B waits up to this long for its ready packs before running Channel-A instead (0: no wait). At most `training.collective_timeout_s` minus a margin (a tenth of it, at least 10 s); `version_window: 0` needs it > 0.",
    )
    record_trace: bool = Field(
        False,
        description="Append every record a step trains or drops (step, stream position, record id, weight version) to <output_dir>/async/rank<R>.records.jsonl, and at shutdown those still held (`discarded`): an audit of what each rank learned from, e.g. across a resume.",
    )
    admission_control: bool = Field(
        True,
        description="The actor does not start rollouts whose packs would be stale (beyond version_window) by the step that consumes them; the consume-time gate stays as the safety net.",
    )


class ChannelBConfig(Section):
    """Channel-B (rollout-matching) steps of stage2_ab_training."""

    mode: Literal["micro", "step", "async"] = Field(
        "micro",
        description="micro: rollouts per micro-batch; step: rollouts_per_step per optimizer step (one process); async: actor-learner queues (server mode).",
    )
    rollouts_per_step: int | None = Field(
        None,
        gt=0,
        description="step mode: raw rollouts per optimizer step, a multiple of `rollouts_per_record` K (default bs * world * GAS * K: bs * world * GAS records).",
    )
    enable_pipeline: bool = Field(
        False, description="step mode: overlap rollouts and learning (server mode only)."
    )
    max_carry_age_steps: int = Field(
        4,
        ge=0,
        description="micro mode with `training.packing`: rollout segments that wait in the carry buffer for a later B step (with several ranks every micro-step trains one row and the rest waits) are dropped, not trained, once they are more than this many optimizer steps older than the step (their rollouts came from weights that old); counted in `stage2_ab/micro/carry_dropped_stale`. 0: a B step trains only its own rollouts. The default keeps a segment carried once from one B step to the next down to `schedule.b_ratio` 0.25 (B every 4 steps).",
    )
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class Stage2ABConfig(Section):
    """stage2_ab_training: per optimizer step, Channel-A (GT teacher forcing) or Channel-B (rollout matching)."""

    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    channel_b: ChannelBConfig = Field(default_factory=ChannelBConfig)


# ------------------------------------------------------------------------------------------ training
class TrainingConfig(Section):
    """Optimisation and batching; maps onto HF TrainingArguments."""

    output_dir: str = Field("runs/demo/train", description="Checkpoints, logs, TensorBoard.")
    per_device_train_batch_size: int = Field(1, gt=0, description="Samples per device per micro-step.")
    gradient_accumulation_steps: int = Field(
        1, gt=0, description="Micro-steps per optimizer step (ignored if effective_batch_size is set)."
    )
    effective_batch_size: int | None = Field(
        None, gt=0, description="If set: gradient_accumulation_steps = ceil(eff / (bs * world))."
    )
    packing: bool = Field(False, description="Pack segments into padding-free rows after rollouts.")
    global_max_length: int = Field(2048, gt=0, description="Max tokens of one sample; packing_length.")
    carry_buffer_size: int = Field(
        64, gt=0, description="Packing: max segments waiting for a row (per rank)."
    )
    seed: int = Field(42, description="Seed of initialisation, data order and rollout sampling.")
    learning_rate: float = Field(1e-5, gt=0.0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    warmup_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Fraction of steps with linear LR warmup.")
    lr_scheduler_type: str = Field("constant", description="HF scheduler name: constant, linear, cosine, ...")
    lr_scheduler_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra arguments of the scheduler, e.g. `{num_decay_steps: 200}` for `warmup_stable_decay` (a cool-down over the last 200 steps).",
    )
    max_grad_norm: float = Field(1.0, ge=0.0, description="Gradient clipping norm (0: off).")
    num_train_epochs: float = Field(1.0, gt=0.0, description="Epochs over train_jsonl (when max_steps <= 0).")
    max_steps: int = Field(-1, ge=-1, description="> 0 overrides num_train_epochs; -1: use the epochs.")
    logging_steps: int = Field(
        10,
        gt=0,
        description="Log metrics every N optimizer steps: one short line on the console (loss, lr, grad_norm, "
        "f1, ...), every metric to <output_dir>/metrics.jsonl and TensorBoard (docs/metrics.md).",
    )
    log_rollouts_every: int = Field(
        50,
        ge=0,
        description="Rank 0 logs `log_rollouts_count` of the rollouts an optimizer step trains on, at the first "
        "step that trains rollouts and then at every N-th step (a due step that trains none passes it on): a "
        "picture each (GT / matched / false positive / missed boxes, the parse failure) to TensorBoard and W&B "
        "when in `report_to`, and <output_dir>/rollouts/step-N.jsonl (raw rollouts, parse, match, target "
        "summary) with step-N/*.png beside it. 0: off. About 0.06 s of CPU per logged rollout (docs/runbook.md).",
    )
    log_rollouts_count: int = Field(
        4, gt=0, description="Rollouts logged per logged step (`log_rollouts_every`), other records first."
    )
    save_steps: int = Field(500, gt=0, description="Checkpoint every N optimizer steps.")
    save_total_limit: int | None = Field(2, gt=0, description="Keep at most N checkpoints (null: all).")
    report_to: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        description="HF logging integrations, a list or one name as HF takes it (`wandb`); [] or `none` for none.",
    )
    mixed_precision: Literal["no", "bf16", "fp16"] = Field(
        "no",
        description="Compute (autocast) dtype while the weights and optimizer state stay in model.dtype (which "
        "must then be float32): HF `bf16`/`fp16`; under DeepSpeed its bf16 mode, which keeps fp32 master "
        "weights. Rollout engines then run in this dtype (vLLM `--dtype`). `no`: compute in model.dtype.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory."
    )
    freeze: list[Literal["vision_tower", "merger", "language_model"]] = Field(
        default_factory=list,
        description="Module groups that are not trained: `vision_tower` (`model.visual.*` but its mergers), "
        "`merger` (`model.visual.*merger*`: the patch merger and Qwen3-VL's deepstack mergers), `language_model` "
        "(everything outside `model.visual`, with the embeddings and `lm_head`). Frozen weights are sent to rollout "
        "engines once, then left out of weight syncs. Not with `model.lora.enabled`.",
    )
    lr_multipliers: dict[Literal["vision_tower", "merger", "language_model"], float] = Field(
        default_factory=dict,
        description="Per module group (as in `freeze`): its learning rate is `learning_rate` x this, through "
        "warmup and decay, e.g. `{vision_tower: 0.1}`; a group not listed gets 1. Not with `model.lora.enabled`.",
    )
    resume_from_checkpoint: str | None = Field(
        "auto",
        description="Where training starts. `auto`: from the newest complete checkpoint under `output_dir` when "
        "there is one, else step 0 (a resubmitted, requeued or rerun job goes on; with `overwrite_output_dir: "
        "true`, step 0). `latest`: the same, also under `overwrite_output_dir`. A checkpoint dir: that one (it "
        "must be complete). null: step 0, refused over complete checkpoints unless `overwrite_output_dir`. "
        "Checkpoints that exist but none complete, or saved by another world size, are refused.",
    )
    overwrite_output_dir: bool = Field(
        False,
        description="Start at step 0 although `output_dir` holds complete checkpoints of an earlier run (with "
        "`resume_from_checkpoint` `auto` or null); `save_total_limit` then deletes them as new ones are saved. "
        "Applies to every start of that config, a resubmitted job's included: remove it once the new run saved "
        "its first checkpoint.",
    )
    deepspeed: str | None = Field(None, description="DeepSpeed JSON config path (HF Trainer integration).")
    dataloader_num_workers: int = Field(0, ge=0, description="DataLoader worker processes (0: main process).")
    collective_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="Timeout of every cross-rank wait. Waits other ranks sit out in a collective leave it a margin (a tenth, at least 10 s): `stage2_ab.channel_b.async.max_wait_s` and, with several ranks, `vllm.server.timeout_s` (the first push's group init).",
    )
    eval_strategy: Literal["no", "steps", "epoch"] | None = Field(
        None,
        description="Detection eval on data.val_jsonl during training (docs/runbook.md); null: `steps` if "
        "eval_steps is set, else `no`.",
    )
    eval_steps: int | None = Field(
        None, gt=0, description="Evaluate every N optimizer steps (eval_strategy steps; null: logging_steps)."
    )
    metric_for_best_model: str | None = Field(
        None,
        description="Eval metric that picks the best checkpoint (HF's metric_for_best_model): eval/f1, "
        "eval/precision, eval/recall, eval/mean_iou, eval/map, eval/map_50, eval/map_75 (higher is better) or "
        "eval/truncated_frac (lower). With hf_args.load_best_model_at_end the final model is the best one.",
    )
    hf_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other HF TrainingArguments field, passed through as written, e.g. {optim: adamw_torch, "
        "adam_beta2: 0.95, run_name: x, torch_compile: false, save_strategy: steps, load_best_model_at_end: "
        "true}. Checked at load against the installed transformers (unknown names, types, its own rules); "
        "fields set by a typed key or by the trainer are refused with the reason (docs/runbook.md).",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_integration_as_a_list(cls, value: Any) -> Any:
        """HF takes one name as a string (`report_to: wandb`); `none` is HF's spelling of []."""
        if isinstance(value, str):
            return [] if value == "none" else [value]
        return value

    def gradient_accumulation(self, world_size: int) -> int:
        """GAS in force: derived from ``effective_batch_size`` when set (a ceiling)."""
        if self.effective_batch_size is None:
            return self.gradient_accumulation_steps
        return max(1, math.ceil(self.effective_batch_size / (self.per_device_train_batch_size * world_size)))


# Lower edges of the GT-count buckets of the per-bucket metrics (eval.count_buckets): 1-3, 4-7, 8-12,
# 13-19, 20-25, 26-30, 31+, suited to 1-30 objects per image.
DEFAULT_COUNT_BUCKETS: tuple[int, ...] = (1, 4, 8, 13, 20, 26, 31)


class PreflightConfig(Section):
    """The check before rollout training (`rollmatch preflight`, docs/runbook.md "Preflight")."""

    records: int = Field(
        16,
        ge=0,
        description="Training records rank 0 rolls out with the start model before a rollout-training run (any variant but `sft`) trains; 0 skips the check. 16 greedy rollouts take seconds on a GPU and tell a model that answers in the format from one that does not.",
    )
    min_valid_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="The run stops, with the report, when fewer of those rollouts than this are valid (a closed list, every element valid with a known label, not truncated, the record fits the length budget). 0.5: below half, Channel-B's targets are mostly the GT appended to a bare `[` and GRPO's rewards mostly the floor, so rollout training spends its compute on what stage-1 SFT does cheaper; a stage-1 model answers nearly all in the format. Lower it (0 disables the stop) to train anyway.",
    )


class EvalConfig(Section):
    """Evaluation rollouts (`rollmatch eval` and end-of-training evaluation)."""

    max_new_tokens: int | None = Field(None, gt=0, description="Default: rollout_matching.max_new_tokens.")
    batch_size: int = Field(8, gt=0, description="Samples per rollout call during evaluation.")
    max_samples: int | None = Field(None, gt=0, description="Evaluate only the first N records (null: all).")
    decoding: DecodingConfig = Field(
        default_factory=DecodingConfig,
        description="How evaluation decodes (default greedy): its own settings, never "
        "custom.extra.rollout_matching.decoding, so runs that sample their rollouts are scored alike; the "
        "eval JSON records it. Sampled: request i of a call is seeded training.seed + batch offset + i.",
    )
    count_buckets: list[int] = Field(
        default_factory=lambda: list(DEFAULT_COUNT_BUCKETS),
        description="Lower edges of the GT-count buckets of the per-bucket precision / recall / F1 (eval JSON "
        "`gt_count_buckets`, `eval/gt_count_<bucket>/*`, and the rollouts' `match/gt_count_<bucket>/*`): "
        "[1, 4, 8, 13, 20, 26, 31] gives 1-3, 4-7, 8-12, 13-19, 20-25, 26-30, 31+. Strictly increasing, >= 0; "
        "images below the first edge form a bucket of their own.",
    )
    matching: MatchingConfig = Field(
        default_factory=MatchingConfig,
        description="How evaluation matches predictions to GT (its own section, so runs trained with other `matching.*` settings are scored alike; every report states it).",
    )

    @field_validator("count_buckets")
    @classmethod
    def _increasing_edges(cls, edges: list[int]) -> list[int]:
        if not edges or edges[0] < 0 or any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError(
                f"eval.count_buckets = {edges}: give the buckets' lower edges, non-empty, >= 0 and strictly "
                "increasing, e.g. [1, 4, 8, 13, 20, 26, 31]"
            )
        return edges


# -------------------------------------------------------------------------------------------- launch
NodeRole = Literal["servers", "learner", "both"]


class NodesConfig(Section):
    """The machines one `rollmatch launch` per node spans (docs/runbook.md, "Launch")."""

    count: int = Field(1, gt=0, description="Nodes taking part; one `rollmatch launch` runs on each.")
    rank: int = Field(
        0, ge=0, description="This node's index in 0..count-1 (set per node, e.g. `launch.nodes.rank=1`)."
    )
    hosts: list[str] = Field(
        default_factory=list,
        description="Each node's address, in rank order (servers on node i bind hosts[i]; the learner reaches them "
        "there); needed when count > 1. Empty: one node on 127.0.0.1.",
    )
    rendezvous: str | None = Field(
        None,
        description="HOST:PORT of the learner's torchrun c10d rendezvous (a learner node's address); needed when "
        "count > 1. null on one node: 127.0.0.1 and a free port (or the last of --port-base's).",
    )
    rendezvous_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="torchrun's `--rdzv-id`: two jobs whose learners meet at one HOST:PORT join only their own "
        "rendezvous. null: a random id on one node; on several nodes `rollmatch-<hash of training.output_dir "
        "and the rendezvous>` (the same on every node). The script of `--emit slurm` sets the Slurm job id.",
    )
    roles: list[NodeRole] = Field(
        default_factory=list,
        description="What each node runs, in rank order: `servers`, `learner` or `both`. Empty: every node runs both.",
    )
    join_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="How long torchrun waits for every learner node to join the rendezvous, and every launcher "
        "for every node's first heartbeat.",
    )
    heartbeat_port: int | None = Field(
        None,
        ge=1024,
        lt=65536,
        description="Port on hosts[0] where node 0's launcher collects every node's heartbeat (count > 1). "
        "null: the rendezvous port + 1.",
    )
    heartbeat_timeout_s: float = Field(
        30.0,
        gt=0.0,
        le=3600.0,
        description="A node silent this long is lost: every other node stops its processes and exits non-zero "
        "naming it (count > 1).",
    )

    def heartbeat_endpoint(self) -> tuple[str, int]:
        """Where node 0's launcher collects the heartbeats (``count`` > 1, hosts and rendezvous set)."""
        port = self.heartbeat_port or int((self.rendezvous or ":0").rpartition(":")[2]) + 1
        return self.hosts[0], port

    def role(self, rank: int) -> NodeRole:
        """What node ``rank`` runs (``both`` when ``roles`` is empty)."""
        return self.roles[rank] if self.roles else "both"


class SlurmSettings(Section):
    """What the script of `rollmatch launch --emit slurm` asks Slurm for, per node (docs/runbook.md, "Slurm").
    `sbatch --<option>=... job.sbatch` still overrides any of them at submission."""

    exclusive: bool = Field(
        True,
        description="`#SBATCH --exclusive`: every CPU of each node for its servers, learner ranks and actor "
        "threads. false: set cpus_per_task (Slurm's default is one CPU for the whole node's launch).",
    )
    cpus_per_task: int | None = Field(
        None,
        gt=0,
        description="`#SBATCH --cpus-per-task`: CPUs per node (one task per node). null: not written.",
    )
    mem: str | None = Field(
        "0",
        pattern=r"^[0-9]+[KMGT]?$",
        description="`#SBATCH --mem` per node, e.g. `480G`; `0`: all of each node's memory. null: not written "
        "(the partition's default, often a few GB per CPU).",
    )
    signal_warning_s: int | None = Field(
        120,
        gt=0,
        description="`#SBATCH --signal=USR1@<s>`: this long before the time limit Slurm signals every step (each "
        "node's `rollmatch launch`; not `B:USR1`, which would signal only the batch shell); the learner saves a "
        "complete checkpoint and stops, and the job requeues itself (`requeue`). Leave it above one save + one step "
        "+ `stage2_ab.channel_b.async.max_wait_s`: the learner measures the first two and warns when it is not. "
        "null: no warning signal.",
    )
    requeue: bool = Field(
        True,
        description="`#SBATCH --requeue`: a preempted job, or one stopped by the warning signal, goes back to the "
        "queue and resumes from its latest complete checkpoint (`training.resume_from_checkpoint=latest`); without "
        "it, resubmit the script: `auto` (the default) resumes as well.",
    )
    options: list[str] = Field(
        default_factory=list,
        description="Further `#SBATCH` options, written as given, e.g. [--partition=gpu, --time=24:00:00, "
        "--account=vision].",
    )


class LaunchSettings(Section):
    """`rollmatch launch`: which devices run rollout servers and the learner, on which nodes. The launch
    flags named beside a key set it (`--server-devices 0,1` is the override `launch.server_devices=[0,1]`,
    applied last), so the rules below judge flags and keys alike."""

    server_devices: list[int] = Field(
        default_factory=list,
        description="GPUs of the rollout servers on each node that runs servers (`--server-devices`).",
    )
    learner_devices: list[int] = Field(
        default_factory=list,
        description="GPUs of the learner on each node that runs it, one torchrun rank each (`--learner-devices`).",
    )
    tensor_parallel_size: int = Field(
        1,
        gt=0,
        description="GPUs per rollout server; servers per node = server devices / this (`--tensor-parallel-size`). "
        "Its own default, independent of the colocated engine's `vllm.tensor_parallel_size`.",
    )
    servers_per_node: int | None = Field(
        None,
        gt=0,
        description="With `--cpu`: servers per server node (default 1, `--servers`). On GPUs the devices decide; "
        "when set it must equal server devices / tensor_parallel_size.",
    )
    learner_procs_per_node: int | None = Field(
        None,
        gt=0,
        description="With `--cpu`: learner ranks per learner node (default 1, `--learner-procs`). On GPUs the "
        "devices decide; when set beside learner devices it must equal their count.",
    )
    port_base: int | None = Field(
        None,
        ge=1024,
        lt=65536,
        description="Fixed ports from here: server i gets HTTP port_base+2i and group port +2i+1 on its node "
        "(`--port-base`). Needed when nodes.count > 1 (every node must know every server's port); null: free ports.",
    )
    engine: Literal["vllm", "hf"] = Field("vllm", description="Rollout server engine (`--engine`).")
    grace_s: float = Field(
        10.0, ge=0.0, description="Seconds between SIGTERM and SIGKILL at teardown (`--grace-s`)."
    )
    restart_servers: int = Field(
        0,
        ge=0,
        description="Restarts per rollout server that exits or stops answering /health/ for "
        "`vllm.server.timeout_s`, on the same devices and port, with backoff (1, 2, 4 ... 30 s); one that "
        "keeps dying is given up (exit 3). 0: a dead server ends the launch. Pair with "
        "`vllm.server.min_healthy` so the learner trains on while it is away (docs/runbook.md 'When a server "
        "dies').",
    )
    nodes: NodesConfig = Field(default_factory=NodesConfig)
    slurm: SlurmSettings = Field(default_factory=SlurmSettings)


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
