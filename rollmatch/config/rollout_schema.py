"""The rollout sections of the schema: ``custom`` (trainer variant, object format) and its
``extra.rollout_matching`` (backend, decoding, K, decode batch, the vLLM engine, its servers and weight
sync, offload), also written as the top-level ``rollout:`` section (``config.spelling``).

Owns the pydantic models and :data:`ROLLOUT_KEY`; every key's default and description lives here once.
Leaves out: the rules across them (``config.rollout_rules``, ``config.server_rules``,
``config.engine_rules``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollmatch.config.section import Section

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
