"""What a call costs before it is refused: chat prompts are tokenised and length-checked one by one
(their images counted from the headers) before any image is decoded, and a call whose client left
stops decoding between images. Real HF engine on the tiny model, in process.

Formerly every chat prompt was rendered, all its images decoded and preprocessed, and only then
was the ``max_model_len`` check made; a client that left mid-preparation had every image decoded.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from typing import Any

import pytest
from PIL import Image

from rollmatch.protocol import InferBody
from rollmatch.server import media, prompt_preparer


def _png(side: int = 56) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (40, 90, 200)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every image decoded, by field name (``server.media.decode_image`` counted where it is used)."""
    names: list[str] = []
    real = media.decode_image

    def counting(value: str, policy: Any, where: str, encoded: Any = None) -> Any:
        names.append(where)
        return real(value, policy, where, encoded)

    monkeypatch.setattr(prompt_preparer, "decode_image", counting)
    return names


def test_an_over_long_chat_prompt_is_refused_before_any_image_is_decoded(
    hf_engine: Any, app_client: Callable[..., Any], decoded: list[str]
) -> None:
    short = {"messages": [{"role": "user", "content": "<image>find"}], "images": [_png()]}
    long = {"messages": [{"role": "user", "content": "<image>" + "find the cat " * 400}], "images": [_png()]}
    client, server = app_client(hf_engine, max_tokens=2)
    reply = client.post(
        "/infer/", json={"infer_requests": [short, long], "request_config": {"max_tokens": 1}}
    )
    assert reply.status_code == 400 and "infer_requests[1].messages" in reply.text, reply.text[:300]
    assert "prompt too long" in reply.text
    assert decoded == [], f"images decoded before the length check: {decoded}"
    assert server.pixels.held == 0 and server.tensors.held == 0


def test_the_length_from_headers_is_the_length_the_processor_makes(
    hf_engine: Any, app_client: Callable[..., Any]
) -> None:
    _, server = app_client(hf_engine)
    request = InferBody.model_validate(
        {
            "infer_requests": [
                {
                    "messages": [{"role": "user", "content": "<image><image>find"}],
                    "images": [_png(56), _png(300)],
                }
            ]
        }
    ).infer_requests[0]
    sizes = {"infer_requests[0].images[0]": (56, 56), "infer_requests[0].images[1]": (300, 300)}
    prepared = server.engine.preparer.prepare(request, 0)
    assert server.engine.preparer.chat_length(request, 0, sizes) == len(prepared.prompt_token_ids)


def test_a_call_whose_client_left_stops_decoding_between_images(
    hf_engine: Any, app_client: Callable[..., Any], decoded: list[str]
) -> None:
    _, server = app_client(hf_engine, max_tokens=2)
    body = InferBody.model_validate(
        {
            "infer_requests": [
                {"messages": [{"role": "user", "content": "<image>" * 6 + "find"}], "images": [_png()] * 6}
            ]
        }
    )
    with pytest.raises(ValueError, match="client disconnected"):
        server.prepare(body, None, lambda: len(decoded) >= 2)  # the client leaves after two images
    assert len(decoded) == 2
    assert server.pixels.held == 0 and server.tensors.held == 0
