"""The console merge: prefixed lines from every log, rate-limited with the newest lines kept."""

from __future__ import annotations

import io
import time
from pathlib import Path

from rollmatch.launch.console import ConsoleMerge


def _wait_for(out: io.StringIO, text: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in out.getvalue():
        assert time.monotonic() < deadline, out.getvalue()
        time.sleep(0.05)


def test_lines_are_prefixed_rate_limited_and_drained_at_close(tmp_path: Path) -> None:
    out = io.StringIO()
    merge = ConsoleMerge(max_lines_per_s=4, out=out)  # 2 lines per child per tick
    server, learner = tmp_path / "server-0.log", tmp_path / "learner-0.log"
    merge.follow("server-0", server)
    merge.follow("learner-0", learner)  # not created yet: followed once it appears
    server.write_text("".join(f"line {i}\n" for i in range(10)))
    _wait_for(out, "[server-0] line 9")
    learner.write_text("step 1\r step 2\rpartial")  # tqdm-style redraws; no newline at the end
    _wait_for(out, "[learner-0]  step 2")
    merge.say("done\nsecond line")
    merge.close()
    lines = out.getvalue().splitlines()
    assert lines[:3] == [
        f"[server-0] ... 8 line(s) not shown (full log: {server})",
        "[server-0] line 8",
        "[server-0] line 9",
    ]
    assert lines[3:] == [
        "[learner-0] step 1",
        "[learner-0]  step 2",
        "[launch] done",
        "[launch] second line",
        "[learner-0] partial",  # the unterminated last line comes out at close
    ]
