"""ms-swift 4.x's real request / response classes against a real server (issue: "current ms-swift client").

ms-swift's pins clash with this project's, so its classes live in their own virtualenv, built once by
``make swift-venv`` (``.venv-swift``; ``make test`` builds it before the suite). This test builds it
itself when it is missing, then runs ``swift_client_check.py`` there against a real server.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from server_processes import RACCOON, REPO

pytestmark = pytest.mark.heavy
SWIFT_PYTHON = REPO / ".venv-swift" / "bin" / "python"
SWIFT_STAMP = REPO / ".venv-swift" / ".installed"


def _swift_venv() -> Path:
    if not SWIFT_STAMP.exists():
        build = subprocess.run(["make", "swift-venv"], cwd=REPO, capture_output=True, text=True, timeout=1500)
        assert build.returncode == 0, (
            f"make swift-venv failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"
        )
    return SWIFT_PYTHON


def test_ms_swift_requests_are_served_and_replies_validate_as_its_rollout_output(hf_server: Any) -> None:
    python = _swift_venv()
    image = RACCOON / "raccoon-1.jpg"
    if not image.exists():
        pytest.skip(f"real images not found at {RACCOON}")
    run = subprocess.run(
        [str(python), str(REPO / "tests/server/swift_client_check.py"), hf_server.url, str(image)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["ms_swift"].startswith("4.")
    assert {"chat_template_kwargs", "add_eos", "min_p", "prompt_logprobs"} <= set(summary["fields_sent"])
    assert set(summary["refused"]) == {"n", "stream", "top_logprobs", "min_p", "num_beams"}
    assert summary["logprobs"] > 0  # the sampled tokens' log-probs, in swift's choice.logprobs form
    print(f"ms-swift client check: {summary}")
