"""Random request bodies against a real gateway and real tiny workers: every answer is a
200 or an OpenAI-shaped 4xx, and the fleet serves on (no 500, no dead engine, no leak).

Each body is plausible but for at most one field, which may hold anything (the kinds of
value that, found by hand, once killed an engine loop or got a 500: a seed past 64
bits, a temperature of 1e-300, a lone surrogate, NaN): the gateway and the workers must
sort them all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kvrouter.test_gateway_api import COUNTS, counted
from tests.support.cluster import Cluster, run_cluster

MODEL = "tiny"

_junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)  # fmt: skip
_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["\ud800", "x\udfffy", "\x00", "🌍" * 3, "<|im_start|>", ""]),
)


#: Per field, values a client may well send (edge cases included: a temperature too small
#: to divide by, the widest seeds) and, for the corrupted field, anything at all.
_fields: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.sampled_from([0, 0.7, 1.0, 1e-300, 1e-6, 2.0]),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.integers(-1, 100),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.one_of(_text, st.lists(_text, max_size=3)),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2.0),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "7", "300"]), st.floats(-100, 100),
                                  max_size=2),
    "stream": st.booleans(),
    "user": _text,
    "kv_transfer_params": st.just({"do_remote_decode": True}),
}  # fmt: skip


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A plausible body (a random subset of fields with plausible values), of which at
    most one field is then replaced by a value of any type: one fault at a time, so a
    fault is not hidden behind another field's 400."""
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4}
    if chat:
        role = draw(st.sampled_from(["user", "system", "assistant"]))
        body["messages"] = [{"role": role, "content": draw(_text)}]
    else:
        body["prompt"] = draw(st.one_of(_text, st.lists(st.integers(0, 600), max_size=4)))
    for name in draw(st.lists(st.sampled_from(sorted(_fields)), unique=True, max_size=6)):
        body[name] = draw(_fields[name])
    corrupt = draw(st.none() | st.sampled_from(sorted(body)))
    if corrupt is not None:
        body[corrupt] = draw(_junk)
    return ("chat/completions" if chat else "completions"), body


@pytest.fixture(scope="module")
def cluster(redis_server: Any) -> Iterator[Cluster]:
    redis_server.start()
    with run_cluster(redis_server.url, workers=2) as c:
        yield c


@settings(
    max_examples=150, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
@given(request=bodies())
def test_any_body_gets_an_answer_or_an_openai_4xx(
    cluster: Cluster, request: tuple[str, dict[str, Any]]
) -> None:
    path, body = request
    # allow_nan: NaN and Infinity go out as the bare words Python's json writes.
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    r = httpx.post(f"{cluster.gateway}/v1/{path}", content=raw,
                   headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert r.status_code in (200, 400, 404), (r.status_code, r.text, body)
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["message"]
        assert err["type"]
    for url in cluster.workers.values():
        assert httpx.get(f"{url}/health").status_code == 200  # no engine died


def test_after_the_fuzz_the_gateway_holds_nothing(cluster: Cluster) -> None:
    # Runs after the fuzz (file order): every request it let through has ended.
    import time

    deadline = time.monotonic() + 15
    while True:
        text = httpx.get(f"{cluster.gateway}/metrics").text
        counts = {c: counted(text, c) for c in COUNTS}
        if not any(v for c in counts.values() for v in c.values()):
            break
        assert time.monotonic() < deadline, counts
        time.sleep(0.1)
