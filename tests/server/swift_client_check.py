"""Run under the ms-swift virtualenv (``make swift-venv``): ms-swift 4.x's own request classes against a
real ``rollmatch serve``. Usage: ``swift_client_check.py URL IMAGE_PATH``; prints one JSON summary and
exits non-zero on the first mismatch.

Bodies are built exactly as ms-swift's ``VLLMInferClient.infer`` builds them: ``asdict`` of
``RolloutInferRequest`` / ``RequestConfig``, plus ``metrics``, ``use_tqdm`` and ``adapter_request``;
every reply item must validate as ms-swift's ``RolloutOutput``.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from dataclasses import asdict
from importlib.metadata import version

import requests
from swift.infer_engine.protocol import RequestConfig, RolloutInferRequest, RolloutOutput


def post(url: str, requests_: list[RolloutInferRequest], config: RequestConfig) -> requests.Response:
    headers = (
        {"Authorization": f"Bearer {os.environ['ROLLMATCH_API_KEY']}"}
        if os.environ.get("ROLLMATCH_API_KEY")
        else {}
    )
    body = {
        "infer_requests": [asdict(r) for r in requests_],
        "request_config": asdict(config),
        "metrics": None,
        "use_tqdm": None,
        "adapter_request": None,
    }
    return requests.post(f"{url}/infer/", json=body, headers=headers, timeout=120)


def served(url: str, requests_: list[RolloutInferRequest], config: RequestConfig) -> list[RolloutOutput]:
    reply = post(url, requests_, config)
    assert reply.status_code == 200, f"{reply.status_code}: {reply.text[:2000]}"
    outputs = [RolloutOutput.model_validate(item) for item in reply.json()]  # what swift's client does
    assert len(outputs) == len(requests_)
    return outputs


def main(url: str, image_path: str) -> dict[str, object]:
    image = base64.b64encode(open(image_path, "rb").read()).decode()  # noqa: SIM115
    request = RolloutInferRequest(
        messages=[{"role": "user", "content": "<image>Detect every object."}],
        images=[image],
        uuid="swift-1",
        data_dict={"solution": "kept by the client, ignored by the server"},
    )
    fields = sorted(asdict(request)) + sorted(asdict(RequestConfig()))
    greedy = RequestConfig(max_tokens=12, temperature=0.0, stop=["<|im_end|>"], return_details=True)
    (full,) = served(url, [request], greedy)
    choice = full.response.choices[0]
    assert choice.token_ids is not None and full.response.prompt_token_ids, "return_details ignored"
    assert full.response_token_ids == [choice.token_ids] and choice.finish_reason in ("stop", "length")
    assert full.response.usage.prompt_tokens == len(full.response.prompt_token_ids)
    text = choice.message.content

    # a stop string the greedy response reaches: text cut before it, ids a stop-trimmed prefix
    stop = text[len(text) // 2 : len(text) // 2 + 2] or text[:1]
    (cut,) = served(
        url, [request], RequestConfig(max_tokens=12, temperature=0.0, stop=[stop], return_details=True)
    )
    cut_choice = cut.response.choices[0]
    assert cut_choice.finish_reason == "stop" and cut_choice.message.content == text[: text.find(stop)]
    assert cut_choice.token_ids == choice.token_ids[: len(cut_choice.token_ids)]

    sampling = RequestConfig(max_tokens=8, temperature=1.0, top_p=0.9, top_k=20, seed=5, return_details=True)
    first, again = served(url, [request], sampling), served(url, [request], sampling)
    assert first[0].response.choices[0].token_ids == again[0].response.choices[0].token_ids, "seed ignored"

    # logprobs: one per sampled token, read the way swift's GRPO trainer reads them
    (scored,) = served(
        url,
        [request],
        RequestConfig(max_tokens=8, temperature=1.0, seed=5, logprobs=True, return_details=True),
    )
    scored_choice = scored.response.choices[0]
    values = [item["logprob"] for item in scored_choice.logprobs["content"]]
    stopped = scored_choice.finish_reason == "stop"
    assert len(values) == len(scored_choice.token_ids) + int(stopped), (len(values), scored_choice)
    assert scored.rollout_logprobs == [values] and all(v <= 0.0 for v in values)

    refused = {}
    for name, config in {
        "n": RequestConfig(n=2),
        "stream": RequestConfig(stream=True),
        "top_logprobs": RequestConfig(logprobs=True, top_logprobs=3),
        "min_p": RequestConfig(min_p=0.1),
        "num_beams": RequestConfig(num_beams=2),
    }.items():
        reply = post(url, [request], config)
        assert reply.status_code == 422 and f"request_config.{name}" in reply.text, (
            name,
            reply.status_code,
            reply.text,
        )
        refused[name] = reply.status_code
    scoring = RolloutInferRequest(messages=[{"role": "user", "content": "hi"}], add_eos=True)
    reply = post(url, [scoring], RequestConfig(max_tokens=2))
    assert reply.status_code == 422 and "add_eos" in reply.text, reply.text
    return {
        "ms_swift": version("ms-swift"),
        "fields_sent": fields,
        "greedy_tokens": len(choice.token_ids),
        "stop": stop,
        "stop_trimmed_tokens": len(cut_choice.token_ids),
        "refused": refused,
        "logprobs": len(values),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
