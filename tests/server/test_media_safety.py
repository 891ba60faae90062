"""Images that cost more than they weigh, and local media paths: every refusal a fast, uniform 4xx.

- Pixel amplification: a few KB of base64 can be a 4096x4096 image (48 MiB as RGB). A call's images
  are checked from their headers and summed before any is decoded (``--max-call-pixels``, 413), and
  the calls in flight share ``--max-inflight-pixels`` (429), given back when the engine is done.
  Measured on a real ``rollmatch serve`` process: its peak resident memory while refusing.
- Request / message / image counts are bounded by the wire model (a 422 while parsing).
- Local media paths: every ``OSError`` (a name too long, an unreadable file, a loop) is the answer of
  a missing path, outside or inside the root; the file is opened once and the opened file checked,
  so a symlink swapped in after the check cannot leak a file outside the root.
"""

from __future__ import annotations

import base64
import io
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from rollmatch.protocol import (
    MAX_CONTENT_PARTS,
    MAX_IMAGES_PER_REQUEST,
    MAX_INFER_REQUESTS,
    MAX_MESSAGES_PER_REQUEST,
    encode_image,
)

# A 4096x4096 one-bit PNG: 2.8 KB of base64, 48 MiB once decoded to RGB.
_BOMB_BUFFER = io.BytesIO()
Image.new("1", (4096, 4096)).save(_BOMB_BUFFER, format="PNG")
BIG = base64.b64encode(_BOMB_BUFFER.getvalue()).decode()
MIB = 1 << 20


def _png(size: tuple[int, int] = (32, 32), color: tuple[int, int, int] = (200, 30, 30)) -> str:
    return encode_image(Image.new("RGB", size, color))


def _chat(images: list[str], text: str = "find") -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "<image>" * len(images) + text}], "images": images}


def _post(client: Any, body: Any) -> Any:
    return client.post("/infer/", json=body)


def _peak_rss_bytes(pid: int) -> int:
    """The high-water mark of a process's resident memory (``VmHWM``, Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


# ------------------------------------------------------------------------------ amplification
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_a_small_call_of_huge_images_is_refused_from_headers_on_a_real_server(
    start_server: Callable[..., Any], tiny_model_dir: Path
) -> None:
    """16 images of 4096x4096 in a 46 KB body: 768 MiB once decoded, over 1.5 GiB at the peak of
    preparing them. The server refuses the call from the headers: fast, and its peak memory grows by
    less than one decoded image (48 MiB)."""
    server = start_server(tiny_model_dir, "--engine", "hf", "--max-tokens", "2")
    session = requests.Session()
    warm = session.post(f"{server.url}/infer/", json={"infer_requests": [_chat([_png()])]}, timeout=120)
    assert warm.status_code == 200, warm.text  # thread pools, the processor and the parser are warm
    body = {"infer_requests": [_chat([BIG] * 8)] * 2}
    text = json.dumps(body)
    assert len(text) < 50_000
    before = _peak_rss_bytes(server.process.pid)
    started = time.monotonic()
    reply = session.post(
        f"{server.url}/infer/", data=text, headers={"content-type": "application/json"}, timeout=120
    )
    elapsed = time.monotonic() - started
    grown = _peak_rss_bytes(server.process.pid) - before
    print(f"refused in {elapsed:.3f}s; server peak RSS grew {grown / MIB:.1f} MiB")
    assert reply.status_code == 413, reply.text[:500]
    assert "--max-call-pixels" in reply.text and "at least 150994944 pixels" in reply.text  # 9 images
    assert elapsed < 2.0
    assert grown < 32 * MIB, f"peak RSS grew {grown / MIB:.0f} MiB while refusing"
    stats = session.get(f"{server.url}/stats/", timeout=10).json()
    assert stats["rejected_requests"] == 1


def test_call_and_inflight_pixel_caps(hf_engine: Any, app_client: Callable[..., Any]) -> None:
    side = 32 * 32
    client, server = app_client(
        hf_engine, max_tokens=2, max_image_pixels=side, max_call_pixels=2 * side, max_inflight_pixels=3 * side
    )
    assert _post(client, {"infer_requests": [_chat([_png()] * 2)]}).status_code == 200
    assert server.pixels.held == 0  # given back once the engine was done with the call
    # Over the call cap across requests: refused from the headers, before anything is decoded.
    reply = _post(client, {"infer_requests": [_chat([_png()]), _chat([_png()] * 2)]})
    assert reply.status_code == 413, reply.text
    assert "--max-call-pixels" in reply.text and "3072 pixels" in reply.text
    # Within the call cap, but other calls hold the server's pixels: 429, retry later.
    other = server.pixels.reserve(2 * side)
    reply = _post(client, {"infer_requests": [_chat([_png()] * 2)]})
    assert reply.status_code == 429 and "--max-inflight-pixels" in reply.text
    assert reply.headers["Retry-After"] == "1"
    other.release()
    assert _post(client, {"infer_requests": [_chat([_png()] * 2)]}).status_code == 200
    # A call refused after its images were reserved (a bad image later in the call) holds nothing.
    reply = _post(client, {"infer_requests": [_chat([_png()]), {"prompt_token_ids": [10**6]}]})
    assert reply.status_code == 400 and server.pixels.held == 0
    stats = server.stats()
    assert stats.rejected_requests == 2 and stats.busy_refusals == 1


def test_a_lease_dropped_without_release_gives_its_pixels_back() -> None:
    from rollmatch.server.media import PixelBudget

    budget = PixelBudget(max_call_pixels=100, max_inflight_pixels=150)
    lease = budget.reserve(100)
    with pytest.raises(Exception, match="--max-inflight-pixels"):
        budget.reserve(100)
    del lease  # a cancelled call: nobody released it
    assert budget.held == 0 and budget.reserve(100).pixels == 100


def test_caps_are_checked_against_each_other_and_the_wire() -> None:
    from rollmatch.server.limits import ServerLimits

    with pytest.raises(ValueError, match=r"--max-call-pixels 99 is below --max-image-pixels 100"):
        ServerLimits(max_image_pixels=100, max_call_pixels=99)
    with pytest.raises(ValueError, match=r"--max-inflight-pixels \d+ is below --max-call-pixels"):
        ServerLimits(max_call_pixels=1 << 30, max_inflight_pixels=1 << 29)
    with pytest.raises(ValueError, match="--max-requests-per-call 5000 is over the wire's bound of 4096"):
        ServerLimits(max_requests_per_call=5000, max_queued_prompts=5000)


# ------------------------------------------------------------------------------------- counts
@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            {
                "infer_requests": [
                    {"messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES_PER_REQUEST + 1)}
                ]
            },
            "infer_requests.0.messages",
        ),
        (
            {
                "infer_requests": [
                    {
                        "messages": [
                            {
                                "role": "user",
                                "content": [{"type": "text", "text": "x"}] * (MAX_CONTENT_PARTS + 1),
                            }
                        ]
                    }
                ]
            },
            "infer_requests.0.messages.0.content",
        ),
        (
            {"infer_requests": [{"prompt_token_ids": [5], "images": ["A"] * (MAX_IMAGES_PER_REQUEST + 1)}]},
            "infer_requests.0.images",
        ),
    ],
)
def test_counts_over_the_wire_bounds_are_refused_while_parsing(client: Any, body: dict, field: str) -> None:
    started = time.monotonic()
    reply = _post(client, body)
    assert reply.status_code == 422, reply.text[:500]
    assert field in reply.json()["error"] and "at most" in reply.json()["error"]
    assert time.monotonic() - started < 2.0


def test_many_requests_are_refused_before_request_objects_are_built() -> None:
    """200,000 requests (10 MB): refused by the wire model without building 200,000 requests."""
    from rollmatch.protocol import InferBody

    raw = json.dumps({"infer_requests": [{"messages": [{"role": "user", "content": "hi"}]}] * 200_000})
    started = time.monotonic()
    with pytest.raises(Exception, match="at most 4096 items"):
        InferBody.model_validate_json(raw)
    bounded = time.monotonic() - started
    started = time.monotonic()
    InferBody.model_validate_json(
        json.dumps({"infer_requests": [{"prompt_token_ids": [5]}] * MAX_INFER_REQUESTS})
    )
    print(
        f"refused 200,000 requests in {bounded:.2f}s; parsed {MAX_INFER_REQUESTS} in {time.monotonic() - started:.2f}s"
    )


# -------------------------------------------------------------------------------- local paths
@pytest.fixture(scope="module")
def media_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(root, outside)``: the allowed media root (good, special and hostile entries) and a directory
    beside it holding a secret image."""
    base = tmp_path_factory.mktemp("media")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    Image.new("RGB", (32, 32), (10, 200, 10)).save(root / "good.png")
    Image.new("RGB", (300, 300), (250, 250, 250)).save(outside / "secret.png")
    Image.new("RGB", (300, 300), (250, 250, 250)).save(root / "secret-copy.png")  # the secret's answer
    Image.new("RGB", (32, 32)).save(root / "unreadable.png")
    (root / "to-secret.png").symlink_to(outside / "secret.png")
    (root / "to-good.png").symlink_to(root / "good.png")
    (root / "loop-a").symlink_to(root / "loop-b")
    (root / "loop-b").symlink_to(root / "loop-a")
    (root / "dir.png").mkdir()
    os.mkfifo(root / "fifo.png")
    (root / "big.png").write_bytes(b"\x89PNG" + b"\0" * 4096)
    return root, outside


@pytest.fixture(scope="module")
def media_engine(tiny_model_dir: Path, media_dirs: tuple[Path, Path]) -> Any:
    from rollmatch.server.engines import HFServerEngine
    from rollmatch.server.media import MediaPolicy

    policy = MediaPolicy(allowed_root=media_dirs[0], max_file_bytes=4000)
    return HFServerEngine(str(tiny_model_dir), max_model_len=1024, media=policy)


@pytest.fixture
def media_client(media_engine: Any, app_client: Callable[..., Any]) -> Any:
    return app_client(media_engine, max_tokens=2)[0]


@pytest.fixture
def client(hf_engine: Any, app_client: Callable[..., Any]) -> Any:
    return app_client(hf_engine, max_tokens=2)[0]


@pytest.fixture
def unreadable(media_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``root/unreadable.png``, which no open can read (EACCES; root reads anything: then the open fails
    as it would for another user)."""
    path = media_dirs[0] / "unreadable.png"
    if os.geteuid() == 0:
        real_open = os.open

        def refusing_open(name: Any, *args: Any, **kwargs: Any) -> int:
            if str(name).endswith("unreadable.png"):
                raise PermissionError(13, "Permission denied", str(name))
            return real_open(name, *args, **kwargs)

        monkeypatch.setattr(os, "open", refusing_open)
        yield path
    else:
        path.chmod(0)
        yield path
        path.chmod(0o644)


def _answer(client: Any, value: str) -> tuple[int, str]:
    reply = _post(client, {"infer_requests": [_chat([value])]})
    return reply.status_code, reply.text.replace(json.dumps(repr(value[:60]))[1:-1], "<path>")


def test_every_os_error_of_a_local_path_is_the_answer_of_a_missing_path(
    media_client: Any, media_dirs: tuple[Path, Path], unreadable: Path
) -> None:
    root, outside = media_dirs
    missing = _answer(media_client, str(root / "missing.png"))
    assert missing[0] == 400 and f"nor a file under the allowed media path {root}" in missing[1]
    for value in (
        # (".png": a path made only of base64 characters, as under a temp dir without "-" or ".", would be
        # read as an inline image first)
        str(root / ("x" * 4000 + ".png")),  # ENAMETOOLONG (one component over NAME_MAX)
        str(root / "/".join(["d" * 200] * 19)) + ".png",  # a deep missing path
        str(unreadable),  # EACCES
        str(root / "loop-a"),  # ELOOP
        str(root / "good.png" / "x.png"),  # ENOTDIR
        str(root / "dir.png"),  # a directory
        str(root / "fifo.png"),  # a FIFO: refused, never waited on
        str(root / "to-secret.png"),  # a symlink leading outside
        str(outside / "secret.png"),  # outside, existing
        str(outside / "missing.png"),  # outside, missing
        f"{root}/../outside/secret.png",
        f"file://{outside}/secret.png",
    ):
        assert _answer(media_client, value) == missing, value
    assert _post(media_client, {"infer_requests": [_chat([str(root / "to-good.png")])]}).status_code == 200
    reply = _post(media_client, {"infer_requests": [_chat([str(root / "big.png")])]})
    assert reply.status_code == 413 and "4100 bytes" in reply.text and "--max-body-bytes" in reply.text


def test_a_symlink_swapped_in_after_the_check_never_leaks_a_file_outside_the_root(
    media_client: Any, media_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is replaced by a symlink to a file outside the root right after the path was resolved
    and checked: the server refuses it (or reads the file it checked), never the one outside."""
    root, outside = media_dirs

    def prompt_tokens(value: str) -> int | None:
        reply = _post(media_client, {"infer_requests": [_chat([value])]})
        return reply.json()[0]["response"]["usage"]["prompt_tokens"] if reply.status_code == 200 else None

    good_tokens, secret_tokens = (
        prompt_tokens(str(root / "good.png")),
        prompt_tokens(str(root / "secret-copy.png")),
    )
    assert good_tokens is not None and secret_tokens is not None and good_tokens != secret_tokens
    swapped = root / "swapped.png"
    real_realpath = os.path.realpath

    def realpath_then_swap(path: Any, *args: Any, **kwargs: Any) -> Any:
        resolved = real_realpath(path, *args, **kwargs)
        if str(path).endswith("swapped.png") and not swapped.is_symlink():
            swapped.unlink()
            swapped.symlink_to(outside / "secret.png")  # the attacker's move, between check and read
        return resolved

    monkeypatch.setattr(os.path, "realpath", realpath_then_swap)
    for _ in range(3):
        if swapped.is_symlink() or swapped.exists():
            swapped.unlink()
        Image.new("RGB", (32, 32), (10, 200, 10)).save(swapped)
        assert prompt_tokens(str(swapped)) in (None, good_tokens)


def test_a_local_file_grown_after_its_header_check_is_held_to_the_call_cap(
    media_engine: Any,
    app_client: Callable[..., Any],
    media_dirs: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollmatch.server import media

    client, server = app_client(media_engine, max_tokens=2, max_image_pixels=64 * 64, max_call_pixels=64 * 64)
    grows = media_dirs[0] / "grows.png"
    Image.new("RGB", (32, 32)).save(grows)
    real_image_size = media.image_size

    def size_then_grow(value: str, *args: Any, **kwargs: Any) -> tuple[int, int]:
        size = real_image_size(value, *args, **kwargs)
        Image.new("RGB", (64, 64)).save(grows)  # replaced between the header check and the decoding
        return size

    monkeypatch.setattr(media, "image_size", size_then_grow)
    reply = _post(client, {"infer_requests": [_chat([str(media_dirs[0] / "good.png"), str(grows)])]})
    # checked: 2 x 32x32; decoded: 32x32 + 64x64 = 5120 pixels, over the call's 4096
    assert reply.status_code == 413 and "5120 pixels" in reply.text and "--max-call-pixels" in reply.text
    assert server.pixels.held == 0


# ------------------------------------------------------------------------------------------ fuzz
FUZZ_EXAMPLES = 100 * int(os.environ.get("ROLLMATCH_FUZZ_SCALE", "1"))


def _media_values(root: Path, outside: Path) -> st.SearchStrategy[str]:
    names = [
        "good.png",
        "to-good.png",
        "to-secret.png",
        "loop-a",
        "dir.png",
        "fifo.png",
        "big.png",
        "unreadable.png",
        "missing.png",
        "good.png/x",
        "../outside/secret.png",
        "x" * 300,
        "",
        ".",
    ]
    inside = st.sampled_from(names).map(lambda name: str(root / name))
    prefixed = st.tuples(st.sampled_from(["", "file://", "file:", "//", " "]), inside).map("".join)
    return st.one_of(
        inside,
        prefixed,
        st.sampled_from(
            [str(outside / "secret.png"), "/", "/proc/self/fd/0", "/dev/zero", "/etc/shadow", "~"]
        ),
        st.integers(1, 20).map(lambda n: str(root / "/".join(["a" * 255] * n))),
        st.text(max_size=12).map(lambda tail: str(root / tail)),
        st.just(_png()),
    )


def test_fuzz_local_media_paths_are_never_a_5xx(
    media_client: Any, media_dirs: tuple[Path, Path], unreadable: Path
) -> None:
    values = _media_values(*media_dirs)
    counts: dict[int, int] = {}

    @settings(
        max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(st.lists(values, min_size=1, max_size=3), st.booleans())
    def fuzz(images: list[str], as_parts: bool) -> None:
        if as_parts:
            content = [{"type": "image", "image": value} for value in images] + [
                {"type": "text", "text": "find"}
            ]
            body = {"infer_requests": [{"messages": [{"role": "user", "content": content}]}]}
        else:
            body = {"infer_requests": [_chat(images)]}
        reply = _post(media_client, body)
        counts[reply.status_code] = counts.get(reply.status_code, 0) + 1
        assert reply.status_code < 500, f"{reply.status_code} for {images}: {reply.text[:300]}"

    fuzz()
    print(f"media path fuzz: {counts}")
    assert counts.get(200, 0) > 0 and counts.get(400, 0) > 0, counts
