"""Which ``vllm.*`` engine keys take effect in which rollout mode; a key set where it has none is refused.

Owns :func:`rule_engine_keys_in_mode` (a static rule) and :data:`SERVER_ENGINE_FLAGS` (the keys
``rollmatch launch`` passes to every ``rollmatch serve`` it starts, with their flags). In force:

| mode | keys that take effect |
| --- | --- |
| `rollout_backend: hf` | none (the training model generates; not refused, so ``eval --backend hf`` takes any config) |
| `vllm` + `colocate` | every engine key |
| `vllm` + `server` | the keys of :data:`SERVER_ENGINE_FLAGS`, `max_model_len`, `enable_lora` (through `launch`); not `tensor_parallel_size` (`launch.tensor_parallel_size` sizes the servers) nor `sleep_level` |

A key "is set" when it differs from its schema default: a resolved config (every default written
out, e.g. ``launch``'s learner.yaml) loads like the file it came from. Servers started by hand take
the same flags (docs/server.md); ``launch`` is what reads these keys in server mode.

Leaves out: the engine's runtime checks against the devices (``config.rules.check_runtime``).
"""

from __future__ import annotations

from rollmatch.config.schema import ROLLOUT_KEY, RollmatchConfig, VllmConfig
from rollmatch.errors import ConfigProblem

_VLLM = f"{ROLLOUT_KEY}.vllm"
_DEFAULTS = VllmConfig()
# vllm.<key> -> the `rollmatch serve` flag `launch` passes it as (vLLM engine servers).
SERVER_ENGINE_FLAGS: dict[str, str] = {
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_num_seqs": "--max-num-seqs",
    "enable_prefix_caching": "--enable-prefix-caching",
    "enforce_eager": "--enforce-eager",
    "kv_cache_space_gib": "--kv-cache-space-gib",
}
ENGINE_KEYS = (
    *SERVER_ENGINE_FLAGS,
    "tensor_parallel_size",
    "sleep_level",
    "max_model_len",
    "enable_lora",
)
_SERVER_IGNORES = {
    "tensor_parallel_size": "the rollout servers' size is launch.tensor_parallel_size (`rollmatch serve "
    "--tensor-parallel-size`); set that instead",
    "sleep_level": "a rollout server keeps its GPUs and never sleeps; remove it",
}


def rule_engine_keys_in_mode(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """With `rollout_backend: vllm`, a `vllm.*` engine key set (not its default) where it has no effect is refused: `tensor_parallel_size` and `sleep_level` under `vllm.mode: server` (servers take `launch.tensor_parallel_size`); the server engine keys under `launch.engine: hf`."""
    rollout = cfg.rollout
    vllm = rollout.vllm
    changed = [key for key in ENGINE_KEYS if getattr(vllm, key) != getattr(_DEFAULTS, key)]
    problems: list[ConfigProblem] = []
    if rollout.rollout_backend == "hf":
        return problems  # no engine at all: `eval --backend hf` may take any config as it is
    if vllm.mode == "server":
        for key in changed:
            if key in _SERVER_IGNORES:
                problems.append(
                    ConfigProblem(
                        f"{_VLLM}.{key}",
                        getattr(vllm, key),
                        f"no effect with {_VLLM}.mode: server: {_SERVER_IGNORES[key]}",
                    )
                )
            elif key in SERVER_ENGINE_FLAGS and cfg.launch.engine == "hf":
                problems.append(
                    ConfigProblem(
                        f"{_VLLM}.{key}",
                        getattr(vllm, key),
                        "no effect with launch.engine: hf (the servers run HF generate); remove it, or serve "
                        "with vLLM (launch.engine: vllm)",
                    )
                )
    return problems


def server_engine_flags(cfg: RollmatchConfig, *, on_cpu: bool) -> list[str]:
    """The ``rollmatch serve`` flags of the ``vllm.*`` keys a vLLM rollout server takes (non-defaults
    and, on GPUs, ``gpu_memory_utilization`` always, so the server uses the config's share)."""
    vllm = cfg.rollout.vllm
    flags: list[str] = []
    if not on_cpu:
        flags += ["--gpu-memory-utilization", str(vllm.gpu_memory_utilization)]
    if vllm.max_num_seqs is not None:
        flags += ["--max-num-seqs", str(vllm.max_num_seqs)]
    if not vllm.enable_prefix_caching:
        flags.append("--no-enable-prefix-caching")
    if vllm.enforce_eager:
        flags.append("--enforce-eager")
    if on_cpu:
        flags += ["--kv-cache-space-gib", str(vllm.kv_cache_space_gib)]
    return flags
