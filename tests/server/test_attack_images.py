"""Image container bombs on a real ``rollmatch serve`` process: formats other than PNG, JPEG, WEBP
and uncompressed BMP are refused before any parser sees them, and a JPEG's segments and scans are
bounded before PIL opens it.

Formerly each passed every pixel check: a TIFF strip table of 3M entries (12 MB) cost +992 MB at
the header read, 1M empty APP0 segments in a JPEG (4 MB) +148 MB, a progressive JPEG of 2,000
scans (87 KB) decoded for 1.75 s. Each attack here: every ``/health/`` probe within 1 s, server RSS
growth <= 300 MB, the 4xx within 2 s.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from attack_probe import assert_bounded, health_watch, rss_mib
from PIL import Image

from rollmatch.server import adversarial
from rollmatch.server.image_containers import check_container

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def image_server(start_server: Callable[..., Any], tiny_model_dir: Path) -> Any:
    return start_server(tiny_model_dir, "--engine", "hf")


@pytest.mark.parametrize(
    ("name", "body", "status", "says"),
    [
        (
            "tiff_strip_table",
            adversarial.tiff_strip_table(3_000_000),
            400,
            "not a decodable PNG/JPEG/WEBP/BMP image",
        ),
        ("jpeg_many_segments", adversarial.jpeg_many_segments(1_000_000), 413, "JPEG segments"),
        ("jpeg_many_scans", adversarial.jpeg_many_scans(2_000), 413, "JPEG scans"),
    ],
    ids=lambda value: "body" if isinstance(value, bytes) else None,  # not megabytes of id (nor of env)
)
def test_an_image_container_bomb_is_refused_cheaply(
    image_server: Any, name: str, body: bytes, status: int, says: str
) -> None:
    before = rss_mib(image_server.process.pid)
    with health_watch(image_server.url, image_server.process.pid) as record:
        for _ in range(2):
            started = time.monotonic()
            reply = requests.post(f"{image_server.url}/infer/", data=body, headers=JSON, timeout=30)
            took = time.monotonic() - started
            assert reply.status_code == status and says in reply.text, (
                name,
                reply.status_code,
                reply.text[:300],
            )
            assert took < 2.0, (name, took)
        time.sleep(0.3)
    assert_bounded(record, before, name)


def _encoded(image: Image.Image, fmt: str, **options: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return io.BytesIO(buffer.getvalue())


@pytest.mark.parametrize(
    ("fmt", "options"),
    [("PNG", {}), ("JPEG", {}), ("JPEG", {"progressive": True}), ("WEBP", {}), ("BMP", {})],
)
def test_the_formats_the_trainer_and_data_sets_use_pass_the_walk(fmt: str, options: dict[str, Any]) -> None:
    image = Image.new("RGB", (64, 48), (10, 200, 30))
    assert check_container(_encoded(image, fmt, **options), "image") == fmt


@pytest.mark.parametrize("fmt", ["GIF", "TIFF", "ICO", "PPM"])
def test_other_formats_are_refused(fmt: str) -> None:
    with pytest.raises(ValueError, match="not a decodable PNG/JPEG/WEBP/BMP image"):
        check_container(_encoded(Image.new("RGB", (16, 16)), fmt), "image")


def test_the_real_photographs_pass_the_walk() -> None:
    from server_processes import RACCOON

    photos = sorted(RACCOON.glob("*.jpg"))[:50]
    if not photos:
        pytest.skip(f"real images not found at {RACCOON}")
    for photo in photos:
        assert check_container(io.BytesIO(photo.read_bytes()), photo.name) == "JPEG"


def test_the_bombs_are_what_they_claim() -> None:
    """The test bodies are real containers PIL opens (so the old code did parse them)."""
    for body in (adversarial.tiff_strip_table(100), adversarial.jpeg_many_segments(10)):
        image = base64.b64decode(json.loads(body)["infer_requests"][0]["images"][0])
        assert Image.open(io.BytesIO(image)).size[0] >= 1


def test_the_budget_charges_what_the_processor_makes_not_source_pixels(
    hf_engine: Any, app_client: Callable[..., Any]
) -> None:
    """A 1x1 image was charged 1 pixel but becomes 74 KiB of float32 patches; a solid 448x448 PNG
    of 1 KB becomes 1.2 MiB here (4.6 MiB at max_pixels 200,704)."""
    client, server = app_client(hf_engine, max_tokens=2, max_call_tensor_bytes=8 << 20)

    def body(side: int, count: int) -> dict[str, Any]:
        buffer = io.BytesIO()
        Image.new("RGB", (side, side), (9, 9, 9)).save(buffer, format="PNG")
        image = base64.b64encode(buffer.getvalue()).decode()
        request = {
            "messages": [{"role": "user", "content": "<image>" * count + "find"}],
            "images": [image] * count,
        }
        return {"infer_requests": [request], "request_config": {"max_tokens": 1}}

    assert server.engine.preparer.tensor_bytes(1, 1) == 75264  # min_pixels 3,136: 16 patches of 4,704 bytes
    reply = client.post("/infer/", json=body(448, 8))  # 1.6 M source pixels, 9.6 MB of patches
    assert reply.status_code == 413 and "--max-call-tensor-bytes" in reply.text, reply.text[:300]
    assert client.post("/infer/", json=body(448, 4)).status_code == 200
    assert server.tensors.held == 0 and server.pixels.held == 0
