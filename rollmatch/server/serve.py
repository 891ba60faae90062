"""``rollmatch serve``: the rollout-server process: engine, limits, token, HTTP loop, and a bounded stop.

Owns: :func:`serve_command` (flags -> API key + :class:`~rollmatch.server.limits.ServerLimits` +
:class:`~rollmatch.server.media.MediaPolicy` + engine -> uvicorn; the key and the bind address are
checked before the model loads, see :func:`server_access`) and the stop guarantee: on
SIGTERM / SIGINT the HTTP loop drains for at most ``SHUTDOWN_GRACE_S``, the engine is closed in
a bounded wait, and if anything is still stuck (a generation that never returns), the process
leaves with ``os._exit`` (exit code ``FORCED_EXIT_CODE``) at most ``HARD_EXIT_AFTER_S`` after the
signal. Leaves out: routes (``server.app``) and behaviour (``server.rollout_server``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import uvicorn

from rollmatch.config.frames import resolve_coord_frame
from rollmatch.config.run_file import RUN_FILE, read_run_file
from rollmatch.errors import ConfigError
from rollmatch.protocol import API_KEY_ENV
from rollmatch.server.app import build_app
from rollmatch.server.connections import guarded_h11_protocol, raise_open_file_limit
from rollmatch.server.engines import build_engine
from rollmatch.server.gate import check_exposure, server_api_key, server_sync_key
from rollmatch.server.limits import server_limits
from rollmatch.server.media import MediaPolicy
from rollmatch.server.rollout_server import RolloutServer

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 2.0
HARD_EXIT_AFTER_S = 4.5
FORCED_EXIT_CODE = 3


def serve_command(args: argparse.Namespace) -> int:
    """``rollmatch serve``: load the engine, then serve until SIGTERM / SIGINT (see the module docstring)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = server_access(args)
    sync_key = server_sync_key(
        getattr(args, "sync_key", None), getattr(args, "sync_key_file", None), os.environ, api_key
    )
    apply_saved_run_settings(args)
    limits = server_limits(args)
    media_root = getattr(args, "allowed_local_media_path", None)
    media = MediaPolicy(
        allowed_root=Path(media_root) if media_root else None,
        max_pixels=limits.max_image_pixels,
        max_file_bytes=limits.max_body_bytes,  # a local image may be as large as a request body
    )
    engine = build_engine(
        args.engine,
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_lora=bool(getattr(args, "enable_lora", False)),
        max_num_seqs=getattr(args, "max_num_seqs", None),
        vllm_settings=vllm_flag_settings(args),
        min_pixels=getattr(args, "min_pixels", None),
        max_pixels=getattr(args, "max_pixels", None),
        media=media,
        max_images=limits.max_images_per_request,
    )
    server = RolloutServer(engine, limits, coord_frame=served_coord_frame(args), sync_key=sync_key)
    if api_key is None:
        log.warning(
            "no API key: every endpoint, weight sync included, is open to anyone who can reach %s:%d; "
            "start with --api-key-file PATH or %s=KEY (the trainer reads the same variable)",
            args.host,
            args.port,
            API_KEY_ENV,
        )
    log.info(
        "rollout server (%s engine, %s) on http://%s:%d; engine picked for this machine: device %s, dtype %s, "
        "max_model_len %d, tensor_parallel_size %d (flags --dtype, --max-model-len, --tensor-parallel-size); "
        "local media: %s; limits: %s",
        engine.name,
        args.model,
        args.host,
        args.port,
        "cuda" if torch.cuda.is_available() else "cpu",
        args.dtype,
        args.max_model_len,
        args.tensor_parallel_size,
        media.allowed_root or "refused",
        limits,
    )
    raise_open_file_limit()  # every connection is a file descriptor
    config = uvicorn.Config(
        build_app(server, api_key=api_key),
        host=args.host,
        port=args.port,
        log_level="warning",
        ws="none",  # no route takes a websocket: an upgrade request is served as plain HTTP
        http=guarded_h11_protocol(limits.request_read_timeout_s, limits.max_connections),
        timeout_keep_alive=max(1, round(limits.keep_alive_timeout_s)),
        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
    )
    _BoundedStopServer(config).run()
    return _close_within(server, HARD_EXIT_AFTER_S - SHUTDOWN_GRACE_S - 1.0)


def vllm_flag_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM engine settings given on the command line (``VllmEngineSettings`` fields; unset flags
    keep the engine's defaults)."""
    names = ("gpu_memory_utilization", "enable_prefix_caching", "enforce_eager", "kv_cache_space_gib")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def server_access(args: argparse.Namespace) -> str | None:
    """The API key (``None``: none) from ``--api-key`` / ``--api-key-file`` / ``$ROLLMATCH_API_KEY``,
    once ``--host`` is allowed without one (loopback, or ``--insecure-no-auth``); else a ``ConfigError``
    naming the flag and the fix (see :mod:`rollmatch.server.gate`)."""
    api_key = server_api_key(getattr(args, "api_key", None), getattr(args, "api_key_file", None), os.environ)
    check_exposure(args.host, api_key, insecure_no_auth=bool(getattr(args, "insecure_no_auth", False)))
    return api_key


def apply_saved_run_settings(args: argparse.Namespace) -> None:
    """``--model``'s ``rollmatch_run.json`` (a run's checkpoint, ``final/`` or export) sets the pixel
    bounds and coordinate frame the flags leave at their defaults; a flag given overrides it."""
    saved = read_run_file(args.model)
    if saved is None:
        return
    settings = saved["settings"]
    taken = []
    for flag, key in (("min_pixels", "data.min_pixels"), ("max_pixels", "data.max_pixels")):
        if getattr(args, flag, None) is None and settings.get(key) is not None:
            setattr(args, flag, settings[key])
            taken.append(f"{flag} {settings[key]}")
    if getattr(args, "coord_frame", "auto") == "auto":
        args.coord_frame = settings["data.coord_frame"]
        taken.append(f"coord_frame {args.coord_frame}")
    if taken:
        log.info("from %s/%s: %s", args.model, RUN_FILE, ", ".join(taken))


def served_coord_frame(args: argparse.Namespace) -> str | None:
    """``--coord-frame`` resolved on ``--model`` (the trainer's resolution); ``auto`` on a family with
    no known pretraining frame reports ``None`` (not compared), with a warning."""
    setting = getattr(args, "coord_frame", "auto")
    try:
        return resolve_coord_frame(setting, args.model)
    except ConfigError as exc:
        log.warning("--coord-frame auto: %s; GET /info/ reports no frame", exc.problems[0].fix)
        return None


class _BoundedStopServer(uvicorn.Server):
    """uvicorn's server whose exit signal also arms a hard exit (a stuck generation cannot block it)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        _arm_hard_exit(HARD_EXIT_AFTER_S, f"signal {sig}")
        super().handle_exit(sig, frame)


def _arm_hard_exit(after_s: float, why: str) -> None:
    def leave() -> None:
        log.error("rollout server still running %.1fs after %s (stuck engine?): forcing exit", after_s, why)
        _flush()
        os._exit(FORCED_EXIT_CODE)

    timer = threading.Timer(after_s, leave)
    timer.daemon = True
    timer.start()


def _close_within(server: RolloutServer, seconds: float) -> int:
    """Close the engine and sync group in a bounded wait; exit hard if a worker thread is stuck."""
    closer = threading.Thread(target=server.close, name="server-close", daemon=True)
    closer.start()
    closer.join(timeout=max(seconds, 0.5))
    stuck = [
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.daemon and t.is_alive()
    ]
    if closer.is_alive() or stuck:
        log.error(
            "rollout server: threads still busy at shutdown (%s); leaving without waiting for them",
            stuck or "close",
        )
        _flush()
        time.sleep(0.05)
        os._exit(FORCED_EXIT_CODE)
    return 0


def _flush() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
