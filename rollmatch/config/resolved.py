"""The run resolved once at start-up: every value a config leaves to the launch or the checkpoint.

Owns: :class:`ResolvedRun` (frozen) and :func:`resolve_run` (:func:`resolve_run_on_this_machine`
with the devices this process sees), the one place where a run's runtime rules are checked
(``config.rules.check_runtime``: world size, devices; ``vllm.server.min_healthy`` against the
servers) and its derived values are worked out: the weight-sync mode in force (``sync.mode: auto``
resolved), the rollout servers as one list (whichever form configured them), the coordinate frame
(``data.coord_frame: auto`` resolved from the checkpoint's family), the processor's pixel bounds,
the gradient accumulation steps for the world size, and the rollout and evaluation decodings
(``config.decoding``). Builders (the prompt encoder, the rollout backends, the trainer) take the
resolved run and never run the rules again; :func:`resolved_values` is what ``rollmatch
check-config`` prints of it before any launch is known.

Leaves out: the rules themselves (``config.rules``) and the frame table (``config.frames``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from rollmatch.config import rules
from rollmatch.config.decoding import Decoding, eval_decoding, rollout_decoding
from rollmatch.config.frames import Frame, fixed_coord_frame, resolve_coord_frame
from rollmatch.config.schema import RollmatchConfig, ServerEndpoint
from rollmatch.errors import ConfigError, ConfigProblem

PixelBounds = tuple[int | None, int | None]  # (data.min_pixels, data.max_pixels); None keeps the saved value


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
    coord_frame: Frame
    pixel_bounds: PixelBounds
    gradient_accumulation_steps: int
    decoding: Decoding  # the rollouts' (custom.extra.rollout_matching.decoding, max_new_tokens)
    eval_decoding: Decoding  # evaluation's (eval.decoding, default greedy; eval.max_new_tokens)

    @property
    def model_dir(self) -> str:
        return self.config.model.path

    def as_dict(self) -> dict[str, Any]:
        """The resolved values as plain JSON-able data."""
        return {
            "world_size": self.world_size,
            "sync_mode": self.sync_mode,
            "servers": [endpoint.model_dump() for endpoint in self.servers],
            "coord_frame": self.coord_frame,
            "min_pixels": self.pixel_bounds[0],
            "max_pixels": self.pixel_bounds[1],
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
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
) -> ResolvedRun:
    """Check the runtime rules and resolve ``cfg`` for this launch; raise one :class:`ConfigError`
    listing every problem (``problems``: the caller's own, e.g. an unusable checkpoint, reported
    with them).

    ``device_count`` is the number of visible accelerators (0 on a CPU machine), ``device_type``
    ``cpu`` or ``cuda``.
    """
    found = list(problems or [])
    found.extend(
        rules.check_runtime(cfg, world_size=world_size, device_count=device_count, device_type=device_type)
    )
    frame: Frame | None = None
    servers: list[ServerEndpoint] = []
    try:
        frame = resolve_coord_frame(
            cfg.data.coord_frame, cfg.model.path, object_format=cfg.custom.object_format
        )
    except ConfigError as error:
        found.extend(error.problems)
    try:
        servers = rules.resolve_servers(cfg.rollout.vllm.server)
    except ConfigError as error:
        found.extend(error.problems)
    if servers:
        found.extend(rules.min_healthy_problems(cfg.rollout.vllm.server.min_healthy, len(servers)))
    if found or frame is None:
        raise ConfigError(found)
    return ResolvedRun(
        config=cfg,
        world_size=world_size,
        sync_mode=rules.resolve_sync_mode(cfg),
        servers=tuple(servers),
        coord_frame=frame,
        pixel_bounds=(cfg.data.min_pixels, cfg.data.max_pixels),
        gradient_accumulation_steps=cfg.training.gradient_accumulation(world_size),
        decoding=rollout_decoding(cfg),
        eval_decoding=eval_decoding(cfg),
    )


def resolve_run_on_this_machine(
    cfg: RollmatchConfig, *, world_size: int = 1, problems: list[ConfigProblem] | None = None
) -> ResolvedRun:
    """:func:`resolve_run` with the devices this process sees (CUDA when available, else the CPU)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return resolve_run(
        cfg,
        world_size=world_size,
        device_count=gpus,
        device_type="cuda" if gpus else "cpu",
        problems=problems,
    )


def resolved_values(cfg: RollmatchConfig) -> dict[str, Any]:
    """What ``check-config`` resolves without a launch: :meth:`ResolvedRun.as_dict` for one process.

    The coordinate frame stays ``auto`` while ``model.path`` has no ``config.json`` yet (it is
    resolved when the run starts); raises :class:`ConfigError` when ``auto`` cannot resolve.
    """
    frame: str | None = fixed_coord_frame(cfg.data.coord_frame, cfg.custom.object_format)
    if frame is None and (Path(cfg.model.path) / "config.json").is_file():
        frame = resolve_coord_frame(
            cfg.data.coord_frame, cfg.model.path, object_format=cfg.custom.object_format
        )
    servers = rules.resolve_servers(cfg.rollout.vllm.server)
    if servers and (floor := rules.min_healthy_problems(cfg.rollout.vllm.server.min_healthy, len(servers))):
        raise ConfigError(floor)
    return {
        "world_size": 1,
        "sync_mode": rules.resolve_sync_mode(cfg),
        "servers": [endpoint.model_dump() for endpoint in servers],
        "coord_frame": frame or "auto",
        "min_pixels": cfg.data.min_pixels,
        "max_pixels": cfg.data.max_pixels,
        "gradient_accumulation_steps": cfg.training.gradient_accumulation(1),
        "decoding": asdict(rollout_decoding(cfg)),
        "eval_decoding": asdict(eval_decoding(cfg)),
    }
