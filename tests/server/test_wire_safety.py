"""The real app + a real HF engine, in process: every malformed or oversized request is one clear 4xx.

Covers issue-level cases: out-of-range numbers (seed 2**64), NaN / Infinity in JSON, non-string
content, unknown roles, out-of-vocabulary ids, more ``<image>`` tags than images, a
decompression-bomb PNG, the size caps (body, pixels, requests, max_tokens), local media paths,
stop strings, the token, and a stalled engine making ``/health/`` unhealthy.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from rollmatch.protocol import encode_image

GOOD_CONFIG = {"max_tokens": 4, "temperature": 0.0, "return_details": True}


def _png(size: tuple[int, int] = (32, 32)) -> str:
    return encode_image(Image.new("RGB", size, (200, 30, 30)))


def _chat(content: Any = "<image>find", images: list[str] | None = None) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "images": [_png()] if images is None else images,
    }


def _post(client: Any, body: Any, path: str = "/infer/", **kw: Any) -> Any:
    if isinstance(body, str):
        return client.post(path, content=body, headers={"content-type": "application/json", **kw})
    return client.post(path, json=body, headers=kw or None)


@pytest.fixture
def client(hf_engine: Any, app_client: Callable[..., Any]) -> Any:
    return app_client(hf_engine, max_tokens=16)[0]


def test_a_good_chat_request_is_served(client: Any) -> None:
    reply = _post(client, {"infer_requests": [_chat()], "request_config": GOOD_CONFIG})
    assert reply.status_code == 200, reply.text
    choice = reply.json()[0]["response"]["choices"][0]
    assert len(choice["token_ids"]) <= 4 and choice["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    ("request_config", "field"),
    [
        ({"seed": 2**64, "temperature": 1.0}, "request_config.seed"),
        ({"seed": -(2**63) - 1}, "request_config.seed"),
        ({"temperature": 1e-300}, "request_config.temperature"),
        ({"temperature": 1e300}, "request_config.temperature"),
        ({"repetition_penalty": 1e-300}, "request_config.repetition_penalty"),
        ({"top_p": 0}, "request_config.top_p"),
        ({"top_k": -5}, "request_config.top_k"),
        ({"max_tokens": 0}, "request_config.max_tokens"),
        ({"n": 2}, "request_config.n = 2"),
        ({"stream": True}, "request_config.stream = True"),
        ({"min_p": 0.1}, "request_config.min_p"),
        ({"stop": [""]}, "request_config.stop.0"),
    ],
)
def test_out_of_range_config_is_a_422_naming_the_field(client: Any, request_config: dict, field: str) -> None:
    reply = _post(client, {"infer_requests": [_chat()], "request_config": request_config})
    assert reply.status_code == 422, reply.text
    assert field in reply.json()["error"]


def test_nan_and_infinity_anywhere_are_4xx_not_500(client: Any, free_port: Callable[[], int]) -> None:
    for bad in ("NaN", "Infinity", "-Infinity"):
        for key in ("temperature", "top_p", "seed", "max_tokens", "repetition_penalty", "presence_penalty"):
            body = {"infer_requests": [_chat()], "request_config": {"return_details": True, key: "__X__"}}
            reply = _post(client, json.dumps(body).replace('"__X__"', bad))
            assert reply.status_code == 422, (key, bad, reply.text)
            assert f"request_config.{key}" in reply.json()["error"]
    init = '{"host": "127.0.0.1", "port": 1234, "world_size": 2, "timeout_s": NaN}'
    assert _post(client, init, "/init_communicator/").status_code == 422
    init_body = {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "timeout_s": 3600.0}
    lease = {"X-Rollmatch-Sync-Lease": client.post("/init_communicator/", json=init_body).json()["lease"]}
    bucket = '{"metadatas": [], "transaction": {"version": NaN}}'
    reply = _post(client, bucket, "/update_flattened_params/", **lease)
    assert reply.status_code == 422 and "transaction" in reply.json()["error"]
    finish = '{"version": Infinity, "mode": "full", "bucket_checksums": [], "checksum": ""}'
    assert _post(client, finish, "/finish_weight_update/", **lease).status_code == 422
    assert _post(client, bucket, "/update_flattened_params/").status_code == 409  # no lease: body never read
    assert client.post("/close_communicator/", headers=lease).status_code == 200


@pytest.mark.parametrize(
    ("infer_request", "status", "needle"),
    [
        ({"messages": [{"role": "user", "content": 5}]}, 422, "messages.0.content"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 422, "unknown role 'robot'"),
        ({"messages": [{"role": "user"}]}, 422, "messages.0.content"),
        ({"prompt_token_ids": [-1]}, 422, "prompt_token_ids.0"),
        ({"prompt_token_ids": [5, 10**6]}, 400, "token id 1000000 is outside the vocabulary"),
        ({"prompt_token_ids": [5, 6]}, 200, ""),
        (_chat("<image><image>two"), 400, "2 image slot(s)"),
        (_chat("no tags"), 400, "use only 0"),
        (_chat("<image>x", images=["not base64 !"]), 400, "infer_requests[0].images[0]"),
        (_chat("<image>x", images=[base64.b64encode(b"text").decode()]), 400, "not a decodable"),
        (_chat("<image>x", images=["http://example.com/a.png"]), 400, "does not fetch URLs"),
        ({"messages": [{"role": "user", "content": "hi"}], "add_eos": True}, 422, "add_eos"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}},
            422,
            "tokenize",
        ),
    ],
)
def test_malformed_requests_are_4xx_naming_the_field(
    client: Any, infer_request: dict, status: int, needle: str
) -> None:
    reply = _post(client, {"infer_requests": [infer_request], "request_config": GOOD_CONFIG})
    assert reply.status_code == status, reply.text
    assert needle in reply.text


def test_over_long_prompt_says_so_plainly(hf_engine: Any, app_client: Callable[..., Any]) -> None:
    client, _ = app_client(hf_engine)
    reply = _post(
        client, {"infer_requests": [{"prompt_token_ids": [5] * 1024}], "request_config": GOOD_CONFIG}
    )
    assert reply.status_code == 400
    assert (
        "prompt too long: a prompt of 1024 tokens leaves no room" in reply.text
        and "-" not in reply.text.split("room")[0][-5:]
    )


def test_decompression_bomb_and_size_caps_are_413_or_422(
    hf_engine: Any, app_client: Callable[..., Any]
) -> None:
    client, server = app_client(hf_engine, max_body_bytes=200_000, max_requests_per_call=3, max_tokens=8)
    bomb = Image.new("L", (12000, 12000))  # 144 M pixels, a few hundred KB as PNG
    buffer = io.BytesIO()
    bomb.save(buffer, format="PNG", optimize=True)
    small = app_client(hf_engine, max_tokens=8)[0]
    started = time.monotonic()
    reply = _post(small, {"infer_requests": [_chat(images=[base64.b64encode(buffer.getvalue()).decode()])]})
    assert reply.status_code == 413 and "12000x12000" in reply.text and "--max-image-pixels" in reply.text
    assert time.monotonic() - started < 5  # refused from the header, not after decoding 144 M pixels
    reply = _post(client, {"infer_requests": [_chat(images=["A" * 300_000])]})
    assert reply.status_code == 413 and "--max-body-bytes" in reply.text
    reply = _post(client, {"infer_requests": [_chat()] * 4})
    assert reply.status_code == 413 and "--max-requests-per-call" in reply.text
    reply = _post(client, {"infer_requests": [_chat()], "request_config": {"max_tokens": 9}})
    assert reply.status_code == 422 and "--max-tokens" in reply.text
    reply = _post(client, {"infer_requests": [_chat("<image>" * 9, images=[_png()] * 9)]})
    assert reply.status_code == 413 and "--max-images-per-request" in reply.text
    reply = _post(client, {"infer_requests": [_chat()]})  # max_tokens null: capped, not max_model_len
    assert reply.status_code == 200 and reply.json()[0]["response"]["usage"]["completion_tokens"] <= 8
    assert server.stats().rejected_requests >= 3


def test_a_body_of_many_tiny_values_is_refused_before_it_is_parsed(
    hf_engine: Any, app_client: Callable[..., Any]
) -> None:
    client = app_client(hf_engine, max_json_values=60, max_tokens=4)[0]
    reply = _post(client, {"infer_requests": [{}] * 100})  # 102 objects and arrays: none is built
    assert reply.status_code == 413 and "over this server's limit of 60" in reply.text
    assert "--max-json-values" in reply.text
    reply = _post(client, {"infer_requests": [_chat()] * 2, "request_config": {"stop": ["a"] * 70}})
    assert reply.status_code == 413 and "--max-json-values" in reply.text  # strings count too
    # Braces, brackets and commas inside a prompt raise the bound (text is not scanned).
    braces = _chat("<image>answer like [{" + '"bbox": [1, 2], ' * 60 + "}]")
    reply = _post(client, {"infer_requests": [braces], "request_config": GOOD_CONFIG})
    assert reply.status_code == 413 and "--max-json-values" in reply.text
    few = _chat("<image>answer like [{" + '"bbox": [1, 2], ' * 5 + "}]")
    assert _post(client, {"infer_requests": [few], "request_config": GOOD_CONFIG}).status_code == 200
    # The default cap against 8 MiB of `{}` (the parser would build ~3 M request objects first).
    default = app_client(hf_engine, max_tokens=4)[0]
    flood = b'{"infer_requests":[' + b",".join([b"{}"] * 3_000_000) + b"]}"
    reply = default.post("/infer/", content=flood, headers={"content-type": "application/json"})
    assert reply.status_code == 413 and "--max-json-values" in reply.text


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(alphabet='{}[]"\\ab\n\u00e9'),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(alphabet='{["\\x'), inner, max_size=4)
        ),
        max_leaves=30,
    ),
    st.booleans(),
)
def test_the_json_value_bound_is_an_upper_bound_exact_for_plain_strings(value: Any, ascii_only: bool) -> None:
    from rollmatch.server.limits import json_value_bound

    def values(v: Any) -> int:
        if isinstance(v, dict):  # each key is a string; each comma one more member
            return 1 + sum(1 + values(x) for x in v.values()) + max(len(v) - 1, 0)
        if isinstance(v, list):  # each comma one more item (numbers, true, null count there)
            return 1 + sum(values(x) for x in v) + max(len(v) - 1, 0)
        return int(isinstance(v, str))

    def plain(v: Any) -> bool:
        if isinstance(v, dict):
            return all(plain(k) and plain(x) for k, x in v.items())
        if isinstance(v, list):
            return all(plain(x) for x in v)
        return not isinstance(v, str) or not any(c in v for c in '{[,"')

    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert json_value_bound(raw) >= values(value)
    if plain(value):
        assert json_value_bound(raw) == values(value)


def test_local_paths_only_under_the_allowed_root_and_no_existence_probe(
    tiny_model_dir: Path, tmp_path: Path, app_client: Callable[..., Any]
) -> None:
    from rollmatch.server.engines import HFServerEngine
    from rollmatch.server.media import MediaPolicy

    inside = tmp_path / "media"
    inside.mkdir()
    Image.new("RGB", (32, 32)).save(inside / "a.png")
    outside = tmp_path / "secret.png"
    Image.new("RGB", (32, 32)).save(outside)
    closed = app_client(HFServerEngine(str(tiny_model_dir), max_model_len=512), max_tokens=2)[0]
    answers = [
        _post(closed, {"infer_requests": [_chat(images=[str(path)])]})
        .json()["detail"]
        .replace(str(path), "P")
        for path in (outside, tmp_path / "missing.png")
    ]
    assert (
        answers[0] == answers[1] and "--allowed-local-media-path" in answers[0]
    )  # existence is not revealed
    engine = HFServerEngine(str(tiny_model_dir), max_model_len=512, media=MediaPolicy(allowed_root=inside))
    open_ = app_client(engine, max_tokens=2)[0]
    assert _post(open_, {"infer_requests": [_chat(images=[str(inside / "a.png")])]}).status_code == 200
    for refused in (str(outside), str(inside / ".." / "secret.png")):
        reply = _post(open_, {"infer_requests": [_chat(images=[refused])]})
        assert reply.status_code == 400 and "allowed media path" in reply.text


def test_stop_strings_are_honoured_and_token_ids_stay_stop_trimmed(client: Any, hf_engine: Any) -> None:
    body = {"infer_requests": [_chat()], "request_config": {"max_tokens": 16, "return_details": True}}
    full = _post(client, body).json()[0]["response"]["choices"][0]
    tokenizer = hf_engine.preparer.tokenizer
    pieces = [tokenizer.decode([t]) for t in full["token_ids"]]
    stop = pieces[2][:2] if len(pieces[2]) >= 2 else pieces[2]  # a string generation reaches at token 2
    body["request_config"]["stop"] = [stop]
    cut = _post(client, body).json()[0]["response"]["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["message"]["content"] == full["message"]["content"][: full["message"]["content"].find(stop)]
    assert (
        stop not in tokenizer.decode(cut["token_ids"])
        and cut["token_ids"] == full["token_ids"][: len(cut["token_ids"])]
    )
    assert len(cut["token_ids"]) <= 2


def test_every_post_needs_the_token_when_configured(hf_engine: Any, app_client: Callable[..., Any]) -> None:
    client, server = app_client(hf_engine, api_key="s3cret", max_tokens=2)
    body = {"infer_requests": [_chat()]}
    for path in (
        "/infer/",
        "/init_communicator/",
        "/update_flattened_params/",
        "/finish_weight_update/",
        "/reset_prefix_cache/",
        "/close_communicator/",
        "/get_engine_type/",
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            reply = client.post(path, json=body, headers=headers)
            assert reply.status_code == 401, (path, reply.text)
            assert reply.headers["www-authenticate"] == "Bearer"
    assert client.get("/health/").status_code == 200 and client.get("/stats/").status_code == 401
    assert client.post("/infer/", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert server.stats().infer_calls == 1 and server.stats().communicator == "none"


def test_a_stalled_generation_makes_health_503_and_later_calls_fail_fast(
    hf_engine: Any, app_client: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, _server = app_client(hf_engine, engine_stall_timeout_s=1.0, max_tokens=2)
    release = threading.Event()
    monkeypatch.setattr(hf_engine, "step", lambda: release.wait(30) and [])  # a wedged engine
    waiting: list[Any] = []
    stuck = threading.Thread(
        target=lambda: waiting.append(_post(client, {"infer_requests": [_chat()]})), daemon=True
    )
    stuck.start()
    deadline = time.monotonic() + 10
    while client.get("/health/").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    health = client.get("/health/")
    assert health.status_code == 503 and "generation made no progress" in health.json()["detail"]
    assert health.json()["engine"] == "stalled"
    stuck.join(timeout=5)  # the call that was waiting fails too, within the bound
    assert waiting and waiting[0].status_code == 503 and "stalled" in waiting[0].text
    started = time.monotonic()
    reply = _post(client, {"infer_requests": [_chat()]})
    assert reply.status_code == 503 and "stalled" in reply.text and time.monotonic() - started < 5
    release.set()
    monkeypatch.undo()
    # the engine thread leaves the wedged step when it next runs: /health/ answers 200 from then on
    deadline = time.monotonic() + 10
    while client.get("/health/").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.get("/health/").status_code == 200
    assert _post(client, {"infer_requests": [_chat()]}).status_code == 200
