"""The server-mode backend against real servers: chunking over two servers, config forms, start-up checks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rollmatch.cli import build_parser
from rollmatch.collectives import LocalCollectives
from rollmatch.config.load import load_config_dict
from rollmatch.config.resolved import resolve_run, resolve_run_on_this_machine
from rollmatch.data.prompts import load_processor
from rollmatch.errors import BackendError, ConfigError
from rollmatch.protocol import ServerInfo
from rollmatch.rollout.client import ServerBackend, ServerConnection
from rollmatch.rollout.server_compat import LocalModelInfo, frame_and_resize_mismatches
from rollmatch.rollout.types import Decoding

DECODING = Decoding(max_new_tokens=4)


def _backend(cfg: Any, model: Any, tokenizer: Any) -> ServerBackend:
    return ServerBackend.connect(
        resolve_run_on_this_machine(cfg),
        model=model,
        tokenizer=tokenizer,
        collectives=LocalCollectives(),
        processor=load_processor(cfg.model.path),
    )


@pytest.fixture
def hf_backend(
    hf_server: Any,
    server_config: Callable[..., Any],
    loaded_tiny: tuple[Any, Any],
    prompt_encoder: Any,
    free_port: Callable[[], int],
) -> Iterator[ServerBackend]:
    """The trainer's client of the shared hf server (start-up checks passed), closed after the test."""
    backend = _backend(
        server_config(servers=[{"base_url": hf_server.url, "group_port": free_port()}]),
        loaded_tiny[0],
        prompt_encoder.tokenizer,
    )
    yield backend
    backend.close()


@pytest.mark.heavy
@pytest.mark.parametrize("rotate_servers", [False, True])
def test_requests_are_split_in_contiguous_chunks_and_reassembled_in_order(
    hf_server: Any,
    hf_sync_server: Any,
    server_config: Callable[..., Any],
    raccoon_requests: list[Any],
    loaded_tiny: tuple[Any, Any],
    prompt_encoder: Any,
    free_port: Callable[[], int],
    rotate_servers: bool,
) -> None:
    servers = [
        {"base_url": hf_server.url, "group_port": free_port()},
        {"base_url": hf_sync_server.url, "group_port": free_port()},
    ]
    cfg = server_config(servers=servers, rotate_servers=rotate_servers)
    backend = _backend(cfg, loaded_tiny[0], prompt_encoder.tokenizer)
    requests = [*raccoon_requests, *raccoon_requests[:2]]
    for i, request in enumerate(requests):
        request = requests[i] = type(request)(**{**vars(request), "sample_id": f"s{i}"})
    before = [s.get("/stats/")["infer_requests"] for s in (hf_server, hf_sync_server)]
    rollouts = [backend.generate(requests, DECODING, seed=100) for _ in range(2)]
    after = [s.get("/stats/")["infer_requests"] for s in (hf_server, hf_sync_server)]
    # N=5, S=2 -> [0:3] and [3:5]. The seed's rule: server i gets chunk i on every call, so the same
    # requests twice reach the same server indices. rotate_servers (opt-in) starts each call one server
    # further on. The chunk seeds never depend on the server.
    first = [hf_server.url] * 3 + [hf_sync_server.url] * 2
    rotated = [hf_sync_server.url] * 3 + [hf_server.url] * 2
    second = rotated if rotate_servers else first
    for run, servers_of in zip(rollouts, (first, second), strict=True):
        assert [r.sample_id for r in run] == [f"s{i}" for i in range(5)]
        assert [r.provenance.server for r in run] == servers_of
        assert [r.provenance.seed for r in run] == [100] * 3 + [103] * 2
        assert [r.prompt_token_ids for r in run] == [q.prompt_token_ids for q in requests]
    assert [a - b for a, b in zip(after, before, strict=True)] == ([5, 5] if rotate_servers else [6, 4])
    assert [r.response_token_ids for r in rollouts[0]] == [r.response_token_ids for r in rollouts[1]]
    assert rollouts[0][3].response_token_ids == rollouts[0][0].response_token_ids  # same prompt, both greedy
    calls = hf_server.get("/stats/")["infer_calls"]
    assert backend.generate([], DECODING, seed=1) == []  # N=0 sends nothing
    assert hf_server.get("/stats/")["infer_calls"] == calls
    backend.close()


def test_small_calls_keep_to_the_first_servers_unless_rotation_is_opted_in() -> None:
    """One request per call over three servers: the seed's rule sends every call to server 0; with
    ``rotate_servers`` each client starts at its ``first_server`` (an async actor: its rank) and moves on."""
    urls = [f"http://127.0.0.1:{port}" for port in (1, 2, 3)]

    def servers_used(**keys: Any) -> list[str]:
        backend = ServerBackend(
            [ServerConnection(u, 1, timeout_s=5.0, infer_timeout_s=None) for u in urls],
            collectives=LocalCollectives(),
            tokenizer=None,
            **keys,
        )
        used: list[str] = []
        backend._infer_chunk = lambda conn, chunk, decoding, seed: (  # type: ignore[method-assign]
            used.append(conn.url) or ([], None)
        )
        for _ in range(4):
            backend.generate([object()], DECODING, seed=0)  # type: ignore[list-item]
        return used

    assert servers_used() == [urls[0]] * 4
    assert servers_used(rotate_servers=True) == [urls[0], urls[1], urls[2], urls[0]]
    assert servers_used(rotate_servers=True, first_server=1) == [urls[1], urls[2], urls[0], urls[1]]


def test_sampling_is_seeded_per_chunk_and_logged(
    hf_server: Any,
    hf_backend: ServerBackend,
    raccoon_requests: list[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = hf_backend
    sampling = Decoding(temperature=1.0, top_p=0.95, top_k=50, max_new_tokens=6)
    with caplog.at_level("INFO", logger="rollmatch.rollout.client"):
        first = backend.generate(raccoon_requests[:2], sampling, seed=5)
    again = backend.generate(raccoon_requests[:2], sampling, seed=5)
    assert [r.response_token_ids for r in first] == [r.response_token_ids for r in again]
    assert "temperature=1.0 top_p=0.95 top_k=50" in caplog.text and f"{hf_server.url}': 5" in caplog.text


def test_both_config_forms_and_mismatched_lists_fail_fast(server_config: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match="keep only `servers`"):
        _backend(
            server_config(
                servers=[{"base_url": "http://127.0.0.1:1", "group_port": 2}], base_url="http://127.0.0.1:1"
            ),
            None,
            None,
        )
    with pytest.raises(ConfigError, match="1 group_port"):
        _backend(
            server_config(base_url=["http://127.0.0.1:1", "http://127.0.0.1:2"], group_port=[3]), None, None
        )


def test_unreachable_server_fails_within_the_timeout_naming_url_and_alternatives(
    server_config: Callable[..., Any], free_port: Callable[[], int]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(BackendError) as caught:
        _backend(server_config(base_url=url, group_port=free_port(), timeout_s=2.0), None, None)
    assert time.monotonic() - start < 10
    message = str(caught.value)
    assert url in message and "after 2s" in message
    assert "vllm.mode: colocate" in message and "rollout_backend: hf" in message


def test_server_of_another_model_is_refused_showing_both_values(
    hf_server: Any, hf_backend: ServerBackend
) -> None:
    backend = hf_backend
    served = hf_server.get("/info/")["fingerprint"]
    local = LocalModelInfo(
        fingerprint=dict(served, tokenizer="0123456789abcdef"), max_length=8192, object_format="coord_tokens"
    )
    with pytest.raises(BackendError) as caught:
        backend.check_compatible(local)
    message = str(caught.value)
    assert f"tokenizer: trainer '0123456789abcdef' vs server '{served['tokenizer']}'" in message
    assert "max_model_len 4096" in message
    assert "custom.object_format coord_tokens, the server's tokenizer supports ['qwen_json']" in message
    assert "rollmatch add-coord-tokens" in message


def test_server_of_another_family_frame_or_resize_is_refused_naming_both_values(
    hf_server: Any, hf_backend: ServerBackend
) -> None:
    # the real start-up check passed: both sides resolved `auto` on the tiny Qwen2.5-VL to pixels
    backend = hf_backend
    info = ServerInfo.model_validate(hf_server.get("/info/"))
    assert (info.coord_frame, info.fingerprint["model_type"]) == ("pixels", "qwen2_5_vl")
    low, high = info.min_pixels, info.max_pixels
    assert low is not None and high is not None and info.image_probe is not None
    assert info.image_probe.resized != (1237, 411)  # the probe is resized (and its aspect changed)
    local = LocalModelInfo(
        fingerprint=dict(info.fingerprint, model_type="qwen3_vl"),
        max_length=64,
        object_format="qwen_json",
        coord_frame="norm1000",
        min_pixels=low * 2,
        max_pixels=high * 2,
        image_probe=info.image_probe.model_copy(update={"resized": (28, 28), "image_tokens": 1}),
    )
    with pytest.raises(BackendError) as caught:
        backend.check_compatible(local)
    message = str(caught.value)
    assert "model_type: trainer 'qwen3_vl' vs server 'qwen2_5_vl'" in message
    assert (
        "coord frame: trainer data.coord_frame norm1000 vs server pixels (serve with --coord-frame norm1000)"
        in message
    )
    assert (
        f"min_pixels: trainer data.min_pixels {low * 2} vs server {low} (serve with --min-pixels {low * 2})"
        in message
    )
    assert f"max_pixels: trainer data.max_pixels {high * 2} vs server {high}" in message
    probe = info.image_probe
    assert (
        f"probe image 1237x411: trainer resizes to 28x28 (1 image tokens) vs server {probe.resized[0]}x"
        in message
    )


def test_a_server_without_frame_fields_still_parses_and_is_not_compared() -> None:
    old = {
        "engine": "hf",
        "model_dir": "m",
        "fingerprint": {},
        "dtype": "float32",
        "max_model_len": 1024,
        "world_size": 1,
        "weight_version": 0,
        "sync_modes": ["full"],
    }
    info = ServerInfo.model_validate(old)
    assert (info.coord_frame, info.min_pixels, info.max_pixels, info.image_probe) == (None, None, None, None)
    local = LocalModelInfo(
        fingerprint={},
        max_length=0,
        object_format="qwen_json",
        coord_frame="pixels",
        min_pixels=3136,
        max_pixels=6272,
    )
    assert frame_and_resize_mismatches(local, info) == []
    newer = info.model_copy(update={"coord_frame": "norm1000", "min_pixels": 3136, "max_pixels": 12544})
    assert len(frame_and_resize_mismatches(local, newer)) == 2
    # coordinate tokens are norm1000 by themselves: a server resolving auto to pixels is no mismatch
    tokens = LocalModelInfo(
        fingerprint={}, max_length=0, object_format="coord_tokens", coord_frame="norm1000"
    )
    assert frame_and_resize_mismatches(tokens, newer.model_copy(update={"coord_frame": "pixels"})) == []


def test_adapter_sync_under_several_ranks_fails_fast_with_guidance() -> None:
    class TwoRanks(LocalCollectives):
        world_size = 2

    for mode in ("adapter", "auto"):
        server = {"servers": [{"base_url": "http://127.0.0.1:1", "group_port": 2}]}
        vllm = {"mode": "server", "enable_lora": True, "sync": {"mode": mode}, "server": server}
        lora = {"model": {"lora": {"enabled": True}}}
        cfg = load_config_dict({**lora, "custom": {"extra": {"rollout_matching": {"vllm": vllm}}}})
        with pytest.raises(
            ConfigError,
            match=r"vllm.sync.mode = '\w+': .*set custom.extra.rollout_matching.vllm.sync.mode: full",
        ):  # the rule of config.rules, checked when the run is resolved: before any backend is built
            resolve_run(cfg, world_size=TwoRanks.world_size, device_count=0, device_type="cpu")


def test_infer_timeout_null_or_non_positive_means_none() -> None:
    for value, expected in ((None, None), (0.0, None), (-1.0, None), (30.0, 30.0)):
        assert (
            ServerConnection("http://h:1", 2, timeout_s=1, infer_timeout_s=value).infer_timeout_s == expected
        )


def test_an_error_reply_is_reported_by_its_detail_or_its_body() -> None:
    import requests

    from rollmatch.rollout.connection import detail_of

    def reply(body: bytes) -> requests.Response:
        response = requests.Response()
        response.status_code, response._content = 422, body
        return response

    assert (
        detail_of(reply(b'{"detail": "request_config.seed: out of range"}'))
        == "request_config.seed: out of range"
    )
    assert detail_of(reply(b"[1, 2]")) == "[1, 2]"  # JSON, but not an object: the body as it came
    assert detail_of(reply(b"<html>502 Bad Gateway</html>")) == "<html>502 Bad Gateway</html>"


def test_real_servers_of_other_pixel_bounds_or_another_family_differ_by_value(
    tiny_model_dirs: dict[str, Any],
) -> None:
    """What check_compatible compares, from real engines (in process): a server started with other
    --min-pixels/--max-pixels, and one serving another family, each named with both values."""
    from rollmatch.config.schema import RollmatchConfig
    from rollmatch.protocol import fingerprint_mismatches
    from rollmatch.rollout.server_compat import local_model_info
    from rollmatch.server.engines import HFServerEngine
    from rollmatch.server.rollout_server import RolloutServer
    from rollmatch.server.serve import served_coord_frame

    trainer_dir = str(tiny_model_dirs["qwen2_5_vl"])
    hf = {"custom": {"extra": {"rollout_matching": {"rollout_backend": "hf"}}}}
    run = resolve_run_on_this_machine(RollmatchConfig.model_validate({"model": {"path": trainer_dir}, **hf}))
    local = local_model_info(run, None, load_processor(trainer_dir))
    assert local.coord_frame == "pixels"
    infos = {}
    for name, model_dir, bounds in (
        ("bounds", trainer_dir, (6272, 12544)),
        ("family", str(tiny_model_dirs["qwen3_vl"]), (None, None)),
    ):
        args = build_parser().parse_args(["serve", "--model", model_dir])  # --coord-frame auto
        server = RolloutServer(
            HFServerEngine(model_dir, max_model_len=1024, pixel_bounds=bounds),
            coord_frame=served_coord_frame(args),
        )
        try:
            infos[name] = server.info()
        finally:
            server.close()
    bounds = "\n".join(frame_and_resize_mismatches(local, infos["bounds"]))
    assert f"min_pixels: trainer data.min_pixels {local.min_pixels} vs server 6272" in bounds
    assert f"max_pixels: trainer data.max_pixels {local.max_pixels} vs server 12544" in bounds
    assert "probe image 1237x411: trainer resizes to" in bounds
    family = "\n".join(
        fingerprint_mismatches(local.fingerprint, infos["family"].fingerprint)
        + frame_and_resize_mismatches(local, infos["family"])
    )
    assert "model_type: trainer 'qwen2_5_vl' vs server 'qwen3_vl'" in family
    assert "coord frame: trainer data.coord_frame pixels vs server norm1000" in family
