"""The run resolved once at start-up: every rule checked, every value a config leaves to the launch or
the checkpoint worked out. The one door to a run: ``rollmatch check-config`` and ``rollmatch train``
both call :func:`resolve_run`.

Owns: :class:`ResolvedRun` (frozen), :class:`Launch` (world size and devices; :func:`this_launch`)
and :func:`resolve_run` (:func:`resolve_run_on_this_machine` with the devices this process sees),
which checks every rule of the config once (``config.rules.check_run``: static and runtime) and
works out its derived values: the weight-sync mode in force (``sync.mode: auto`` resolved), the
rollout servers as one list (whichever form configured them), the coordinate frame
(``data.coord_frame: auto`` resolved from the checkpoint's family), the processor's pixel bounds,
the gradient accumulation steps for the world size, the rollout decode batch and the rollout and
evaluation decodings (``config.decoding``). Builders (the prompt encoder, the rollout backends, the
trainer) take the resolved run and never run the rules again; :meth:`ResolvedRun.as_dict` is what
``rollmatch check-config --json`` prints of it. Problems are reported as the user wrote the keys
(``config.spelling``).

Leaves out: the rules themselves (``config.rules``) and the frame table (``config.frames``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from rollmatch.config import rules
from rollmatch.config.decoding import Decoding, eval_decoding, rollout_decoding
from rollmatch.config.frames import Frame, fixed_coord_frame, resolve_coord_frame
from rollmatch.config.rollout_rules import resolve_sync_mode
from rollmatch.config.schema import RollmatchConfig, ServerEndpoint
from rollmatch.config.server_rules import resolve_servers, server_problems
from rollmatch.config.spelling import spelling_of
from rollmatch.errors import ConfigError, ConfigProblem

PixelBounds = tuple[int | None, int | None]  # (data.min_pixels, data.max_pixels); None keeps the saved value
STAGE2_DECODE_BATCH = 2  # Channel-B's records per rollout call when decode_batch_size is null


@dataclass(frozen=True)
class Launch:
    """What a run is resolved for: learner processes, and the accelerators each one sees."""

    world_size: int = 1
    device_count: int = 0  # visible accelerators (0 on a CPU machine)
    device_type: Literal["cpu", "cuda"] = "cpu"


@dataclass(frozen=True)
class ResolvedRun:
    """One run as it will execute: the validated config plus the values resolved from the launch.

    ``config`` is the loaded config (its ``auto`` settings left as written); every field below is
    the value in force. Build it with :func:`resolve_run`.
    """

    config: RollmatchConfig
    world_size: int
    sync_mode: Literal["full", "adapter"]
    servers: tuple[ServerEndpoint, ...]  # empty unless vllm.mode: server configured some
    coord_frame: Frame | None  # None only where resolve_run(model_required=False) found no checkpoint yet
    pixel_bounds: PixelBounds
    gradient_accumulation_steps: int
    decoding: Decoding  # the rollouts' (custom.extra.rollout_matching.decoding, max_new_tokens)
    eval_decoding: Decoding  # evaluation's (eval.decoding, default greedy; eval.max_new_tokens)
    # Records per rollout call (custom.extra.rollout_matching.decode_batch_size); None: a micro-batch's records
    rollout_decode_batch_size: int | None = None

    @property
    def model_dir(self) -> str:
        return self.config.model.path

    @property
    def frame(self) -> Frame:
        """The coordinate frame in force (a run that builds anything has resolved it)."""
        if self.coord_frame is None:
            raise ConfigError(
                [
                    ConfigProblem(
                        "data.coord_frame",
                        "auto",
                        f"unresolved: {self.model_dir} has no config.json to read the model family from; "
                        "point model.path at the checkpoint, or set data.coord_frame: norm1000 or pixels",
                    )
                ]
            )
        return self.coord_frame

    def as_dict(self) -> dict[str, Any]:
        """The resolved values as plain JSON-able data."""
        return {
            "world_size": self.world_size,
            "sync_mode": self.sync_mode,
            "servers": [endpoint.model_dump() for endpoint in self.servers],
            "coord_frame": self.coord_frame or "auto",
            "min_pixels": self.pixel_bounds[0],
            "max_pixels": self.pixel_bounds[1],
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "rollout_decode_batch_size": self.rollout_decode_batch_size,
            "decoding": asdict(self.decoding),
            "eval_decoding": asdict(self.eval_decoding),
        }


def resolve_run(
    cfg: RollmatchConfig,
    *,
    world_size: int,
    device_count: int,
    device_type: str,
    problems: list[ConfigProblem] | None = None,
    model_required: bool = True,
) -> ResolvedRun:
    """Check every rule of ``cfg`` for this launch and resolve it; raise one :class:`ConfigError`
    listing every problem (``problems``: the caller's own, e.g. a missing input or an unusable
    checkpoint, reported with them), keys spelled as the user wrote them.

    ``device_count`` is the number of visible accelerators (0 on a CPU machine), ``device_type``
    ``cpu`` or ``cuda``. ``model_required=False`` (``check-config --schema-only``, before the
    checkpoint exists): ``data.coord_frame: auto`` stays unresolved while ``model.path`` has no
    ``config.json``.
    """
    found = list(problems or [])
    found.extend(
        rules.check_run(cfg, world_size=world_size, device_count=device_count, device_type=device_type)
    )
    frame: Frame | None = None
    try:
        frame = fixed_coord_frame(cfg.data.coord_frame, cfg.custom.object_format)
        if frame is None and (model_required or (Path(cfg.model.path) / "config.json").is_file()):
            frame = resolve_coord_frame(
                cfg.data.coord_frame, cfg.model.path, object_format=cfg.custom.object_format
            )
    except ConfigError as error:
        found.extend(error.problems)
    server_cfg = cfg.rollout.vllm.server
    servers = [] if server_problems(server_cfg) else resolve_servers(server_cfg)  # rule_servers reports them
    if found or (frame is None and model_required):
        raise ConfigError(spelling_of(cfg).as_written(found))
    return ResolvedRun(
        config=cfg,
        world_size=world_size,
        sync_mode=resolve_sync_mode(cfg),
        servers=tuple(servers),
        coord_frame=frame,
        pixel_bounds=(cfg.data.min_pixels, cfg.data.max_pixels),
        gradient_accumulation_steps=cfg.training.gradient_accumulation(world_size),
        decoding=rollout_decoding(cfg),
        eval_decoding=eval_decoding(cfg),
        rollout_decode_batch_size=rollout_decode_batch_size(cfg),
    )


def rollout_decode_batch_size(cfg: RollmatchConfig) -> int | None:
    """Records per rollout call: ``decode_batch_size``, or by default a micro-batch's records under
    ``rollout_matching_sft`` (None) and :data:`STAGE2_DECODE_BATCH` under ``stage2_ab_training``."""
    if cfg.rollout.decode_batch_size is not None:
        return cfg.rollout.decode_batch_size
    return STAGE2_DECODE_BATCH if cfg.custom.trainer_variant == "stage2_ab_training" else None


def this_launch(world_size: int | None = None, *, without_torch: bool = False) -> Launch:
    """The launch of this process: ``world_size`` (default: torchrun's ``WORLD_SIZE``, else 1) and the
    CUDA devices it sees (none: the CPU).

    ``without_torch``: count the devices from the NVIDIA driver's listing instead of importing torch
    (``check-config --schema-only`` stays a light command): ``/proc/driver/nvidia/gpus``, narrowed by
    ``CUDA_VISIBLE_DEVICES`` when that is set.
    """
    gpus = _driver_gpu_count() if without_torch else _torch_gpu_count()
    ranks = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    return Launch(world_size=ranks, device_count=gpus, device_type="cuda" if gpus else "cpu")


def _torch_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _driver_gpu_count() -> int:
    listed = Path("/proc/driver/nvidia/gpus")
    count = len(list(listed.iterdir())) if listed.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return count
    return min(count, len([part for part in visible.split(",") if part.strip() and part.strip() != "-1"]))


def resolve_run_on_this_machine(
    cfg: RollmatchConfig, *, world_size: int = 1, problems: list[ConfigProblem] | None = None
) -> ResolvedRun:
    """:func:`resolve_run` with the devices this process sees (CUDA when available, else the CPU)."""
    launch = this_launch(world_size)
    return resolve_run(
        cfg,
        world_size=launch.world_size,
        device_count=launch.device_count,
        device_type=launch.device_type,
        problems=problems,
    )
