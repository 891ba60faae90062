"""The one exception hierarchy of rollmatch, split by who must act.

- :class:`ConfigError`: the user's config is wrong; every problem is listed with key, value and fix.
- :class:`LaunchError`: ``rollmatch launch`` refuses a layout (devices, process counts, ports) before
  starting anything; every problem is listed with the flag or key, value and fix.
- :class:`DataError`: a record or dataset file is wrong; names file:line and the field.
- :class:`BackendError`: a rollout backend / server / engine is dead or misbehaves; a stalled rollout
  server fails the step with its URL.
- :class:`ServerBusy`: the one retryable fault: a rollout server's admission queue is full (HTTP 429
  with ``Retry-After``); the client waits and retries within its timeout.
- :class:`PromptAlignmentError`, :class:`PackingError`, :class:`SyncError`,
  :class:`CollectiveTimeoutError`: contract violations of one subsystem, each naming what to change;
  :class:`ServerPushFailed` (a :class:`SyncError`) is a weight push that failed at one rollout server,
  carrying its URL and the transaction's phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


class RollmatchError(Exception):
    """Base class of every error rollmatch raises on purpose."""


@dataclass(frozen=True)
class ConfigProblem:
    """One problem in a config: the dotted key, the value received and how to fix it."""

    key: str
    value: Any
    fix: str

    @property
    def shown_value(self) -> str:
        """``repr(value)``, cut short for huge values (e.g. a YAML anchor bomb: its start, not megabytes)."""
        shown = repr(self.value)
        if len(shown) > _MAX_VALUE_CHARS:
            shown = f"{shown[:_MAX_VALUE_CHARS]}... ({len(shown)} characters)"
        return shown

    def __str__(self) -> str:
        return f"{self.key} = {self.shown_value}: {self.fix}"


_MAX_VALUE_CHARS = 200


class ConfigError(RollmatchError):
    """The config is invalid; carries every problem found, not just the first."""

    def __init__(self, problems: list[ConfigProblem]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid config ({len(self.problems)} problem(s)):\n{lines}")


class LaunchError(RollmatchError):
    """A launch layout that cannot run; carries every problem (flag or config key, value, fix)."""

    def __init__(self, problems: list[ConfigProblem]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"launch refused before starting anything ({len(self.problems)} problem(s)):\n{lines}"
        )


class DataError(RollmatchError):
    """A bad record or dataset file (message names file:line, the field and what is wrong)."""


class BackendError(RollmatchError):
    """A rollout backend, engine or server is unusable; the message names it and suggests a fix."""


class ServerBusy(BackendError):
    """A rollout server refused a call for now (its queue is full); retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = float(retry_after_s)


class ServerDown(BackendError):
    """A rollout server stopped answering a call: no connection, a 5xx, a timeout, or ``/health/``
    reporting it stalled or not answering. The client may mark it down and re-send the call elsewhere
    (``vllm.server.min_healthy``); a 4xx or a malformed answer is not this (every server would refuse)."""


class PromptAlignmentError(RollmatchError):
    """A backend used different prompt token ids than the trainer encoded."""


class PackingError(RollmatchError):
    """A segment cannot be packed under the configured limits."""


class SyncError(BackendError):
    """A weight update failed; the receiver keeps serving its previous version."""


PushPhase = Literal["group", "announce", "transfer", "finish"]
_PUSH_PHASES: dict[str, str] = {
    "group": "forming its weight-sync group",
    "announce": "announcing a bucket",
    "transfer": "sending a bucket over its group",
    "finish": "finishing the weight version",
}


class ServerPushFailed(SyncError):
    """A weight push failed at one rollout server: ``url`` names the server, ``phase`` the step of the
    transaction (``group``: ``/init_communicator/`` or the trainer's side of the group; ``announce``: a
    bucket's announcement; ``transfer``: a bucket's bytes on the group; ``finish``: the version's
    finish and ack), ``cause`` what went wrong there (also the ``__cause__``). The push failover drops
    exactly the server named by ``url``, whatever the cause's text names (a group error names
    ``host:group_port``). The server keeps serving its previous version."""

    def __init__(self, url: str, phase: PushPhase, cause: BaseException):
        super().__init__(
            f"rollout server {url}: {_PUSH_PHASES[phase]} failed: {type(cause).__name__}: {cause}"
        )
        self.url, self.phase, self.cause = url, phase, cause

    @property
    def refused(self) -> bool:
        """The server refused the update (a weight-sync state or checksum error, or no group formed),
        as opposed to failing to answer or to receive in time."""
        return self.phase == "group" or isinstance(self.cause, SyncError)


class CollectiveTimeoutError(RollmatchError):
    """A collective (barrier, broadcast, all-reduce) did not complete in time; names the phase."""
