"""``image_wire: resized_bmp``: the processor's own pixels, bit for bit, and nothing less strict.

Real tiny models of every family, real photographs (one grayscale, one needing an upscale, a
two-image prompt), both image-processor backends, and a real ``rollmatch serve`` process.
"""

from __future__ import annotations

import base64
import io
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from PIL import Image
from pydantic import ValidationError

from rollmatch.collectives import LocalCollectives
from rollmatch.config.resolved import resolve_run_on_this_machine
from rollmatch.config.schema import DataConfig
from rollmatch.data.prompts import PromptEncoder
from rollmatch.data.records import Record
from rollmatch.errors import BackendError, ConfigError
from rollmatch.rollout.client import ServerBackend
from rollmatch.rollout.image_wire import ResizedBmp, build_image_wire
from rollmatch.rollout.types import Decoding
from rollmatch.server.engines import pixel_inputs
from rollmatch.server.media import decode_image
from rollmatch.server.prompt_preparer import PreparedPrompt, PromptPreparer

DECODING = Decoding(max_new_tokens=8)
RACCOON = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "raccoon" / "images"


def _records(tmp_path: Path) -> list[Record]:
    small = tmp_path / "small.png"  # below min_pixels: the processor scales it up
    Image.new("RGB", (31, 45), (10, 200, 90)).save(small)
    photo = [str(RACCOON / f"raccoon-{i}.jpg") for i in (1, 2, 150, 102)]  # 150 is grayscale
    return [
        *(Record(id=Path(p).stem, images=(p,), width=1, height=1) for p in photo),
        Record(id="small", images=(str(small),), width=31, height=45),
        Record(id="two-images", images=(photo[0], photo[2]), width=1, height=1),
    ]


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_servers_processor_makes_the_trainers_pixel_values_bit_for_bit(
    tiny_model_dirs: dict[str, Path], family: str, backend: str, tmp_path: Path
) -> None:
    if not RACCOON.is_dir():
        pytest.skip(f"real images not found at {RACCOON}")
    model_dir = tiny_model_dirs[family]
    encoder = PromptEncoder.from_pretrained(model_dir, DataConfig())
    if backend == "pil":  # the other backend transformers ships (the only one without torchvision)
        encoder.processor.image_processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    wire = build_image_wire("resized_bmp", encoder.processor)
    preparer = PromptPreparer(encoder.processor)
    for record in _records(tmp_path):
        request = encoder.encode(record).to_request()
        sent = wire.encode(request)
        images = [decode_image(value) for value in sent]  # the server's decoder, media checks included
        assert [image.size for image in images] == [
            (int(w) * wire.patch, int(h) * wire.patch) for _, h, w in request.image_grid_thw.tolist()
        ]
        served = pixel_inputs(preparer, PreparedPrompt(record.id, request.prompt_token_ids, images))
        assert torch.equal(served.image_grid_thw, request.image_grid_thw), record.id
        assert torch.equal(served.pixel_values, request.pixel_values), record.id


def test_resized_bmp_refuses_what_it_cannot_send_exactly(
    prompt_encoder: Any, raccoon_requests: list[Any]
) -> None:
    wire = ResizedBmp(prompt_encoder.processor.image_processor)
    request = raccoon_requests[0]
    bare = type(request)(request.sample_id, request.prompt_token_ids, request.images)
    with pytest.raises(BackendError, match=r"'raccoon-1'.*image_wire.*no pixel_values.*`png`"):
        wire.encode(bare)
    off = type(request)(**{**vars(request), "pixel_values": request.pixel_values * 1.01})
    with pytest.raises(BackendError, match=r"'raccoon-1'.*not this processor's normalised 8-bit pixels"):
        wire.encode(off)
    cut = type(request)(**{**vars(request), "pixel_values": request.pixel_values[1:]})
    with pytest.raises(BackendError, match=r"'raccoon-1'.*pixel_values of shape"):
        wire.encode(cut)
    with pytest.raises(ConfigError, match=r"image_wire.*lacks.*use `png`"):
        ResizedBmp(object())
    with pytest.raises(ValidationError, match="image_wire"):
        from rollmatch.config.schema import RollmatchConfig

        RollmatchConfig.model_validate(
            {"custom": {"extra": {"rollout_matching": {"vllm": {"server": {"image_wire": "webp"}}}}}}
        )


def test_resized_bmp_rolls_out_what_png_rolls_out_on_a_real_server(
    hf_server: Any,
    server_config: Callable[..., Any],
    raccoon_requests: list[Any],
    loaded_tiny: tuple[Any, Any],
    prompt_encoder: Any,
    free_port: Callable[[], int],
    tiny_model_dir: Path,
) -> None:
    from rollmatch.training.variants import ActorRolloutClient

    backends = {
        wire: ServerBackend.connect(
            resolve_run_on_this_machine(
                server_config(
                    servers=[{"base_url": hf_server.url, "group_port": free_port()}], image_wire=wire
                )
            ),
            model=loaded_tiny[0],
            tokenizer=prompt_encoder.tokenizer,
            collectives=LocalCollectives(),
            processor=prompt_encoder.processor,
        )
        for wire in ("png", "resized_bmp")
    }
    assert [b.image_wire.name for b in backends.values()] == ["png", "resized_bmp"]
    png, bmp = (backends[w].generate(raccoon_requests, DECODING, seed=0) for w in ("png", "resized_bmp"))
    assert [r.prompt_token_ids for r in bmp] == [r.prompt_token_ids for r in png]
    assert [r.response_token_ids for r in bmp] == [r.response_token_ids for r in png]
    assert [r.text for r in bmp] == [r.text for r in png]
    sizes = {w: b.last_infer_timings[0].request_bytes for w, b in backends.items()}
    assert sizes["resized_bmp"] < sizes["png"] / 2  # three photographs, shrunk to the processor's size
    actor = ActorRolloutClient(backends["resized_bmp"])  # the async actor sends the same way
    assert actor._client.image_wire is backends["resized_bmp"].image_wire
    assert [r.response_token_ids for r in actor.generate(raccoon_requests, DECODING, 0)] == [
        r.response_token_ids for r in png
    ]
    actor.close()
    for backend in backends.values():
        backend.close()


def _bmp_header(width: int, height: int) -> bytes:
    """A 24-bit BMP file header + info header that declares ``width`` x ``height`` (no pixel data)."""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + len(info) + width * height * 3, 0, 0, 54) + info


def test_bmp_images_get_every_media_check_png_images_get(
    hf_engine: Any, app_client: Callable[..., Any]
) -> None:
    client, _ = app_client(hf_engine, max_tokens=4)

    def infer(raw: bytes) -> Any:
        request = {
            "messages": [{"role": "user", "content": "<image>x"}],
            "images": [base64.b64encode(raw).decode()],
        }
        return client.post("/infer/", json={"infer_requests": [request], "request_config": {"max_tokens": 2}})

    started = time.monotonic()
    reply = infer(_bmp_header(6_000, 6_000))  # 36 M pixels declared in 54 bytes
    assert reply.status_code == 413 and "6000x6000" in reply.text and "--max-image-pixels" in reply.text
    reply = infer(_bmp_header(30_000, 30_000))
    assert reply.status_code == 413 and "decompression bomb refused" in reply.text
    assert time.monotonic() - started < 5  # both refused from the header
    reply = infer(_bmp_header(64, 64) + b"\x00" * 100)  # truncated pixel data
    assert reply.status_code == 400 and "infer_requests[0].images[0]" in reply.text
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (1, 2, 3)).save(buffer, format="BMP")
    assert infer(buffer.getvalue()).status_code == 200
