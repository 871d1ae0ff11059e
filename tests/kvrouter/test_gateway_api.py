"""The gateway's OpenAI API with the official client, its errors, headers and accounting."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.cluster import Cluster, run_cluster
from tests.support.servers import tcp_listener

MODEL = "tiny"


@pytest.fixture(scope="module")
def cluster(redis_server: Any) -> Iterator[Cluster]:
    redis_server.start()
    with run_cluster(
        redis_server.url,
        workers=2,
        gateway={
            "api_keys": ["sk-test"],
            "max_request_bytes": 64 * 1024,
            "max_prompt_tokens": 1000,
        },
    ) as c:
        yield c


@pytest.fixture
def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.gateway}/v1", api_key="sk-test", max_retries=0)


#: The gateway's own per-worker counts, which must all return to 0 when it is idle.
COUNTS = ("in_flight", "held_blocks", "queued_prefill_tokens")


def counted(text: str, count: str) -> dict[str, float]:
    """``kvrouter_worker_<count>`` per worker in a metrics scrape."""
    prefix = f'kvrouter_worker_{count}{{worker="'
    return {
        ln[len(prefix) :].split('"', 1)[0]: float(ln.rsplit(" ", 1)[1])
        for ln in text.splitlines()
        if ln.startswith(prefix)
    }


def wait_unloaded(cluster: Cluster, timeout: float = 15.0) -> str:
    """Poll the gateway's per-worker counts until every one reads 0; returns the metrics text."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{cluster.gateway}/metrics").text
        counts = {c: counted(text, c) for c in COUNTS}
        if not any(v for c in counts.values() for v in c.values()):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"the gateway's counts did not return to 0: {counts}")
        time.sleep(0.05)


def test_chat_and_completions_through_the_openai_client(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 5
    comp = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, temperature=0)
    assert comp.choices[0].text
    assert comp.choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == [MODEL]
    # models.retrieve() (GET /v1/models/{id}) was a bare 404 from the router.
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/no-such-model")
    assert missing.value.code == "model_not_found"


def test_streaming_through_the_openai_client(client: openai.OpenAI) -> None:
    req: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    messages: list[Any] = [{"role": "user", "content": "Count to three"}]
    whole = client.chat.completions.create(messages=messages, **req)
    parts = []
    for chunk in client.chat.completions.create(messages=messages, stream=True, **req):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
    assert "".join(parts) == whole.choices[0].message.content
    comp_parts: list[str] = []
    stream = client.completions.create(
        prompt="abc", stream=True, stream_options={"include_usage": True}, **req
    )
    usage = None
    for chunk in stream:
        comp_parts.extend(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(comp_parts)
    assert usage is not None
    assert usage.completion_tokens == 6


def test_usage_chunk_is_not_sent_unless_asked(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}
    with httpx.stream(
        "POST", f"{cluster.gateway}/v1/completions", json=body,
        headers={"authorization": "Bearer sk-test"}, timeout=60,
    ) as r:  # fmt: skip
        text = "".join(r.iter_text())
    assert '"usage"' not in text
    assert text.rstrip().endswith("data: [DONE]")


def test_request_id_is_echoed_and_the_decision_is_explained_on_request(cluster: Cluster) -> None:
    r = httpx.post(
        f"{cluster.gateway}/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 2},
        headers={
            "authorization": "Bearer sk-test",
            "x-request-id": "my-id-42",
            "x-kvrouter-debug": "1",
        },
        timeout=60,
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "my-id-42"
    decision = json.loads(r.headers["x-kvrouter-decision"])
    assert decision["worker"] == r.headers["x-kvrouter-worker"] in cluster.workers
    assert decision["policy"] == "kv_ttft"
    assert set(decision["scores"]) == set(cluster.workers)
    for terms in decision["scores"].values():
        assert {"wait_s", "load_s", "prefill_s", "total"} <= set(terms)
    assert set(decision["timings_s"]) == {"tokenize", "hash", "lookup", "score"}
    plain = httpx.post(
        f"{cluster.gateway}/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 2},
        headers={"authorization": "Bearer sk-test"},
        timeout=60,
    )
    assert "x-kvrouter-decision" not in plain.headers
    assert plain.headers["x-request-id"].startswith("req-")


@pytest.mark.parametrize(
    ("kwargs", "status", "code"),
    [
        (
            {
                "content": b'{"model": "tiny", "prompt": ',
                "headers": {"content-type": "application/json"},
            },
            400,
            None,
        ),
        ({"json": {"model": "nope", "prompt": "x"}}, 404, "model_not_found"),
        ({"json": {"model": MODEL, "prompt": "x" * (70 * 1024)}}, 413, "body_too_large"),
        ({"json": {"model": MODEL, "prompt": "word " * 1500}}, 400, "prompt_too_long"),
        ({"json": {"model": MODEL, "prompt": "x", "temperature": 9}}, 400, None),
        (
            {"json": {"model": MODEL, "prompt": "x", "max_tokens": 100000}},
            400,
            "context_length_exceeded",
        ),
        # Found live, each a 500 from the gateway: a lone surrogate (the tokenizer's
        # TypeError), a body nested past the JSON parser's recursion, and a seed past 64
        # bits (which killed the worker's engine loop).
        (
            {
                "content": json.dumps({"model": MODEL, "prompt": "x \ud800"}).encode(),
                "headers": {"content-type": "application/json"},
            },
            400,
            None,
        ),
        (
            {
                "content": b'{"model": "tiny", "prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",
                "headers": {"content-type": "application/json"},
            },
            400,
            None,
        ),
        ({"json": {"model": MODEL, "prompt": "x", "seed": 2**64, "temperature": 1}}, 400, None),
    ],
)
def test_bad_input_gets_openai_errors(
    cluster: Cluster, kwargs: dict[str, Any], status: int, code: str | None
) -> None:
    headers = {"authorization": "Bearer sk-test", **kwargs.pop("headers", {})}
    r = httpx.post(f"{cluster.gateway}/v1/completions", headers=headers, timeout=60, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"]
    assert err["type"]
    if code:
        assert err["code"] == code
    wait_unloaded(cluster)


def _ask(cluster: Cluster, path: str, extra: dict[str, Any]) -> httpx.Response:
    """A two-token request ``hi`` to ``/v1/{path}`` with the fields ``extra``."""
    prompt = (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    )
    body = {"model": MODEL, **prompt, "max_tokens": 2, **extra}
    headers = {"authorization": "Bearer sk-test"}
    return httpx.post(f"{cluster.gateway}/v1/{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("path", "extra", "status"),
    [
        ("completions", {"logprobs": 2}, 400),
        ("completions", {"logprobs": 0}, 400),
        ("completions", {"logprobs": None}, 200),
        ("chat/completions", {"logprobs": True}, 400),
        ("chat/completions", {"top_logprobs": 3}, 400),
        ("chat/completions", {"logprobs": False, "top_logprobs": None}, 200),
    ],
)
def test_asking_for_logprobs_is_refused_not_answered_with_none(
    cluster: Cluster, path: str, extra: dict[str, Any], status: int
) -> None:
    # The workers compute no log probabilities: a client that asks must hear so, not
    # find "logprobs": null where it expected them.
    r = _ask(cluster, path, extra)
    assert r.status_code == status, r.text
    if status == 400:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["param"] in extra
        assert "log probabilities are not supported" in err["message"]
    wait_unloaded(cluster)


_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("chat/completions", {"tools": [_TOOL]}, "tools"),
        ("chat/completions", {"tools": [_TOOL], "tool_choice": "auto"}, "tools"),
        ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
        (
            "chat/completions",
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "tool_choice",
        ),
        ("chat/completions", {"functions": [_TOOL["function"]]}, "functions"),
        ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        (
            "chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        ("chat/completions", {"guided_choice": ["yes", "no"]}, "guided_choice"),
        ("completions", {"guided_json": {"type": "object"}}, "guided_json"),
        ("completions", {"guided_regex": "[0-9]+"}, "guided_regex"),
        ("completions", {"suffix": " the end"}, "suffix"),
        ("completions", {"best_of": 3}, "best_of"),
        # Accepted: what asks for nothing the workers do not do.
        ("chat/completions", {"tools": [_TOOL], "tool_choice": "none"}, None),
        ("chat/completions", {"tools": [], "tool_choice": "auto"}, None),
        ("chat/completions", {"response_format": {"type": "text"}}, None),
        ("chat/completions", {"parallel_tool_calls": False, "guided_json": None}, None),
        ("completions", {"suffix": "", "best_of": 1}, None),
    ],
)
def test_asking_for_structured_output_is_refused_not_answered_with_free_text(
    cluster: Cluster, path: str, extra: dict[str, Any], param: str | None
) -> None:
    # A client that asks for a tool call or JSON and gets free text back may take it
    # for what it asked for (or fail parsing it far from the cause); it must hear that
    # the workers do not do it, with the field named, and nothing must be routed.
    r = _ask(cluster, path, extra)
    if param is None:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["param"] == param
        assert "not supported" in err["message"] or "must be 1" in err["message"]
    wait_unloaded(cluster)


@pytest.mark.parametrize(
    ("content_type", "body", "status"),
    [
        (None, {"model": MODEL, "prompt": "hello", "max_tokens": 2}, 200),
        ("application/json; charset=utf-8", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, 200),
        ("application/vnd.api+json", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, 200),
        # Not JSON by its content type: FastAPI does not parse it, and neither do we.
        ("text/plain", {"model": MODEL, "prompt": "hello", "max_tokens": 2}, 400),
        ("application/json", [{"model": MODEL, "prompt": "hello"}], 400),
        ("application/json", {"model": MODEL}, 400),
    ],
)
def test_generation_routes_read_bodies_as_fastapi_does(
    cluster: Cluster, content_type: str | None, body: Any, status: int
) -> None:
    """The direct path for valid bodies and FastAPI's routes agree on what a body is."""
    headers = {"authorization": "Bearer sk-test"}
    if content_type:
        headers["content-type"] = content_type
    r = httpx.post(f"{cluster.gateway}/v1/completions", content=json.dumps(body).encode(),
                   headers=headers, timeout=60)  # fmt: skip
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json()["choices"][0]["text"]
    else:
        assert r.json()["error"]["type"] == "invalid_request_error"
    wait_unloaded(cluster)


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "sk-test"])
def test_bad_or_missing_api_key_is_refused(cluster: Cluster, auth: str | None) -> None:
    headers = {"authorization": auth} if auth else {}
    r = httpx.post(
        f"{cluster.gateway}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers
    )
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{cluster.gateway}/v1/models").status_code == 401
    assert httpx.get(f"{cluster.gateway}/health").status_code == 200


def test_no_counter_leaks_after_success_errors_and_disconnects(cluster: Cluster) -> None:
    auth = {"authorization": "Bearer sk-test"}
    body = {"model": MODEL, "prompt": "leak check " * 10, "max_tokens": 400, "stream": True}
    for _ in range(3):
        with httpx.stream(
            "POST", f"{cluster.gateway}/v1/completions", json=body, headers=auth, timeout=60
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            # Mid-stream the worker holds the prompt's blocks, and the gateway counts them.
            worker = r.headers["x-kvrouter-worker"]
            held = counted(httpx.get(f"{cluster.gateway}/metrics").text, "held_blocks")
            assert held[worker] > 0
    httpx.post(
        f"{cluster.gateway}/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 99999},
        headers=auth,
    )
    httpx.post(
        f"{cluster.gateway}/v1/completions",
        json={"model": MODEL, "prompt": "ok", "max_tokens": 2},
        headers=auth,
    )
    text = wait_unloaded(cluster)
    assert "kvrouter_requests_total" in text
    for name in cluster.workers:
        deadline = time.monotonic() + 15
        while cluster.worker_stats(name)["in_use_blocks"]:
            assert time.monotonic() < deadline, "worker kept blocks of a disconnected request"
            time.sleep(0.05)


def test_metrics_cover_decisions_ttft_and_health(cluster: Cluster, client: openai.OpenAI) -> None:
    list(client.completions.create(model=MODEL, prompt="m", max_tokens=2, stream=True))
    text = httpx.get(f"{cluster.gateway}/metrics").text
    for name in (
        'kvrouter_decision_seconds_bucket{le="0.001",stage="lookup"}',
        "kvrouter_time_to_first_token_seconds_count",
        "kvrouter_predicted_ttft_seconds_count",
        "kvrouter_ttft_prediction_ratio_count",
        'kvrouter_worker_up{worker="w0"} 1.0',
        "kvrouter_cache_aware_routing 1.0",
        'kvrouter_requests_total{endpoint="completions",policy="kv_ttft",status="200"}',
    ):
        assert name in text, name


def _prompt_ids_counts(cluster: Cluster) -> dict[str, float]:
    out: dict[str, float] = {}
    for url in cluster.workers.values():
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            if line.startswith("kvworker_prompt_ids_total{"):
                source = line.split('"')[1]
                out[source] = out.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_workers_get_the_prompt_tokenized_and_answer_as_if_they_had_tokenized_it(
    cluster: Cluster, client: openai.OpenAI
) -> None:
    """The gateway tokenized the prompt to route it; the worker uses those ids instead of
    tokenizing again, with the same answer, and never ids a client put in the body."""
    worker = next(iter(cluster.workers.values()))
    req: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    prompt, messages = "Once upon a time", [{"role": "user", "content": "Name a colour"}]
    direct = httpx.post(f"{worker}/v1/completions", json={**req, "prompt": prompt}).json()
    direct_chat = httpx.post(
        f"{worker}/v1/chat/completions", json={**req, "messages": messages}
    ).json()
    before = _prompt_ids_counts(cluster)
    comp = client.completions.create(prompt=prompt, **req)
    chat = client.chat.completions.create(messages=messages, **req)  # type: ignore[arg-type]
    assert comp.choices[0].text == direct["choices"][0]["text"]
    assert chat.choices[0].message.content == direct_chat["choices"][0]["message"]["content"]
    # A client's own tokenized_prompt (the right fingerprint, other ids) is dropped.
    from engine_worker.tokenizer import load_tokenizer

    tok = load_tokenizer(MODEL)
    forged = {"tokenizer": tok.fingerprint, "ids": tok.encode("The capital of France is")}
    again = client.completions.create(prompt=prompt, extra_body={"tokenized_prompt": forged}, **req)
    assert again.choices[0].text == direct["choices"][0]["text"]
    assert again.usage is not None
    assert again.usage.prompt_tokens == len(tok.encode(prompt))
    after = _prompt_ids_counts(cluster)
    assert after.get("sent", 0) - before.get("sent", 0) == 3
    assert after.get("tokenized", 0) == before.get("tokenized", 0)
    wait_unloaded(cluster)


def test_a_clients_kv_transfer_params_never_reach_a_worker(cluster: Cluster) -> None:
    # Found by fuzzing `make run`: the gateway passed a client's kv_transfer_params on,
    # and the worker pulled the prompt's blocks from the remote_host the client named,
    # sending the fleet's internal token there. PD and pooling are the gateway's to plan.
    seen: list[bytes] = []
    headers = {"authorization": "Bearer sk-test"}
    with tcp_listener(lambda conn: seen.append(conn.recv(4096))) as port:
        pull = {
            "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
            "remote_block_ids": [1, 2, 3], "remote_engine_id": "x", "remote_request_id": "y",
        }  # fmt: skip
        for params in (pull, {"do_remote_decode": True}):
            body = {"model": MODEL, "prompt": "a client posing as a router", "max_tokens": 3,
                    "temperature": 0, "kv_transfer_params": params}  # fmt: skip
            r = httpx.post(f"{cluster.gateway}/v1/completions", json=body, headers=headers,
                           timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
            answer = r.json()
            # A whole answer, not a prefill hand-off (which would also hold a lease).
            assert answer["usage"]["completion_tokens"] == 3
            assert "kv_transfer_params" not in answer
        time.sleep(0.3)
    assert seen == []
    wait_unloaded(cluster)
