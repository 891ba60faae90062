"""Config inputs the reliability review found accepted or unreadable: each is now one short, clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
from resolved_runs import resolved_config

from rollmatch.config.load import load_config, load_config_dict
from rollmatch.errors import ConfigError

ANCHOR_BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
"""


# An empty config file: tests/config/test_config_load.py::test_empty_yaml_file_is_an_error.


def test_negative_max_steps_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"training\.max_steps = -5"):
        load_config_dict({"training": {"max_steps": -5}})
    assert load_config_dict({"training": {"max_steps": -1}}).training.max_steps == -1


def test_two_servers_on_one_host_may_not_share_a_group_port() -> None:
    servers = [
        {"base_url": "http://localhost:8000", "group_port": 51216},
        {"base_url": "http://127.0.0.1:8001", "group_port": 51216},
    ]
    with pytest.raises(ConfigError, match=r"share group_port 51216 on host 127\.0\.0\.1"):
        resolved_config(
            {
                "custom": {
                    "extra": {
                        "rollout_matching": {"vllm": {"mode": "server", "server": {"servers": servers}}}
                    }
                }
            }
        )
    servers[1]["base_url"] = "http://10.0.0.6:8000"  # another host: the same port is fine
    resolved_config(
        {
            "custom": {
                "extra": {"rollout_matching": {"vllm": {"mode": "server", "server": {"servers": servers}}}}
            }
        }
    )


def test_an_anchor_bomb_gets_a_short_error(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(ANCHOR_BOMB)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert len(message) < 5000 and "unknown key" in message and "characters)" in message
