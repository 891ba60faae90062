"""The console view of a launch: every child's log, line by line, prefixed with its name, rate-limited.

Owns: :class:`ConsoleMerge`, a background thread that follows the log files the children write
(``<output_dir>/launch/<role>-<i>.log``) and prints new lines as ``[server-0] ...`` (torchrun-style
prefixes). Leaves out: the log files themselves (children write them directly, so a slow console
never blocks a child and the files are always complete).

Rate limit: at most ``max_lines_per_s`` lines per child per second reach the console; beyond that a
tick prints ``[name] ... N line(s) not shown (full log: PATH)`` and the newest lines, so a burst
(vLLM start-up, a traceback) ends with its last lines on screen.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import TextIO

_TICK_S = 0.5


class ConsoleMerge:
    """Follows log files and prints their new lines with a prefix; ``close()`` prints what is left."""

    def __init__(self, *, max_lines_per_s: int = 40, out: TextIO | None = None):
        self.out = out if out is not None else sys.stdout
        self._budget = max(1, int(max_lines_per_s * _TICK_S))
        self._files: dict[str, tuple[Path, int, bytes]] = {}  # name -> (path, offset, partial line)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="launch-console", daemon=True)
        self._thread.start()

    def follow(self, name: str, path: Path) -> None:
        with self._lock:
            self._files[name] = (path, 0, b"")

    def say(self, message: str) -> None:
        """A line of the launcher's own, prefixed ``[launch]``."""
        with self._lock:
            self._write([f"[launch] {line}" for line in message.splitlines()])

    def close(self) -> None:
        """Stop following and print every remaining line (no rate limit: the run is over)."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        with self._lock:
            for name in list(self._files):
                self._drain(name, limit=None, final=True)

    # ------------------------------------------------------------------------------------ private
    def _run(self) -> None:
        while not self._stop.wait(_TICK_S):
            with self._lock:
                for name in list(self._files):
                    self._drain(name, limit=self._budget, final=False)

    def _drain(self, name: str, *, limit: int | None, final: bool) -> None:
        path, offset, partial = self._files[name]
        try:
            with path.open("rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
        except OSError:
            return  # not created yet
        data = partial + chunk
        # tqdm redraws with carriage returns: each redraw counts as a line.
        pieces = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        partial = b"" if final else pieces.pop()
        self._files[name] = (path, offset + len(chunk), partial)
        lines = [p.decode("utf-8", errors="replace") for p in pieces if p.strip()]
        if limit is not None and len(lines) > limit:
            hidden = len(lines) - limit
            lines = [f"... {hidden} line(s) not shown (full log: {path})", *lines[-limit:]]
        self._write([f"[{name}] {line}" for line in lines])

    def _write(self, lines: list[str]) -> None:
        if lines:
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()
