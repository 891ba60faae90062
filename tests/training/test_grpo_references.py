"""rollmatch's GRPO loss against TRL's and verl's own code (installed in the side virtualenv `.venv-trl`,
`make trl-venv`): identical log-probs, advantages and masks give equal losses and gradients.

TRL ``GRPOTrainer._compute_loss`` for every ``loss_type`` (grpo, bnpo, dr_grpo, dapo), with the KL term
(beta), the asymmetric clip and the dual clip (TRL's ``delta``), on fresh rollouts (rollmatch's
``token_truncate`` correction against TRL's vLLM importance-sampling correction, the PPO ratio taken
against the learner) and on stale ones (the ratio against the behaviour log-probs, no correction). verl
``compute_policy_loss_vanilla`` (its dual clip, ``clip_ratio_c``) against rollmatch's ``max_ratio``.
Tolerance: 1e-5 relative to the magnitude (float32 sums in a different order).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollmatch.training.grpo_loss import GrpoSettings, grpo_loss_sum
from rollmatch.training.grpo_targets import policy_token_weights

pytestmark = pytest.mark.heavy
REPO = Path(__file__).resolve().parents[2]
SIDE_PYTHON = REPO / ".venv-trl" / "bin" / "python"
TOLERANCE = 1e-5


def reference_inputs() -> dict:
    generator = torch.Generator().manual_seed(7)
    batch, width = 4, 7
    lengths = torch.tensor([7, 5, 3, 6])
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    logps = -torch.rand(batch, width, generator=generator) * 3.0
    # engine log-probs: small mismatches, some far enough to clip, cap and dual-clip
    engine = logps + torch.randn(batch, width, generator=generator) * 0.6
    engine[1, 0] = logps[1, 0] - 1.5  # ratio e^1.5 > delta with a negative advantage: dual-clipped
    return {
        "mask": mask,
        "logps": logps,
        "engine": engine,
        "ref": logps + torch.randn(batch, width, generator=generator) * 0.3,
        "advantages": torch.tensor([1.3, -0.7, 0.4, -1.1]),
        "beta": 0.04,
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "delta": 3.0,
        "cap": 2.0,
    }


def rollmatch_loss(data: dict, loss_type: str, fresh: bool, kl: bool = True) -> tuple[float, torch.Tensor]:
    """rollmatch's loss on the same sequences: one row per rollout (position 0 holds no token), the
    loss_type's token weights and step normaliser, ``sum(w * loss) / normaliser``."""
    mask = data["mask"]
    pad = torch.zeros(mask.shape[0], 1)
    logps = data["logps"].clone().requires_grad_(True)
    weights, normaliser = [], 0.0
    for row in mask:
        weight, share = policy_token_weights(int(row.sum()), loss_type, mask.shape[1])
        weights.append(row.float() * weight)
        normaliser += share
    settings = GrpoSettings(
        clip_eps=data["epsilon"],
        clip_eps_high=data["epsilon_high"],
        max_ratio=data["delta"],
        kl_coef=data["beta"] if kl else 0.0,
        is_correction="token_truncate" if fresh else "none",
        is_cap=data["cap"],
    )
    loss_sum, _ = grpo_loss_sum(
        torch.cat([pad, logps], dim=1),
        torch.cat([pad, data["engine"]], dim=1),
        torch.cat([pad, data["advantages"][:, None].expand_as(logps)], dim=1),
        torch.cat([pad, torch.stack(weights)], dim=1),
        settings,
        reference_logprobs=torch.cat([pad, data["ref"]], dim=1) if kl else None,
        lag=torch.full((mask.shape[0], mask.shape[1] + 1), 0.0 if fresh else 1.0),
    )
    loss = loss_sum / normaliser
    loss.backward()
    return float(loss), logps.grad


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not SIDE_PYTHON.exists():
        pytest.fail(f"{SIDE_PYTHON} is missing: build it with `make trl-venv` (TRL and verl for this check)")
    folder = tmp_path_factory.mktemp("references")
    torch.save(reference_inputs(), folder / "inputs.pt")
    script = Path(__file__).with_name("reference_grpo_losses.py")
    done = subprocess.run(
        [str(SIDE_PYTHON), str(script), str(folder / "inputs.pt"), str(folder / "out.pt")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(folder / "out.pt")


def assert_same(ours: tuple[float, torch.Tensor], theirs: tuple[float, torch.Tensor]) -> None:
    assert ours[0] == pytest.approx(theirs[0], rel=TOLERANCE, abs=TOLERANCE * 1e-2)
    scale = float(theirs[1].abs().max())
    assert float((ours[1] - theirs[1]).abs().max()) <= TOLERANCE * scale, (ours[1], theirs[1])


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("fresh", [True, False])
def test_loss_and_gradient_equal_trl(references: dict, loss_type: str, fresh: bool) -> None:
    data = reference_inputs()
    theirs = references[f"trl/{loss_type}/{'fresh' if fresh else 'stale'}"]
    assert_same(rollmatch_loss(data, loss_type, fresh), theirs)


def test_dual_clip_equals_verl(references: dict) -> None:
    data = reference_inputs()
    ours = rollmatch_loss(data, "dapo", fresh=False, kl=False)
    assert_same(ours, references["verl/dual_clip"])
    # the inputs reach every branch: some tokens dual-clipped (negative advantage, ratio above 3)
    ratio = torch.exp(data["logps"] - data["engine"])
    assert bool(((ratio > 3.0) & (data["advantages"][:, None] < 0) & (data["mask"] > 0)).any())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
