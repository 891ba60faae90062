"""Run in the side virtualenv `.venv-trl` (TRL and verl installed): TRL's and verl's own GRPO loss code
on the inputs in ``argv[1]``; losses and gradients to ``argv[2]``.

TRL: ``GRPOTrainer._compute_loss`` on a bare trainer object whose log-prob forward returns the given
per-token log-probs (the loss code itself is TRL's, unchanged). Its ``importance_sampling_ratio`` input
is built with the three lines of TRL's ``_generate_and_score_completions`` (token_truncate). verl:
``core_algos.compute_policy_loss_vanilla`` (dual clip) with token-mean aggregation.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from types import SimpleNamespace

import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla


class _Accelerator:
    num_processes = 1
    is_main_process = True

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    gather_for_metrics = gather

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x


def trl_loss(data: dict, loss_type: str, fresh: bool) -> tuple[float, torch.Tensor]:
    logps = data["logps"].clone().requires_grad_(True)
    trainer = object.__new__(GRPOTrainer)
    trainer.__dict__.update(
        top_entropy_quantile=1.0,
        aux_loss_enabled=False,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=data["beta"],
        loss_type=loss_type,
        epsilon_low=data["epsilon"],
        epsilon_high=data["epsilon_high"],
        use_vllm=fresh,
        vllm_importance_sampling_correction=fresh,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        accelerator=_Accelerator(),
        max_completion_length=data["mask"].shape[1],
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(delta=data["delta"], use_bias_correction_kl=False, steps_per_generation=1),
    )
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    mask = data["mask"]
    inputs = {
        "prompt_ids": torch.zeros(mask.shape[0], 1, dtype=torch.long),
        "prompt_mask": torch.ones(mask.shape[0], 1, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask, dtype=torch.long),
        "completion_mask": mask,
        "advantages": data["advantages"],
        "ref_per_token_logps": data["ref"],
        "num_items_in_batch": mask.sum(),
    }
    if fresh:  # old = the learner now; TRL's own lines for the engine/learner ratio (token_truncate)
        diff = (logps.detach() - data["engine"]) * mask
        inputs["importance_sampling_ratio"] = torch.clamp(torch.exp(diff), max=data["cap"])
    else:  # stale: the behaviour log-probs are the old policy
        inputs["old_per_token_logps"] = data["engine"]
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    return float(loss), logps.grad


def verl_loss(data: dict) -> tuple[float, torch.Tensor]:
    logps = data["logps"].clone().requires_grad_(True)

    class Config(SimpleNamespace):
        def get(self, key: str, default: object = None) -> object:
            return getattr(self, key, default)

    config = Config(
        clip_ratio=data["epsilon"],
        clip_ratio_low=data["epsilon"],
        clip_ratio_high=data["epsilon_high"],
        clip_ratio_c=data["delta"],
        global_batch_info={},
    )
    advantages = data["advantages"][:, None].expand_as(logps)
    loss, _ = compute_policy_loss_vanilla(
        data["engine"], logps, advantages, data["mask"].float(), "token-mean", config
    )
    loss.backward()
    return float(loss), logps.grad


def main() -> None:
    data = torch.load(sys.argv[1])
    out = {}
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        for fresh in (True, False):
            out[f"trl/{loss_type}/{'fresh' if fresh else 'stale'}"] = trl_loss(data, loss_type, fresh)
    out["verl/dual_clip"] = verl_loss(data)
    torch.save(out, sys.argv[2])


if __name__ == "__main__":
    main()
