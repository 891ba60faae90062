"""The GPU check (``make gpu-check``): what only a GPU machine can prove, in one run of under 10 minutes.

Prints ONE JSON object::

    {"ok": true, "device": "...", "torch": "...", "items": {
        "train_bf16_colocate": {"status": "pass", "seconds": 95.1, "checks": {...}, "figures": {...}},
        "nccl_push_server_killed": {"status": "pass" | "fail" | "unavailable", "why": "...", ...}}}

and exits 0 when every item that could run passed (at least one ran), 1 when one failed, 2 without
CUDA (``{"ok": false, "error": "no CUDA device ..."}``: this is not a CPU check).

Items, each in a process of its own (a crash or an NCCL abort fails that item, not the check), on tiny
random models built offline (``rollmatch.models.tiny``) and generated shapes images: nothing beyond
PyTorch with CUDA and this package (vLLM for the colocated item) is needed, and nothing is downloaded.

- ``train_bf16_colocate``: ``rollmatch train`` in-process on GPU 0, ``model.dtype: bfloat16``,
  ``rollout_matching_sft`` with a colocated vLLM engine at ``sleep_level: 1``: 3 optimizer steps, each a
  rollout, a weight push into the engine, a sleep and a wake. Checks: every step trained with finite
  losses, the final model written, the engine slept and woke. Figures: rollout tokens/s, colocated sync
  GB/s. ``unavailable`` where vLLM is not importable.
- ``nccl_push_server_killed``: two ``rollmatch serve --engine hf`` servers on GPU 1, the learner's model
  on GPU 0, ``min_healthy: 1``: a full NCCL push (figure: sync GB/s), then a push during which the second
  server is SIGKILLed after its first bucket (fault injected at the learner's send). Checks: the learner
  process lives (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` on the sync groups), the push fails over to the
  first server within the group timeout, the first serves the new version, a rollout on it succeeds
  (figure: server tokens/s). ``unavailable`` with one GPU: an NCCL communicator cannot put two ranks on
  one device.

Run: ``make gpu-check`` or ``python tools/gpu_check.py [--items NAME ...] [--item-timeout-s 300]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ITEMS = ("train_bf16_colocate", "nccl_push_server_killed")
DEFAULT_ITEM_TIMEOUT_S = 280.0  # both items under 10 minutes together
SERVER_START_TIMEOUT_S = 180.0
GROUP_TIMEOUT_S = 60.0  # vllm.server.timeout_s of the push item: how long a dead peer may hold a push


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", nargs="+", choices=ITEMS, default=list(ITEMS))
    parser.add_argument("--item-timeout-s", type=float, default=DEFAULT_ITEM_TIMEOUT_S)
    parser.add_argument("--item", choices=ITEMS, help=argparse.SUPPRESS)  # one item, in its own process
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.item_timeout_s <= 0:
        parser.error(f"--item-timeout-s must be positive, got {args.item_timeout_s}")
    return args


def cuda_problem() -> str | None:
    """Why this machine cannot run the check (None: it can)."""
    import torch

    if torch.cuda.is_available():
        return None
    return (
        f"no CUDA device visible (torch {torch.__version__}, CUDA build {torch.version.cuda}): the GPU check "
        "proves what CPU tests cannot; run it on a GPU machine (make gpu-check)"
    )


def summarize(items: dict[str, dict[str, Any]]) -> bool:
    """The check passes when no item failed and at least one ran."""
    statuses = [item.get("status") for item in items.values()]
    return "fail" not in statuses and "pass" in statuses


def run_item_process(item: str, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Run one item in a child process; its last stdout line is its JSON result."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    command = [sys.executable, str(Path(__file__).resolve()), "--item", item, "--workdir", str(workdir)]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        return {"status": "fail", "why": f"timed out after {timeout_s:.0f}s", "log_tail": _text(tail)}
    return item_result(done.returncode, done.stdout, done.stderr, time.monotonic() - started)


def item_result(returncode: int, stdout: str, stderr: str, seconds: float) -> dict[str, Any]:
    """An item process's result: its JSON line, or a failure naming the exit code and the log's tail."""
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if returncode == 0 and lines:
        try:
            result = dict(json.loads(lines[-1]))
        except json.JSONDecodeError:
            result = {"status": "fail", "why": f"unreadable result line: {lines[-1][:200]}"}
    else:
        why = (
            f"exit code {returncode}" if returncode >= 0 else f"killed by {signal.Signals(-returncode).name}"
        )
        result = {"status": "fail", "why": f"the item's process ended without a result ({why})"}
        result["log_tail"] = stderr[-2000:]
    result["seconds"] = round(seconds, 1)
    return result


def _text(data: str | bytes) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data


# ------------------------------------------------------------------------------------------- items
def _tiny(workdir: Path, size: Any = None) -> tuple[Path, dict[str, Path]]:
    from rollmatch.data.shapes import generate_shapes
    from rollmatch.models.tiny import build_tiny_model

    model_dir = build_tiny_model("qwen2_5_vl", workdir / "model", size=size)
    shapes = generate_shapes(workdir / "shapes", n_train=16, n_val=4, size=112, seed=0)
    return model_dir, shapes


def train_bf16_colocate(workdir: Path) -> dict[str, Any]:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return {"status": "unavailable", "why": f"vLLM is not importable here ({exc})"}
    from rollmatch.config.load import load_config_dict
    from rollmatch.rollout import vllm_engine
    from rollmatch.training.entry import run_training

    model_dir, shapes = _tiny(workdir)
    calls: Counter[str] = Counter()
    for name in ("sleep", "wake_up"):
        original = getattr(vllm_engine.VllmEngine, name)

        def counted(self: Any, *args: Any, _name: str = name, _original: Any = original) -> Any:
            calls[_name] += 1
            return _original(self, *args)

        setattr(vllm_engine.VllmEngine, name, counted)
    cfg = load_config_dict(
        {
            "model": {"path": str(model_dir), "dtype": "bfloat16"},
            "data": {"train_jsonl": str(shapes["train"]), "val_jsonl": None, "coord_frame": "norm1000"},
            "custom": {
                "trainer_variant": "rollout_matching_sft",
                "extra": {
                    "rollout_matching": {
                        "rollout_backend": "vllm",
                        "max_new_tokens": 32,
                        "vllm": {
                            "mode": "colocate",
                            "sleep_level": 1,
                            "gpu_memory_utilization": 0.3,
                            "enforce_eager": True,
                        },
                    }
                },
            },
            "training": {
                "output_dir": str(workdir / "run"),
                "max_steps": 3,
                "per_device_train_batch_size": 2,
                "learning_rate": 1e-3,
                "report_to": [],
                "logging_steps": 1,
                "save_steps": 1000,
                "packing": True,
                "global_max_length": 1024,
            },
        }
    )
    result = run_training(cfg)
    logs = [h for h in result.log_history if "loss" in h]
    sync_bytes = sum(h.get("sync/bytes", 0.0) for h in logs)
    sync_s = sum(h.get("sync/seconds", 0.0) for h in logs)
    checks = {
        "trained_3_steps": result.global_step == 3 and len(logs) == 3,
        "finite_losses": all(math.isfinite(h["loss"]) for h in logs),
        "final_model_written": result.final_model_dir is not None
        and (Path(result.final_model_dir) / "config.json").is_file(),
        "engine_slept": calls["sleep"] > 0,
        "engine_woke": calls["wake_up"] > 0,
    }
    return {
        "status": "pass" if all(checks.values()) else "fail",
        "checks": checks,
        "figures": {
            "rollout_tokens_per_s": max((h.get("rollout/tokens_per_s", 0.0) for h in logs), default=0.0),
            "colocate_sync_gb_per_s": round(sync_bytes / sync_s / 1e9, 3) if sync_s > 0 else None,
            "engine_calls": dict(calls),
        },
    }


def nccl_push_server_killed(workdir: Path) -> dict[str, Any]:
    import torch

    if torch.cuda.device_count() < 2:
        return {
            "status": "unavailable",
            "why": f"{torch.cuda.device_count()} GPU(s): the learner and a server need one GPU each (an NCCL "
            "communicator cannot hold two ranks on one device); the CPU suite proves the same failover on gloo",
        }
    from transformers import AutoModelForImageTextToText

    from rollmatch.collectives import LocalCollectives
    from rollmatch.config.resolved import resolve_run_on_this_machine
    from rollmatch.config.schema import DataConfig, RollmatchConfig
    from rollmatch.data.prompts import PromptEncoder
    from rollmatch.data.records import load_records
    from rollmatch.models.tiny import TinySize
    from rollmatch.rollout.client import ServerBackend
    from rollmatch.rollout.types import Decoding
    from rollmatch.sync import transport

    size = TinySize(text_hidden=1024, text_layers=8, text_intermediate=4096)  # ~300 MB in bf16: a real push
    model_dir, shapes = _tiny(workdir, size)
    servers = [_start_server(model_dir, workdir / f"server-{i}.log") for i in range(2)]
    try:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda:0")
        encoder = PromptEncoder.from_pretrained(str(model_dir), DataConfig(coord_frame="norm1000"))
        cfg = RollmatchConfig.model_validate(
            {
                "model": {"path": str(model_dir), "dtype": "bfloat16"},
                "data": {"coord_frame": "norm1000"},
                "custom": {
                    "extra": {
                        "rollout_matching": {
                            "vllm": {
                                "mode": "server",
                                "server": {
                                    "servers": [
                                        {"base_url": url, "group_port": _free_port()} for url, _ in servers
                                    ],
                                    "timeout_s": GROUP_TIMEOUT_S,
                                    "min_healthy": 1,
                                },
                            }
                        }
                    }
                },
            }
        )
        backend = ServerBackend.connect(
            resolve_run_on_this_machine(cfg),
            model=model,
            tokenizer=encoder.tokenizer,
            processor=encoder.processor,
            collectives=LocalCollectives(),
        )
        backend.pusher.bucket_bytes = 16 << 20  # many buckets: the kill lands inside the push
        first = backend.sync_weights(model, 1)
        victim = servers[1][1]
        victim_port = backend.connections[1].group_port
        sent: Counter[int] = Counter()
        broadcast = transport.GroupTransport.broadcast_async

        def kill_after_first_bucket(self: Any, tensor: Any, src: int) -> Any:
            sent[self.port] += 1
            if self.port == victim_port and sent[self.port] == 2 and victim.poll() is None:
                victim.send_signal(signal.SIGKILL)
                victim.wait(timeout=30)
            return broadcast(self, tensor, src)

        transport.GroupTransport.broadcast_async = kill_after_first_bucket  # type: ignore[method-assign]
        started = time.monotonic()
        report = backend.sync_weights(model, 2)
        failover_s = time.monotonic() - started
        transport.GroupTransport.broadcast_async = broadcast  # type: ignore[method-assign]
        records = load_records(str(shapes["train"]), max_samples=4)
        requests = [encoder.encode(r).to_request() for r in records]
        rolled = time.monotonic()
        rollouts = backend.generate(requests, Decoding(max_new_tokens=32), seed=0)
        tokens = sum(len(r.response_token_ids) for r in rollouts)
        rollout_s = time.monotonic() - rolled
        backend.close()
    finally:
        for _, process in servers:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
    checks = {
        "first_push_reached_both": len(first.servers) == 2,
        "victim_killed_mid_push": victim.poll() is not None and sent[victim_port] >= 2,
        "push_failed_over_to_the_survivor": report.servers == (servers[0][0],),
        "failover_within_group_timeout": failover_s < 2 * GROUP_TIMEOUT_S + 30,
        "rollout_on_the_survivor": len(rollouts) == len(requests)
        and all(r.provenance.server == servers[0][0] for r in rollouts)
        and all(r.weight_version == 2 for r in rollouts),
    }
    return {
        "status": "pass" if all(checks.values()) else "fail",
        "checks": checks,
        "figures": {
            "nccl_sync_gb_per_s": round(first.num_bytes / first.seconds / 1e9, 3),
            "push_bytes": first.num_bytes,
            "failover_push_s": round(failover_s, 1),
            "server_rollout_tokens_per_s": round(tokens / rollout_s, 1) if rollout_s > 0 else None,
        },
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_server(model_dir: Path, log_path: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """``rollmatch serve --engine hf`` on GPU 1; waits until ``/health/`` answers (or fails naming the log)."""
    import requests

    port = _free_port()
    command = [sys.executable, "-m", "rollmatch.cli", "serve", "--engine", "hf", "--model", str(model_dir)]
    command += ["--port", str(port), "--dtype", "bfloat16", "--coord-frame", "norm1000"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="1", PYTHONPATH=str(REPO))
    process = subprocess.Popen(command, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited ({process.returncode}): {log_path.read_text()[-2000:]}")
        try:
            if requests.get(f"{url}/health/", timeout=2).status_code == 200:
                return url, process
        except requests.RequestException:
            pass  # still starting
        time.sleep(0.5)
    process.terminate()
    raise RuntimeError(f"server at {url} not healthy after {SERVER_START_TIMEOUT_S:.0f}s: {log_path}")


RUNNERS = {"train_bf16_colocate": train_bf16_colocate, "nccl_push_server_killed": nccl_push_server_killed}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.item is not None:  # inside an item's own process
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"gpu-check-{args.item}-"))
        workdir.mkdir(parents=True, exist_ok=True)
        print(json.dumps(RUNNERS[args.item](workdir)), flush=True)
        return 0
    problem = cuda_problem()
    if problem is not None:
        print(json.dumps({"ok": False, "error": problem, "items": {}}))
        return 2
    import torch

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for item in args.items:
            results[item] = run_item_process(item, Path(tmp) / item, args.item_timeout_s)
    ok = summarize(results)
    device = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    print(json.dumps({"ok": ok, "device": device, "torch": torch.__version__, "items": results}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
