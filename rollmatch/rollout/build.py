"""Pick the rollout backend once, from the config; nothing else branches on the backend name.

Owns: :func:`build_backend` (from the run resolved at start-up, ``config.resolved``) and
:func:`machine_overrides` (engine settings that run on this machine, for commands
that take no config file: ``rollmatch eval`` without ``--config``).
"""

from __future__ import annotations

from typing import Any

import torch

from rollmatch.collectives import Collectives
from rollmatch.config.resolved import ResolvedRun
from rollmatch.config.schema import ROLLOUT_KEY
from rollmatch.rollout.types import RolloutBackend


def build_backend(
    run: ResolvedRun,
    *,
    model: Any,
    tokenizer: Any,
    processor: Any,
    collectives: Collectives,
    eos_token_id: int,
    pad_token_id: int,
) -> RolloutBackend:
    """The configured backend: ``hf`` (the training model), vLLM colocate, or rollout servers.

    ``run`` was resolved (and its runtime rules checked) once at start-up; ``processor`` is the
    process's one processor (``data.prompts.load_processor``), used by the server client.
    """
    cfg = run.config
    rm = cfg.rollout
    if rm.rollout_backend == "hf":
        from rollmatch.rollout.hf import HFBackend

        return HFBackend(
            model,
            tokenizer,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            # the run's decode batch; none resolved (a micro-batch per call): a micro-batch's records
            batch_size=run.rollout_decode_batch_size or max(cfg.training.per_device_train_batch_size, 1),
        )
    if rm.vllm.mode == "colocate":
        from rollmatch.rollout.vllm_colocate import VllmColocateBackend

        return VllmColocateBackend.from_config(run, model=model, tokenizer=tokenizer, collectives=collectives)
    from rollmatch.rollout.client import ServerBackend

    return ServerBackend.connect(
        run, model=model, tokenizer=tokenizer, processor=processor, collectives=collectives
    )


def machine_overrides() -> list[str]:
    """Overrides that make a config-less command's engine run on this machine.

    The schema's engine defaults are a colocated vLLM sharing its GPU with the learner
    (``tensor_parallel_size`` 1, ``gpu_memory_utilization`` 0.45). A command that
    takes no config (``rollmatch eval --model DIR``) runs one engine alone instead: vLLM when it is
    installed, else HF generate; one unsharded engine (``tensor_parallel_size`` 1, the only size
    the CPU engine runs and one that fits any single GPU that holds the model); on GPU 0.9 of the
    device memory, as vLLM's own default, since no learner shares it.
    """
    from rollmatch.rollout.vllm_settings import vllm_installed

    backend = "vllm" if vllm_installed() else "hf"
    overrides = [f"{ROLLOUT_KEY}.rollout_backend={backend}"]
    if backend == "vllm":
        overrides += [f"{ROLLOUT_KEY}.vllm.mode=colocate", f"{ROLLOUT_KEY}.vllm.tensor_parallel_size=1"]
        if torch.cuda.is_available():
            overrides.append(f"{ROLLOUT_KEY}.vllm.gpu_memory_utilization=0.9")
    return overrides
