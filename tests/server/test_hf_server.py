"""A real ``rollmatch serve --engine hf`` process: health, info, batched image rollouts, swift's JSON shape."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import requests

from rollmatch.protocol import encode_image, model_fingerprint
from rollmatch.rollout.hf import HFBackend
from rollmatch.rollout.types import Decoding

DECODING = Decoding(max_new_tokens=12)


def _infer(url: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{url}/infer/", json=body, timeout=120)


def _token_request(request: Any) -> dict[str, Any]:
    return {
        "prompt_token_ids": request.prompt_token_ids,
        "images": [encode_image(image) for image in request.images],
        "sample_id": request.sample_id,
    }


def test_health_world_size_and_info(
    hf_server: Any, loaded_tiny: tuple[Any, Any], tiny_model_dir: Path
) -> None:
    model, processor = loaded_tiny
    health = hf_server.get("/health/")
    assert health["status"] == "ok" and health["engine"] == "idle", health
    assert hf_server.get("/get_world_size/") == {"world_size": 1}
    info = hf_server.get("/info/")
    assert info["engine"] == "hf" and info["model_dir"] == str(tiny_model_dir)
    assert info["fingerprint"] == model_fingerprint(model.config, processor)
    assert info["dtype"] == "float32" and info["max_model_len"] == 4096 and info["sync_modes"] == ["full"]
    assert info["weight_version"] == 0


def test_batch_of_images_uses_the_trainers_ids_and_equals_hf_greedy(
    hf_server: Any, raccoon_requests: list[Any], loaded_tiny: tuple[Any, Any], prompt_encoder: Any
) -> None:
    body = {
        "infer_requests": [_token_request(r) for r in raccoon_requests],
        "request_config": {"max_tokens": DECODING.max_new_tokens, "temperature": 0.0, "return_details": True},
    }
    reply = _infer(hf_server.url, body)
    assert reply.status_code == 200, reply.text
    assert reply.headers["X-Weight-Version"] == "0"
    local = HFBackend(
        loaded_tiny[0],
        prompt_encoder.tokenizer,
        eos_token_id=prompt_encoder.eos_token_id,
        pad_token_id=prompt_encoder.pad_token_id,
    ).generate(raccoon_requests, DECODING, seed=0)
    items = reply.json()
    assert [item["sample_id"] for item in items] == [r.sample_id for r in raccoon_requests]
    for item, request, expected in zip(items, raccoon_requests, local, strict=True):
        choice = item["response"]["choices"][0]
        assert item["response"]["prompt_token_ids"] == request.prompt_token_ids
        assert choice["token_ids"] == expected.response_token_ids == item["response_token_ids"][0]
        assert choice["finish_reason"] == expected.finish_reason
        assert choice["message"]["content"] == expected.text
        assert item["weight_version"] == 0 and item["rollout_infos"]["weight_version"] == 0


def test_swift_shaped_request_gets_the_fields_swifts_client_reads(
    hf_server: Any, raccoon_requests: list[Any], prompt_encoder: Any
) -> None:
    image_path = Path(raccoon_requests[0].messages[0]["content"][0]["image"])
    swift_body = {  # what ms-swift's VLLMClient.infer posts: asdict(RolloutInferRequest), asdict(RequestConfig)
        "infer_requests": [
            {
                "messages": [{"role": "user", "content": f"<image>{prompt_encoder.prompt}"}],
                "images": [base64.b64encode(image_path.read_bytes()).decode()],
                "audios": [],
                "videos": [],
                "tools": None,
                "objects": {},
                "data_dict": {},
                "uuid": "abc",
            }
        ],
        "request_config": {
            "max_tokens": 8,
            "temperature": 0.0,
            "top_k": None,
            "top_p": None,
            "repetition_penalty": None,
            "num_beams": 1,
            "stop": [],
            "seed": 3,
            "stream": False,
            "logprobs": False,
            "top_logprobs": None,
            "n": 1,
            "best_of": None,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "length_penalty": 1.0,
            "return_details": True,
            "structured_outputs_regex": None,
        },
        "metrics": None,
        "template": None,
        "use_tqdm": None,
        "adapter_request": None,
    }
    reply = _infer(hf_server.url, swift_body)
    assert reply.status_code == 200, reply.text
    (item,) = reply.json()
    response = item["response"]  # swift: RolloutOutput.model_validate(item).response
    assert set(response) >= {"model", "choices", "usage", "id", "object", "created", "prompt_token_ids"}
    choice = response["choices"][0]
    assert {"index", "message", "finish_reason", "token_ids", "logprobs"} <= set(choice)
    assert choice["finish_reason"] in ("stop", "length") and len(choice["token_ids"]) <= 8
    assert response["usage"]["prompt_tokens"] == len(response["prompt_token_ids"])
    # the chat messages were encoded exactly as the trainer encodes the same prompt
    assert response["prompt_token_ids"] == raccoon_requests[0].prompt_token_ids
    assert item["sample_id"] == "abc"


def test_bad_requests_get_one_clear_error(hf_server: Any, raccoon_requests: list[Any]) -> None:
    request = _token_request(raccoon_requests[0])
    no_image = dict(request, images=[])
    reply = _infer(hf_server.url, {"infer_requests": [no_image]})
    assert (
        reply.status_code == 400
        and "1 image placeholder block(s) (1 <|image_pad|> run(s)) but the request carries 0" in reply.text
    )
    reply = _infer(hf_server.url, {"infer_requests": [request], "request_config": {"n": 2}})
    assert reply.status_code == 422 and "request_config.n = 2 is not supported" in reply.text
    reply = _infer(hf_server.url, {"infer_requests": [{"images": []}]})
    assert reply.status_code == 422 and "needs `messages` or `prompt_token_ids`" in reply.text
    assert _infer(hf_server.url, {"infer_requests": []}).json() == []
