"""Wire models, images on the wire, swift message conversion, fingerprints, chunks and seeds (no server)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from PIL import Image
from pydantic import ValidationError

from rollmatch.protocol import (
    InferBody,
    InferRequest,
    RequestConfig,
    decoding_from_request_config,
    encode_image,
    fingerprint_mismatches,
    request_config_from_decoding,
)
from rollmatch.rollout.chunking import chunk_seed, contiguous_chunks, step_seed
from rollmatch.rollout.types import Decoding
from rollmatch.server.media import MediaPolicy, decode_image
from rollmatch.server.prompt_preparer import chat_messages


def test_contiguous_chunks_follow_ceil_rule() -> None:
    assert contiguous_chunks(0, 2) == [(0, 0), (0, 0)]
    assert contiguous_chunks(5, 2) == [(0, 3), (3, 5)]
    assert contiguous_chunks(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert contiguous_chunks(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert contiguous_chunks(5, 2) == contiguous_chunks(5, 2)  # stable
    with pytest.raises(ValueError, match="num_servers"):
        contiguous_chunks(3, 0)


def test_chunk_seed_is_deterministic_and_offsets_by_start() -> None:
    assert chunk_seed(42, 7, 3) == chunk_seed(42, 7, 3) == step_seed(42, 7) + 3
    assert step_seed(42, 7) != step_seed(42, 8) and step_seed(42, 7) != step_seed(43, 7)
    assert 0 <= step_seed(10**9, 10**6) < 2**31


def test_request_config_round_trips_decoding() -> None:
    decoding = Decoding(temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.05, max_new_tokens=64)
    config = request_config_from_decoding(decoding, seed=11)
    assert config.seed == 11 and config.return_details
    assert decoding_from_request_config(config, room=100) == decoding


def test_request_config_defaults_are_greedy_with_the_room_left() -> None:
    decoding = decoding_from_request_config(RequestConfig(), room=37)
    assert decoding.greedy and decoding.max_new_tokens == 37 and decoding.top_k == -1
    with pytest.raises(ValueError, match="max_tokens = 50 does not fit"):
        decoding_from_request_config(RequestConfig(max_tokens=50), room=10)
    assert decoding_from_request_config(RequestConfig(), room=37, max_tokens_cap=8).max_new_tokens == 8


def test_unsupported_swift_options_are_rejected_by_name() -> None:
    with pytest.raises(ValidationError, match=r"request_config.n = 2"):
        RequestConfig(n=2)
    with pytest.raises(ValidationError, match="extra"):
        RequestConfig.model_validate({"temprature": 0.5})


def test_infer_request_needs_a_prompt() -> None:
    with pytest.raises(ValidationError, match="needs `messages` or `prompt_token_ids`"):
        InferRequest(images=[])
    assert InferBody.model_validate({"infer_requests": []}).infer_requests == []


def test_images_round_trip_losslessly_from_base64_data_url_and_path(tmp_path: Path) -> None:
    image = Image.new("RGB", (17, 9), (10, 200, 30))
    image.putpixel((3, 4), (1, 2, 3))
    encoded = encode_image(image)
    assert decode_image(encoded).tobytes() == image.tobytes()
    assert decode_image(f"data:image/png;base64,{encoded}").size == (17, 9)
    gray = Image.new("L", (5, 5), 77)
    path = tmp_path / "gray.png"
    gray.save(path)
    assert decode_image(str(path), MediaPolicy(allowed_root=tmp_path)).mode == "RGB"
    with pytest.raises(ValueError, match="local paths are refused"):
        decode_image(str(path))


def test_bad_images_fail_with_what_was_received() -> None:
    with pytest.raises(ValueError, match="does not fetch URLs"):
        decode_image("http://example.com/a.jpg")
    with pytest.raises(ValueError, match="is not valid base64"):
        decode_image("not an image!")
    with pytest.raises(ValueError, match="not a decodable PNG"):
        decode_image(base64.b64encode(b"plain text").decode())


def test_swift_messages_become_chat_template_messages() -> None:
    request = InferRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "You detect."},
                {"role": "user", "content": "<image>Find <image>all"},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "AAA"}},
                        {"type": "text", "text": "x"},
                        {"type": "image"},
                    ],
                },
            ],
            "images": ["I0", "I1", "I2"],
        }
    )
    messages, sources = chat_messages(request.messages, request.images, "r")
    assert messages[0]["content"] == [{"type": "text", "text": "You detect."}]
    assert messages[1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "Find "},
        {"type": "image"},
        {"type": "text", "text": "all"},
    ]
    assert messages[2]["content"][0] == {"type": "image"}
    # tags and value-less parts take the request's images in order; inline values stay in place
    assert [value for _, value in sources] == ["I0", "I1", "AAA", "I2"]
    with pytest.raises(ValueError, match="2 image slot"):
        chat_messages(
            InferRequest.model_validate(
                {"messages": [{"role": "user", "content": "<image><image>"}]}
            ).messages,
            ["I0"],
        )
    with pytest.raises(ValidationError, match="audio"):
        InferRequest.model_validate(
            {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]}
        )


def test_fingerprint_mismatch_lines_show_both_values() -> None:
    local = {
        "architecture": "A",
        "model_type": "m",
        "config": "c",
        "tokenizer": "t1",
        "chat_template": "x",
        "processor": "p",
    }
    remote = dict(local, tokenizer="t2")
    assert fingerprint_mismatches(local, local) == []
    assert fingerprint_mismatches(local, remote) == ["tokenizer: trainer 't1' vs server 't2'"]


def test_fingerprint_sees_processor_and_template_changes(tiny_model_dir: Path) -> None:
    from transformers import AutoConfig, AutoProcessor

    from rollmatch.data.prompts import set_pixel_bounds
    from rollmatch.protocol import model_fingerprint

    config = AutoConfig.from_pretrained(tiny_model_dir)
    base = model_fingerprint(config, AutoProcessor.from_pretrained(tiny_model_dir))
    resized = AutoProcessor.from_pretrained(tiny_model_dir)
    set_pixel_bounds(resized, 28 * 28 * 4, 28 * 28 * 16)
    templated = AutoProcessor.from_pretrained(tiny_model_dir)
    templated.chat_template = "{{ messages }}"
    assert fingerprint_mismatches(base, model_fingerprint(config, resized))[0].startswith("processor:")
    assert fingerprint_mismatches(base, model_fingerprint(config, templated))[0].startswith("chat_template:")
