"""With ``--allowed-local-media-path``, a client path not named under the root is refused before the
file system is asked anything about it (no resolution of paths elsewhere on the host); paths under
the root, also through the root's own name as given, still resolve and open."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

from rollmatch.server.media import MediaPolicy, decode_image


@pytest.fixture
def media(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(root, the root through a symlink, a directory outside) with an image in root and outside."""
    root = tmp_path / "media"
    root.mkdir()
    Image.new("RGB", (8, 8)).save(root / "a.png")
    alias = tmp_path / "alias"
    alias.symlink_to(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    Image.new("RGB", (8, 8)).save(outside / "b.png")
    (root / "to-outside.png").symlink_to(outside / "b.png")
    return root, alias, outside


def test_paths_outside_the_root_are_refused_without_a_file_system_lookup(
    media: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, alias, outside = media
    policy = MediaPolicy(allowed_root=alias)  # configured through a symlink: resolved to root
    looked_up: list[str] = []
    realpath = os.path.realpath
    monkeypatch.setattr(os.path, "realpath", lambda p, **kw: looked_up.append(str(p)) or realpath(p, **kw))
    elsewhere = [
        str(outside / "b.png"),
        str(root / ".." / "outside" / "b.png"),
        "file://" + str(outside / "b.png"),
        "/proc/self/cwd/secret.png",
        "relative/name.png",  # relative to the server's working directory, not to the root
    ]
    for value in elsewhere:
        with pytest.raises(ValueError, match="allowed media path"):
            decode_image(value, policy, "image")
    assert looked_up == [], f"resolved paths outside the root: {looked_up}"
    for value in (str(root / "a.png"), str(alias / "a.png"), "file://" + str(root / "a.png")):
        assert decode_image(value, policy, "image").size == (8, 8)
    assert looked_up, "paths under the root are still resolved before they are opened"
    with pytest.raises(ValueError, match="allowed media path"):  # a symlink inside leading out
        decode_image(str(root / "to-outside.png"), policy, "image")
