"""Chat templates on the rollout server: only the served model's own, only allow-listed flags, bounded work.

- a client's ``chat_template`` (and any key outside ``protocol.TEMPLATE_FLAGS``) is a 422 naming it,
  answered before anything renders: a looping client template comes back at once and leaves the
  server idle;
- the served template refusing a conversation (``raise_exception``, an undefined value, a sandbox
  refusal, a type error, a division by zero, runaway recursion) is a 400 carrying its message; a
  runaway loop stops at the render's step budget (a 422) and the server keeps serving;
- allowed flags reach the template; the bounded renderer gives transformers' exact text.

The served template here is :data:`PROBE_TEMPLATE`: a Qwen3-style template (it refuses a conversation
without a user turn, reads ``enable_thinking`` and ``add_vision_id``) that misbehaves on purpose
when the last text is one of its probes. Real ``rollmatch serve`` processes over HTTP; the renderer
itself in process.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from fuzz_bodies import SMALL_PNG, TEMPLATE_PROBES, infer_bodies
from hypothesis import HealthCheck, given, settings
from pydantic import ValidationError

from rollmatch.protocol import MAX_CONTENT_PARTS, MAX_MESSAGES_PER_REQUEST, TEMPLATE_FLAGS, InferRequest
from rollmatch.server.chat_template import RENDER_STEPS, ChatTemplate, RenderOverBudget, TemplateRefused
from rollmatch.server.prompt_preparer import MAX_TEXT_CHARS

PROBE_TEMPLATE = (
    "{%- set ns = namespace(users=0, pictures=0) %}"
    "{%- for message in messages %}{% if message.role == 'user' %}{% set ns.users = ns.users + 1 %}"
    "{% endif %}{% endfor %}"
    "{%- if ns.users == 0 %}{{ raise_exception('No user query found in messages.') }}{% endif %}"
    "{%- macro render_content(content) %}{% for part in content %}"
    "{% if part.type == 'image' %}{% set ns.pictures = ns.pictures + 1 %}"
    "{% if add_vision_id %}Picture {{ ns.pictures }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endmacro %}"
    "{%- macro forever(n) %}{{ forever(n + 1) }}{% endmacro %}"
    "{%- set last = messages[-1].content %}"
    "{%- set probe = last[-1].text if last and last[-1].type == 'text' else '' %}"
    "{%- if probe == 'probe:raise' %}{{ raise_exception('custom refusal from the template') }}"
    "{%- elif probe == 'probe:undefined' %}{{ nothing.attr }}"
    "{%- elif probe == 'probe:type' %}{{ 'text' + messages }}"
    "{%- elif probe == 'probe:divide' %}{{ 1 // 0 }}"
    "{%- elif probe == 'probe:unsafe' %}{{ [].append(1) }}"
    "{%- elif probe == 'probe:recurse' %}{{ forever(0) }}"
    "{%- elif probe == 'probe:loop' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{{ render_content(message.content) }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
CONFIG = {"max_tokens": 2, "temperature": 0.0, "return_details": True}
# A client template that would spin for hours if it ran, and one that would put a marker in the prompt.
LOOPING = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MARKED = "MARKER{% for m in messages %}{{ m.content[-1].text }}{% endfor %}<|im_start|>assistant\n"


def _request(text: str = "find", *, image: bool = True, **fields: Any) -> dict[str, Any]:
    content = f"<image>{text}" if image else text
    return {
        "messages": [{"role": "user", "content": content}],
        "images": [SMALL_PNG] if image else [],
        **fields,
    }


def _post(url: str, *requests_: dict[str, Any], timeout: float = 60) -> requests.Response:
    body = {"infer_requests": list(requests_), "request_config": CONFIG}
    return requests.post(f"{url}/infer/", json=body, timeout=timeout)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _idle_cpu(pid: int, seconds: float = 2.0) -> float:
    before = _cpu_seconds(pid)
    time.sleep(seconds)
    return _cpu_seconds(pid) - before


@pytest.fixture(scope="module")
def probe_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with :data:`PROBE_TEMPLATE` as its chat template."""
    out = tmp_path_factory.mktemp("probe_model") / "model"
    shutil.copytree(tiny_model_dir, out)
    (out / "chat_template.jinja").write_text(PROBE_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def probe_server(start_server: Callable[..., Any], probe_model_dir: Path) -> Any:
    return start_server(probe_model_dir, "--engine", "hf", "--max-tokens", "4")


# ----------------------------------------------------------------------------------- at the wire
@pytest.mark.parametrize("key", ["chat_template", "tokenize", "add_generation_prompt", "tools", "eos_token"])
def test_keys_that_change_what_runs_are_refused_naming_the_key(key: str) -> None:
    with pytest.raises(ValidationError) as caught:
        InferRequest.model_validate(_request(chat_template_kwargs={key: "x"}))
    message = str(caught.value)
    assert f"'{key}'" in message and all(flag in message for flag in TEMPLATE_FLAGS), message


def test_flags_take_true_false_or_null_only() -> None:
    for value in (True, False, None):
        request = InferRequest.model_validate(_request(chat_template_kwargs={"enable_thinking": value}))
        assert request.chat_template_kwargs == {"enable_thinking": value}
    for value in ("false", 0, "{{ 7 * 7 }}", [True]):
        with pytest.raises(ValidationError, match="enable_thinking"):
            InferRequest.model_validate(_request(chat_template_kwargs={"enable_thinking": value}))


# ------------------------------------------------------------------------------- over real HTTP
def test_a_client_template_is_a_422_and_never_runs(probe_server: Any) -> None:
    pid = probe_server.process.pid
    for template in (MARKED, LOOPING):
        started = time.monotonic()
        reply = _post(
            probe_server.url, _request(chat_template_kwargs={"chat_template": template}), timeout=30
        )
        assert reply.status_code == 422, reply.text[:500]
        assert time.monotonic() - started < 10
        error = reply.json()["error"]
        assert "chat_template" in error and "cannot bring its own chat template" in error, error
        assert all(flag in error for flag in TEMPLATE_FLAGS) and "MARKER" not in error
        assert reply.json()["detail"][0]["loc"][-1] == "chat_template_kwargs"  # refused while parsing
    assert _idle_cpu(pid) < 0.5  # nothing left running after the client got its answer
    assert _post(probe_server.url, _request()).status_code == 200


@pytest.mark.parametrize("key", ["bogus_flag", "max_pixels", "documents", "continue_final_message"])
def test_an_unknown_kwarg_is_a_422_naming_it_and_the_allowed_ones(probe_server: Any, key: str) -> None:
    reply = _post(probe_server.url, _request(chat_template_kwargs={key: True}))
    assert reply.status_code == 422, reply.text[:500]
    error = reply.json()["error"]
    assert f"'{key}'" in error and ", ".join(TEMPLATE_FLAGS) in error, error


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("probe:raise", "custom refusal from the template"),
        ("probe:undefined", "'nothing' is undefined"),
        ("probe:type", "can only concatenate str"),
        ("probe:divide", "ZeroDivisionError"),
        ("probe:unsafe", "access to attribute 'append' of 'list' object is unsafe"),
        ("probe:recurse", "RecursionError"),
    ],
)
def test_template_errors_are_400_with_the_templates_message(
    probe_server: Any, text: str, needle: str
) -> None:
    reply = _post(probe_server.url, _request(text))
    assert reply.status_code == 400, reply.text[:500]
    detail = reply.json()["detail"]
    assert "infer_requests[0].messages" in detail and needle in detail, detail


def test_qwen3_style_refusal_of_a_conversation_without_a_user_turn_is_a_400(probe_server: Any) -> None:
    body = {"messages": [{"role": "system", "content": "only a system prompt"}]}
    reply = _post(probe_server.url, body)
    assert reply.status_code == 400 and "No user query found in messages." in reply.json()["detail"]


def test_a_runaway_render_stops_at_its_step_budget_and_the_server_keeps_serving(probe_server: Any) -> None:
    pid = probe_server.process.pid
    started = time.monotonic()
    reply = _post(probe_server.url, _request("probe:loop"), timeout=30)  # 10**10 iterations if unbounded
    assert reply.status_code == 422 and "loop iterations and calls" in reply.json()["detail"], reply.text
    assert time.monotonic() - started < 10
    assert _idle_cpu(pid) < 0.5
    assert _post(probe_server.url, _request()).status_code == 200


def test_allowed_flags_reach_the_template(probe_server: Any, tiny_tokenizer: Any) -> None:
    def prompt(flags: dict[str, Any]) -> str:
        reply = _post(probe_server.url, _request(chat_template_kwargs=flags))
        assert reply.status_code == 200, reply.text[:500]
        ids = reply.json()[0]["response"]["prompt_token_ids"]
        return tiny_tokenizer.decode(ids, skip_special_tokens=False)

    plain = prompt({})
    assert plain.endswith("<|im_start|>assistant\n") and "Picture" not in plain
    assert prompt({"enable_thinking": False}).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt({"enable_thinking": True}) == plain == prompt({"enable_thinking": None})
    assert "Picture 1: <|vision_start|>" in prompt({"add_vision_id": True, "preserve_thinking": True})


def test_a_real_request_with_enable_thinking_false_is_served(hf_server: Any) -> None:
    """The tiny Qwen2.5-VL template reads no thinking flag: the same prompt, served."""
    replies = [
        _post(hf_server.url, _request(chat_template_kwargs=flags))
        for flags in ({}, {"enable_thinking": False, "add_vision_id": False})
    ]
    assert [reply.status_code for reply in replies] == [200, 200], replies[1].text[:500]
    first, second = (reply.json()[0]["response"] for reply in replies)
    assert first["prompt_token_ids"] == second["prompt_token_ids"]


def test_a_conversation_over_the_text_cap_is_a_413_before_rendering(probe_server: Any) -> None:
    long = {"messages": [{"role": "user", "content": "a" * (MAX_TEXT_CHARS + 1)}]}
    reply = _post(probe_server.url, long)
    assert reply.status_code == 413 and f"limit of {MAX_TEXT_CHARS} per prompt" in reply.json()["detail"]


# ------------------------------------------------------------------------------------ in process
def test_the_bounded_renderer_gives_transformers_text(tiny_model_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    messages = [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "find"}]},
    ]
    extra = (
        "{% for m in messages %}{% if loop.index > 5 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% set hidden = 1 %}{% endgeneration %}{{ hidden }}{% endfor %}"
        "{{ eos_token }}{{ bos_token is none }}{{ tools is none }}"
    )
    for family, model_dir in tiny_model_dirs.items():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for source in (tokenizer.chat_template, PROBE_TEMPLATE, PROBE_TEMPLATE + extra):
            template = ChatTemplate(source, tokenizer.special_tokens_map)
            for flags in ({}, {"enable_thinking": False}, {"add_vision_id": True}):
                expected = tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, chat_template=source, **flags
                )
                assert template.render(messages, flags) == expected, (family, flags)


def test_the_step_budget_counts_loop_iterations_and_calls() -> None:
    # 4 + 4 * 5 iterations, 1 + 4 calls of range(): 29 steps
    loops = "{% for i in range(4) %}{% for j in range(5) %}.{% endfor %}{% endfor %}"
    assert ChatTemplate(loops, {}, steps=29).render([], {}) == "." * 20
    with pytest.raises(RenderOverBudget, match="more than 28 loop iterations and calls"):
        ChatTemplate(loops, {}, steps=28).render([], {})
    calls = "{% macro f() %}x{% endmacro %}{{ f() }}{{ f() }}{{ f() }}"
    assert ChatTemplate(calls, {}, steps=3).render([], {}) == "xxx"
    with pytest.raises(RenderOverBudget):
        ChatTemplate(calls, {}, steps=2).render([], {})
    with pytest.raises(TemplateRefused, match="No user query"):
        ChatTemplate(PROBE_TEMPLATE, {}).render([{"role": "system", "content": []}], {})


def test_the_largest_conversation_the_wire_admits_renders_within_a_fifth_of_the_budget() -> None:
    part = {"type": "text", "text": "x"}
    messages = [{"role": "user", "content": [part] * MAX_CONTENT_PARTS}] * MAX_MESSAGES_PER_REQUEST
    text = ChatTemplate(PROBE_TEMPLATE, {}, steps=RENDER_STEPS // 5).render(messages, {})
    assert text.count("x") == MAX_CONTENT_PARTS * MAX_MESSAGES_PER_REQUEST


@pytest.fixture(scope="module")
def probe_client(probe_model_dir: Path) -> Any:
    from fastapi.testclient import TestClient

    from rollmatch.server.app import build_app
    from rollmatch.server.engines import HFServerEngine
    from rollmatch.server.limits import ServerLimits
    from rollmatch.server.rollout_server import RolloutServer

    server = RolloutServer(
        HFServerEngine(str(probe_model_dir), max_model_len=1024), ServerLimits(max_tokens=4)
    )
    with TestClient(build_app(server), raise_server_exceptions=False) as client:
        yield client
    server.scheduler.close()
    server.sync.shutdown()


def test_fuzz_the_probe_template_no_5xx(probe_client: Any) -> None:
    """Fuzzed bodies (probe texts and template kwargs among them) on the probe template: never a 5xx."""
    counts: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(infer_bodies())
    def fuzz(text: str) -> None:
        status = probe_client.post(
            "/infer/", content=text, headers={"content-type": "application/json"}
        ).status_code
        counts[status] = counts.get(status, 0) + 1
        assert status < 500, f"answered {status} to {text[:2000]}"

    fuzz()
    assert counts.get(200, 0), counts  # some served (the template's refusals: the probes below)
    for probe in TEMPLATE_PROBES:
        reply = probe_client.post(
            "/infer/", json={"infer_requests": [_request(probe)], "request_config": CONFIG}
        )
        assert reply.status_code == 400, (probe, reply.text[:500])
