"""How much the rollout engine (vLLM) says: WARNING and above, each kind of line once.

Owns: :func:`engine_log_level` (``VLLM_LOGGING_LEVEL``: WARNING unless ``--verbose`` or the user
set it), :class:`RepeatedLines` (a handler filter that lets the first line of each message template
through, marks it, and counts the repeats), :func:`quiet_engine_logs` (vLLM's logs through one
handler with that filter) and :func:`log_engine_repeats` (one summary line per kind of hidden line). A demo run otherwise prints two INFO lines per weight sync
("Reloading and processing weights took ...", "Successfully reset prefix cache") and one WARNING
per generate call on CPU ("CPU backend doesn't allow to use `torch.set_num_threads` ..."): hundreds
of lines nobody can act on. Leaves out: rollmatch's own logging (the entry points configure it).
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter

ENGINE_LOG_ENV = "VLLM_LOGGING_LEVEL"
CONFIGURE_ENV = "VLLM_CONFIGURE_LOGGING"
VERBOSE_ENV = "ROLLMATCH_VERBOSE"
REPEAT_MARK = " [repeats of this line are counted, not shown]"

log = logging.getLogger(__name__)


def engine_log_level(*, verbose: bool) -> str:
    """Set vLLM's log level for this process and its children before vLLM is imported.

    ``verbose``: INFO and every repeat (``ROLLMATCH_VERBOSE=1`` for child processes); otherwise
    WARNING, unless ``VLLM_LOGGING_LEVEL`` is already set (the user's choice wins). Returns the level.
    """
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
        os.environ[ENGINE_LOG_ENV] = "INFO"
    else:
        os.environ.setdefault(ENGINE_LOG_ENV, "WARNING")
    return os.environ[ENGINE_LOG_ENV]


class RepeatedLines(logging.Filter):
    """Passes the first record of each ``(logger, level, template)``; counts and drops the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.repeats: Counter[tuple[str, str]] = Counter()
        self._seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        if key in self._seen:
            self.repeats[(record.levelname, str(record.msg))] += 1
            return False
        self._seen.add(key)
        record.msg = f"{record.msg}{REPEAT_MARK}"
        return True

    def summary(self) -> list[str]:
        """One line per kind of repeated line: how many were hidden."""
        return [
            f"engine log: {count} more {level} line(s) like {template[:80]!r} hidden"
            for (level, template), count in self.repeats.most_common()
        ]


_installed: list[RepeatedLines] = []
ENGINE_FORMAT = "(vllm) %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


def quiet_engine_logs() -> RepeatedLines | None:
    """Route vLLM's logs through one handler of ours with :class:`RepeatedLines`; not with ``--verbose``.

    Call before an engine is built. vLLM would otherwise (re)configure its own handler when it
    builds an engine, after the first repeats; so ``VLLM_CONFIGURE_LOGGING`` is set to 0 (unless the
    user set it) and the ``vllm`` logger gets a stderr handler at ``VLLM_LOGGING_LEVEL`` in vLLM's
    line format. Idempotent; returns the filter (its counts feed :func:`log_engine_repeats`).
    """
    if os.environ.get(VERBOSE_ENV) == "1":
        return None
    if not _installed:
        _installed.append(RepeatedLines())
    repeats = _installed[0]
    if os.environ.setdefault(CONFIGURE_ENV, "0") != "0":  # the user keeps vLLM's handler: filter it
        for handler in logging.getLogger("vllm").handlers:
            if repeats not in handler.filters:
                handler.addFilter(repeats)
        return repeats
    vllm_logger = logging.getLogger("vllm")
    if not any(isinstance(h, _EngineHandler) for h in vllm_logger.handlers):
        handler = _EngineHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(ENGINE_FORMAT, datefmt="%m-%d %H:%M:%S"))
        handler.addFilter(repeats)
        vllm_logger.addHandler(handler)
        vllm_logger.propagate = False
    vllm_logger.setLevel(os.environ.get(ENGINE_LOG_ENV, "WARNING").upper())
    return repeats


class _EngineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`quiet_engine_logs` installs on the ``vllm`` logger."""


def log_engine_repeats() -> None:
    """Log the summary of hidden repeats (one line per kind), then reset the counts."""
    for repeats in _installed:
        for line in repeats.summary():
            log.info(line)
        repeats.repeats.clear()
