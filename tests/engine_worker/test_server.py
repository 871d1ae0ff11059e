"""The worker's OpenAI server over real HTTP with the tiny model (torch runner)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine_worker.protocol import FIRST_TOKEN_HEADER, MARK_FIRST_TOKEN_HEADER
from engine_worker.server import create_app
from engine_worker.settings import WorkerSettings
from tests.support.servers import serve_app

MODEL = "tiny"


@pytest.fixture(scope="module")
def worker_url() -> Iterator[str]:
    settings = WorkerSettings(
        model="tiny", runner="torch", hbm_blocks=256, dram_blocks=64, max_model_len=1024,
        max_num_seqs=8, max_num_batched_tokens=256, max_request_bytes=64 * 1024,
    )  # fmt: skip
    with serve_app(create_app(settings)) as url:
        yield url


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def stream_text(url: str, path: str, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunks.append(json.loads(data))
    text = ""
    for c in chunks:
        for ch in c["choices"]:
            text += ch.get("text") or ch.get("delta", {}).get("content") or ""
    return text, chunks


def stats(url: str) -> dict[str, Any]:
    result: dict[str, Any] = httpx.get(f"{url}/kv/stats", timeout=30).json()
    return result


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(url)
        if (s["running"], s["waiting"], s["in_use_blocks"]) == (0, 0, 0):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"worker not idle: {s}")
        time.sleep(0.05)


def test_models_and_health(worker_url: str) -> None:
    models = httpx.get(f"{worker_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{worker_url}/health").json()["status"] == "ok"


def test_completion_counts_tokens_and_stops_at_max_tokens(worker_url: str) -> None:
    r = post(
        worker_url,
        "/v1/completions",
        {"model": MODEL, "prompt": "Hello", "max_tokens": 7, "temperature": 0},
    )
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 7
    assert body["usage"]["prompt_tokens"] >= 1
    assert body["choices"][0]["text"]


def test_streamed_text_equals_the_non_streamed_text(worker_url: str) -> None:
    req = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    whole = post(worker_url, "/v1/chat/completions", req).json()
    text, chunks = stream_text(worker_url, "/v1/chat/completions", req)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


MARK = {MARK_FIRST_TOKEN_HEADER: "1"}


@pytest.mark.parametrize(
    ("path", "req"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}]}),
        ("/v1/completions", {"prompt": "Once upon a time", "stop": [" the"]}),
    ],
)
def test_a_marked_answer_opens_with_a_space_and_is_the_plain_answer(
    worker_url: str, path: str, req: dict[str, Any]
) -> None:
    """A router that asks for the first token to be marked gets a space first, then the
    same answer a plain request gets (leading whitespace is valid JSON)."""
    req = {"model": MODEL, "max_tokens": 12, "temperature": 0, **req}
    plain = post(worker_url, path, req)
    with httpx.stream("POST", f"{worker_url}{path}", json=req, headers=MARK, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers[FIRST_TOKEN_HEADER] == "marked"
        assert r.headers["content-type"] == "application/json"
        raw = r.read()
    assert raw.startswith(b" {")
    marked, unmarked = json.loads(raw), plain.json()
    assert FIRST_TOKEN_HEADER not in plain.headers
    for body in (marked, unmarked):
        del body["id"], body["created"]
    assert marked == unmarked
    wait_idle(worker_url)


def test_a_marked_request_that_fails_before_its_first_token_keeps_its_status(
    worker_url: str,
) -> None:
    req = {"model": MODEL, "prompt": "word " * 2000, "max_tokens": 4}
    r = httpx.post(f"{worker_url}/v1/completions", json=req, headers=MARK, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert FIRST_TOKEN_HEADER not in r.headers


def test_a_repeated_prompt_reports_cached_tokens_on_hbm(worker_url: str) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    req = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = post(worker_url, "/v1/completions", req).json()["usage"]
    second = post(worker_url, "/v1/completions", req).json()["usage"]
    n = second["prompt_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached == (n - 1) // 16 * 16  # every full block but the one holding the last token
    assert second["cached_tokens_by_medium"] == {"hbm": cached, "dram": 0, "ssd": 0}


def test_stream_usage_chunk_when_asked(worker_url: str) -> None:
    req = {
        "model": MODEL,
        "prompt": "abc",
        "max_tokens": 3,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    _, chunks = stream_text(worker_url, "/v1/completions", req)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_stop_string_cuts_the_text_before_it(worker_url: str) -> None:
    req: dict[str, Any] = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 24,
        "temperature": 0,
    }
    full = post(worker_url, "/v1/completions", req).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop
    cut = post(worker_url, "/v1/completions", {**req, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full[: full.index(stop)]
    streamed, _ = stream_text(worker_url, "/v1/completions", {**req, "stop": stop})
    assert streamed == cut["text"]
    wait_idle(worker_url)


def test_seeded_sampling_is_reproducible(worker_url: str) -> None:
    req = {"model": MODEL, "prompt": "x y z", "max_tokens": 10, "temperature": 1.0, "seed": 7}
    a = post(worker_url, "/v1/completions", req).json()["choices"][0]["text"]
    b = post(worker_url, "/v1/completions", req).json()["choices"][0]["text"]
    assert a == b


def test_eight_concurrent_streams_equal_their_solo_runs(worker_url: str) -> None:
    reqs = [
        {
            "model": MODEL,
            "prompt": f"Request {i}: " + "lorem ipsum " * (3 * i + 1),
            "max_tokens": 6 + 3 * i,
            "temperature": 0,
        }
        for i in range(8)
    ]
    alone = [stream_text(worker_url, "/v1/completions", r)[0] for r in reqs]

    async def all_at_once() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(r: dict[str, Any]) -> str:
                text = ""
                async with client.stream(
                    "POST", f"{worker_url}/v1/completions", json={**r, "stream": True}
                ) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            for ch in json.loads(line[6:])["choices"]:
                                text += ch["text"]
                return text

            return list(await asyncio.gather(*(one(r) for r in reqs)))

    together = asyncio.run(all_at_once())
    assert together == alone
    wait_idle(worker_url)


def test_client_disconnect_mid_stream_frees_its_blocks(worker_url: str) -> None:
    wait_idle(worker_url)
    body = {
        "model": MODEL,
        "prompt": "a b c d e f g " * 20,
        "max_tokens": 800,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{worker_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ")
            next(lines)  # the blank line after each event
        # Still connected and mid-generation: the request holds KV blocks.
        assert stats(worker_url)["in_use_blocks"] > 0
    # Leaving the block closed the connection: the worker must abort and free everything.
    s = wait_idle(worker_url)
    assert s["in_use_blocks"] == 0


@pytest.mark.parametrize("marked", [False, True])
def test_a_client_that_leaves_a_queued_request_ends_it_quietly(
    marked: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # Found in `make run`'s logs under a burst: every non-streaming request whose client
    # left while it queued logged an ERROR with a traceback ("Exception in ASGI
    # application": CancelledError("client disconnected")), which error-rate alerts count.
    settings = WorkerSettings(model="tiny", runner="torch", hbm_blocks=256, max_model_len=1024,
                              max_num_seqs=1, max_num_batched_tokens=256)  # fmt: skip
    server_log = logging.getLogger("uvicorn.error")  # uvicorn's loggers do not propagate
    with serve_app(create_app(settings)) as url, caplog.at_level(logging.INFO):
        server_log.addHandler(caplog.handler)  # after uvicorn's start, which resets them
        try:
            long = {"model": MODEL, "prompt": "busy", "max_tokens": 900, "ignore_eos": True,
                    "stream": True}  # fmt: skip
            with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as busy:
                lines = busy.iter_lines()  # kept: a dropped iterator closes the stream
                assert next(lines).startswith("data: ")  # it runs, in the one sequence slot
                body = {"model": MODEL, "prompt": "queued", "max_tokens": 4}
                headers = {MARK_FIRST_TOKEN_HEADER: "1"} if marked else {}
                left: list[BaseException] = []

                def leave() -> None:
                    try:
                        httpx.post(f"{url}/v1/completions", json=body, headers=headers,
                                   timeout=1.0)  # fmt: skip
                    except httpx.ReadTimeout as exc:
                        left.append(exc)

                client = threading.Thread(target=leave)
                client.start()
                deadline = time.monotonic() + 5
                while stats(url)["waiting"] != 1:  # queued behind the busy stream
                    assert time.monotonic() < deadline, "the request never queued"
                    time.sleep(0.02)
                client.join(10)
                assert left, "the client should have given up waiting"
                while stats(url)["waiting"] != 0:  # aborted while it queued
                    assert time.monotonic() < deadline + 5, "the request was not aborted"
                    time.sleep(0.02)
            wait_idle(url)
        finally:
            server_log.removeHandler(caplog.handler)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


def test_metrics_are_exported(worker_url: str) -> None:
    post(worker_url, "/v1/completions", {"model": MODEL, "prompt": "metrics", "max_tokens": 2})
    text = httpx.get(f"{worker_url}/metrics").text
    for name in (
        "kvworker_time_to_first_token_seconds_bucket",
        "kvworker_time_per_output_token_seconds_bucket",
        "kvworker_num_requests_running",
        'kvworker_kv_usage_ratio{medium="hbm"}',
        "kvworker_prefix_hit_tokens_total",
        "kvworker_kv_block_moves",
    ):
        assert name in text, name


def test_finished_and_refused_requests_are_counted(worker_url: str) -> None:
    def sample(name: str, labels: str) -> float:
        text = httpx.get(f"{worker_url}/metrics").text
        found = re.search(rf"^kvworker_{name}_total\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    done = 'endpoint="completions",reason="length"'
    before_done, before_bad = sample("requests", done), sample("request_errors", 'status="400"')
    post(worker_url, "/v1/completions", {"model": MODEL, "prompt": "count me", "max_tokens": 2})
    post(worker_url, "/v1/completions", {"model": MODEL, "prompt": ""})
    assert sample("requests", done) == before_done + 1
    assert sample("request_errors", 'status="400"') == before_bad + 1


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "prompt": "hi"}, 404, "model"),
        ({"model": MODEL, "prompt": "hi " * 1100}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "prompt"),
        ({"model": MODEL}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(
    worker_url: str, body: dict[str, Any], status: int, param: str
) -> None:
    r = post(worker_url, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"]
    assert err["type"]
    assert param in (err["param"] or "") or param in err["message"]


def test_malformed_json_and_oversized_bodies(worker_url: str) -> None:
    r = httpx.post(
        f"{worker_url}/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"]
    big = {"model": MODEL, "prompt": "x" * (70 * 1024)}
    r = post(worker_url, "/v1/completions", big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "body_too_large"
    bad_chat = post(
        worker_url,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
    )
    assert bad_chat.status_code == 400
    wait_idle(worker_url)


def _prompt_ids_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.findall(r'^kvworker_prompt_ids_total\{source="(\w+)"\} (\S+)$', text, re.M)
    return {source: float(n) for source, n in found}


def test_a_prompt_sent_tokenized_is_computed_from_the_sent_ids(worker_url: str) -> None:
    """The gateway's ``tokenized_prompt`` replaces the worker's own tokenizing when the
    tokenizers match; the answer then follows those ids, not the text beside them."""
    from engine_worker.tokenizer import load_tokenizer

    tok = load_tokenizer(MODEL)
    other = "The capital of France is"
    base = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    want = post(worker_url, "/v1/completions", {**base, "prompt": other}).json()
    before = _prompt_ids_counts(worker_url)
    sent = {"tokenizer": tok.fingerprint, "ids": tok.encode(other)}
    got = post(worker_url, "/v1/completions", {**base, "prompt": "Hello", "tokenized_prompt": sent})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert got.json()["usage"]["prompt_tokens"] == len(sent["ids"])
    # The chat route renders nothing either: the ids stand for the rendered chat.
    chat = post(worker_url, "/v1/chat/completions", {
        **base, "messages": [{"role": "user", "content": "Hi"}], "tokenized_prompt": sent,
    })  # fmt: skip
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == want["choices"][0]["text"]
    after = _prompt_ids_counts(worker_url)
    assert after.get("sent", 0) - before.get("sent", 0) == 2
    wait_idle(worker_url)


def test_ids_from_another_tokenizer_are_ignored(worker_url: str) -> None:
    from engine_worker.tokenizer import load_tokenizer

    tok = load_tokenizer(MODEL)
    base = {"model": MODEL, "max_tokens": 6, "temperature": 0, "prompt": "Hello"}
    want = post(worker_url, "/v1/completions", base).json()
    before = _prompt_ids_counts(worker_url)
    sent = {"tokenizer": "0" * 16, "ids": tok.encode("The capital of France is")}
    got = post(worker_url, "/v1/completions", {**base, "tokenized_prompt": sent})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]
    assert got.json()["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    after = _prompt_ids_counts(worker_url)
    assert after.get("ignored", 0) - before.get("ignored", 0) == 1
    assert after.get("sent", 0) == before.get("sent", 0)
    wait_idle(worker_url)


@pytest.mark.parametrize(
    "ids", [[1, 2, 10**9], [-1, 5], []], ids=["past the vocabulary", "negative", "empty"]
)
def test_bad_sent_ids_get_a_400(worker_url: str, ids: list[int]) -> None:
    from engine_worker.tokenizer import load_tokenizer

    body = {
        "model": MODEL, "prompt": "Hello", "max_tokens": 2,
        "tokenized_prompt": {"tokenizer": load_tokenizer(MODEL).fingerprint, "ids": ids},
    }  # fmt: skip
    r = post(worker_url, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert "tokenized_prompt" in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]
    wait_idle(worker_url)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi \ud800", "max_tokens": 2}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "\udfff"}], "max_tokens": 2},
            "messages.0.content",
        ),
        ("/v1/completions", {"prompt": "hi", "stop": ["ok", "\ud83c"]}, "stop.1"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**70, "temperature": 1.0}, "seed"),
        ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1, "temperature": 1.0}, "seed"),
    ],
)
def test_input_that_broke_the_engine_or_tokenizer_is_a_400_and_the_worker_serves_on(
    worker_url: str, path: str, body: dict[str, Any], param: str
) -> None:
    # Found live: seed 2**70 killed the engine loop (torch's manual_seed overflowed) and a
    # lone surrogate (JSON's "\ud800" escape) was a 500 from the tokenizer.
    r = httpx.post(
        f"{worker_url}{path}", content=json.dumps({"model": MODEL, **body}).encode(),
        headers={"content-type": "application/json"}, timeout=60,
    )  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param)
    # A temperature too small to divide by (found live too: NaN probabilities, the engine
    # loop dead) samples greedily, on an engine that still serves.
    prompt = {"model": MODEL, "prompt": "the worker serves on", "max_tokens": 5}
    greedy = post(worker_url, "/v1/completions", {**prompt, "temperature": 0})
    tiny = post(worker_url, "/v1/completions", {**prompt, "temperature": 1e-300})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert httpx.get(f"{worker_url}/health").status_code == 200
    wait_idle(worker_url)


def test_penalties_and_logit_bias_change_what_the_model_generates(worker_url: str) -> None:
    # They were accepted and silently ignored: a client asking the tiny model (which
    # repeats itself) for less repetition got the same text.
    from engine_worker.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(MODEL)
    base = {"model": MODEL, "prompt": "the the the", "max_tokens": 12, "temperature": 0}

    def ids(extra: dict[str, Any]) -> list[int]:
        r = post(worker_url, "/v1/completions", {**base, **extra})
        assert r.status_code == 200, r.text
        text: str = r.json()["choices"][0]["text"]
        # As the text reads back (not always the ids generated): enough to count repeats.
        return list(tokenizer.encode(text, add_special_tokens=False))

    plain = ids({})
    assert max(Counter(plain).values()) > 3  # it repeats a token
    penalized = ids({"presence_penalty": 2.0, "frequency_penalty": 2.0})
    assert max(Counter(penalized).values()) < max(Counter(plain).values())
    assert ids({"repetition_penalty": 1.0}) == plain  # 1.0 is no penalty
    forced = ids({"logit_bias": {str(plain[0]): -100}})
    assert plain[0] not in forced[:1]
    wait_idle(worker_url)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ],
)
def test_bad_penalties_get_a_400(worker_url: str, extra: dict[str, Any], param: str) -> None:
    r = post(worker_url, "/v1/completions", {"model": MODEL, "prompt": "hi", **extra})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"] or "").startswith(param)


def test_a_finished_requests_sampler_state_is_dropped() -> None:
    # TorchRunner.forget existed but nothing called it: every seeded request left a
    # torch.Generator behind for the life of the worker.
    settings = WorkerSettings(model="tiny", runner="torch", hbm_blocks=256, max_model_len=1024)
    app = create_app(settings)
    with serve_app(app) as url:
        sampler = app.state.worker.engine.runner.sampler
        for i in range(6):
            body = {"model": MODEL, "prompt": f"seeded {i}", "max_tokens": 3,
                    "temperature": 1.0, "seed": i, "repetition_penalty": 1.2}  # fmt: skip
            assert post(url, "/v1/completions", body).status_code == 200
        with httpx.stream(
            "POST", f"{url}/v1/completions", timeout=60,
            json={"model": MODEL, "prompt": "left", "max_tokens": 500, "ignore_eos": True,
                  "seed": 7, "stream": True},
        ) as r:  # fmt: skip
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # then the client leaves: an abort
        wait_idle(url)
        assert sampler._seeded == {}
        assert sampler._prompts == {}


def test_render_returns_the_prompts_ids_and_every_sampling_parameter(worker_url: str) -> None:
    # vLLM's GenerateRequest shape, which vllm-router's kv_aware policy asks for.
    body = {"model": MODEL, "prompt": "render me", "max_tokens": 3, "temperature": 0.5,
            "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.1, "logit_bias": {"5": -1.0}, "seed": 3}  # fmt: skip
    r = post(worker_url, "/v1/completions/render", body)
    assert r.status_code == 200, r.text
    (out,) = r.json()  # completions: a list, one per prompt, as vLLM answers
    from engine_worker.tokenizer import load_tokenizer

    assert out["token_ids"] == load_tokenizer(MODEL).encode("render me")
    sp = out["sampling_params"]
    for name in ("max_tokens", "temperature", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "seed"):  # fmt: skip
        assert sp[name] == body[name], name
