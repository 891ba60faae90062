"""The config's vLLM engine keys reach the rollout servers: ``launch`` passes them to ``rollmatch serve``
as flags, and the server's vLLM engine is built with them."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from rollmatch.cli import build_parser, main
from rollmatch.errors import BackendError
from rollmatch.server.engines import build_engine
from rollmatch.server.serve import vllm_flag_settings

SERVERS = [{"base_url": "http://127.0.0.1:8000", "group_port": 51216}]


def test_launch_passes_the_engine_keys_to_every_server(tmp_path: Path, capsys) -> None:
    vllm = {
        "mode": "server",
        "server": {"servers": SERVERS},
        "gpu_memory_utilization": 0.85,
        "max_num_seqs": 64,
        "enable_prefix_caching": False,
        "enforce_eager": True,
    }
    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"path": "/ckpt/m", "dtype": "bfloat16"},
                "custom": {"extra": {"rollout_matching": {"vllm": vllm}}},
                "training": {"output_dir": str(tmp_path / "out")},
            }
        )
    )
    args = ["launch", str(config), "--server-devices", "0,1", "--learner-devices", "2", "--dry-run"]
    assert main(args) == 0, capsys.readouterr().err
    lines = [line for line in capsys.readouterr().out.splitlines() if " serve " in line]
    assert len(lines) == 2
    for line in lines:
        flags = shlex.split(line.split(" -m rollmatch.cli ", 1)[1])
        parsed = build_parser().parse_args(flags)
        assert parsed.max_num_seqs == 64
        assert vllm_flag_settings(parsed) == {
            "gpu_memory_utilization": 0.85,
            "enable_prefix_caching": False,
            "enforce_eager": True,
        }


def test_the_hf_server_engine_refuses_vllm_settings(tiny_model_dir: Path) -> None:
    with pytest.raises(BackendError, match="--gpu-memory-utilization"):
        build_engine(
            "hf",
            str(tiny_model_dir),
            dtype="float32",
            max_model_len=512,
            vllm_settings={"gpu_memory_utilization": 0.5},
        )


@pytest.mark.heavy
def test_serve_flags_reach_the_vllm_engine(tiny_model_dir: Path) -> None:
    pytest.importorskip("vllm")
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(tiny_model_dir),
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "3",
            "--no-enable-prefix-caching",
            "--kv-cache-space-gib",
            "0.25",
        ]
    )
    engine = build_engine(
        "vllm",
        args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        vllm_settings=vllm_flag_settings(args),
    )
    try:
        vllm_config = engine._engine._llm.llm_engine.vllm_config
        assert vllm_config.scheduler_config.max_num_seqs == 3
        assert vllm_config.cache_config.enable_prefix_caching is False
        assert engine._engine.settings.kv_cache_space_gib == 0.25
    finally:
        engine.close()
