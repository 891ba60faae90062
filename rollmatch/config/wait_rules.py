"""Rules that relate a wait to the collective timeout other ranks sit it out under, and async's on-policy rule.

Owns :func:`collective_margin_s` (the stated margin: a wait bounded by its own timeout must end that long
before ``training.collective_timeout_s``, so the waiting ranks hear the outcome instead of timing out),
the static rules on ``stage2_ab.channel_b.async.max_wait_s`` and the runtime rule on the first weight
push (``vllm.server.timeout_s``). ``config.rules`` runs them with the others; each returns
:class:`~rollmatch.errors.ConfigProblem` s and a static rule's docstring is its line in docs/config.md.
"""

from __future__ import annotations

from rollmatch.config.schema import ROLLOUT_KEY, RollmatchConfig
from rollmatch.errors import ConfigProblem

_SERVER = f"{ROLLOUT_KEY}.vllm.server"
_CHANNEL_B = "stage2_ab.channel_b"
COLLECTIVE_MARGIN_FRACTION = 0.1  # of training.collective_timeout_s (see collective_margin_s)
COLLECTIVE_MARGIN_MIN_S = 10.0


def collective_margin_s(collective_timeout_s: float) -> float:
    """The slack a wait bounded by its own timeout must leave below `training.collective_timeout_s` while
    other ranks wait for it in a collective: a tenth of the collective timeout, at least
    :data:`COLLECTIVE_MARGIN_MIN_S` (the ranks' skew around the wait: step start, logging, a flush)."""
    return max(COLLECTIVE_MARGIN_MIN_S, COLLECTIVE_MARGIN_FRACTION * collective_timeout_s)


def rule_async_wait(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`stage2_ab.channel_b.async.max_wait_s` <= `training.collective_timeout_s` minus a margin (a tenth of it, at least 10 s): a rank waiting for packs must not outlast the others' wait in the step's vote."""
    settings = cfg.stage2_ab.channel_b.async_
    timeout = cfg.training.collective_timeout_s
    most = timeout - collective_margin_s(timeout)
    if cfg.stage2_ab.channel_b.mode != "async" or settings.max_wait_s <= most:
        return []
    return [
        ConfigProblem(
            f"{_CHANNEL_B}.async.max_wait_s",
            settings.max_wait_s,
            f"above training.collective_timeout_s = {timeout:g} minus its margin of "
            f"{collective_margin_s(timeout):g} s: while one rank waits for its ready packs the others wait in "
            f"the step's vote and would time out first; set max_wait_s <= {most:g} or raise "
            "training.collective_timeout_s",
        )
    ]


def rule_async_on_policy(cfg: RollmatchConfig) -> list[ConfigProblem]:
    """`stage2_ab.channel_b.async.version_window: 0` needs `max_wait_s > 0`: the packs of a step that pushes (every step with `sync_every_steps: 1`) are rolled out only after its push, so without a wait it never trains Channel-B."""
    settings = cfg.stage2_ab.channel_b.async_
    if cfg.stage2_ab.channel_b.mode != "async" or settings.version_window or settings.max_wait_s > 0:
        return []
    return [
        ConfigProblem(
            f"{_CHANNEL_B}.async.max_wait_s",
            settings.max_wait_s,
            f"with {_CHANNEL_B}.async.version_window: 0 (on-policy) a step's packs are rolled out only after "
            "the push at its start, so a step that pushes and does not wait never trains Channel-B; set max_wait_s to "
            "a few times a decode batch's rollout time (e.g. 60), or raise version_window",
        )
    ]


def first_push_problems(cfg: RollmatchConfig, *, world_size: int) -> list[ConfigProblem]:
    """Rank 0 forms the weight-sync groups in the first push (each server's rendezvous waits up to
    ``vllm.server.timeout_s``) while the other ranks wait in a collective: it must fail or finish first.
    With failover (``min_healthy`` set) a push whose group formation failed is sent again to the other
    servers, forming their groups anew: two such waits must fit."""
    rm = cfg.rollout
    if (
        world_size <= 1
        or cfg.custom.trainer_variant == "sft"
        or rm.rollout_backend != "vllm"
        or rm.vllm.mode != "server"
    ):
        return []
    timeout = cfg.training.collective_timeout_s
    attempts = 1 if rm.vllm.server.min_healthy is None else 2  # failover: the push goes again to the rest
    most = (timeout - collective_margin_s(timeout)) / attempts
    if rm.vllm.server.timeout_s <= most:
        return []
    failover = (
        ""
        if attempts == 1
        else f" With {_SERVER}.min_healthy set, a push whose group formation failed is sent once more to the "
        "other servers (new groups): two such waits must fit."
    )
    return [
        ConfigProblem(
            f"{_SERVER}.timeout_s",
            rm.vllm.server.timeout_s,
            f"above training.collective_timeout_s = {timeout:g} minus its margin of {collective_margin_s(timeout):g} "
            f"s{' (halved: failover)' if attempts == 2 else ''} (world_size={world_size}): while rank 0 forms the "
            "weight-sync group of the first push (a server's rendezvous waits up to timeout_s) the other ranks wait "
            f"in a collective and would time out before rank 0 can tell them why.{failover} Set timeout_s <= "
            f"{most:g} or raise training.collective_timeout_s",
        )
    ]
