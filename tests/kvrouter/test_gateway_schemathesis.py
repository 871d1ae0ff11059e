"""Property-based fuzzing of the gateway's OpenAPI: no input produces a 5xx.

Each operation of ``/openapi.json`` gets its own hypothesis run of
schemathesis-generated cases (valid and invalid), sent over real HTTP to a
gateway in front of two ``sim`` workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from tests.support.cluster import Cluster, run_cluster


@pytest.fixture(scope="module")
def fuzz_cluster(redis_server: Any) -> Iterator[Cluster]:
    redis_server.start()
    # sim workers with time_scale 0 answer at once, so hundreds of cases stay fast.
    with run_cluster(redis_server.url, workers=2, worker={"runner": "sim", "time_scale": 0.0}) as c:
        yield c


def served_model(case: Any) -> Any:
    """Point a generated body at the served model, so cases get past the model check."""
    if isinstance(case.body, dict):
        case.body["model"] = "tiny"
    return case


def servable(case_and_model: tuple[Any, str]) -> Any:
    """Keep the generated optional fields but give the request a prompt the gateway can
    serve and a model that is served or not, so that a good share of the cases reach
    routing and are accepted or refused there (generated prompts are mostly refused
    before: several prompts, ids beyond the vocabulary...)."""
    case, model = case_and_model
    if isinstance(case.body, dict):
        case.body["model"] = model
        if case.path.endswith("/chat/completions"):
            case.body["messages"] = [{"role": "user", "content": "Hello there"}]
        else:
            case.body["prompt"] = "Hello there"
        case.body["n"] = 1
        case.body["max_tokens"] = 4
    return case


def test_no_generated_input_makes_the_gateway_fail(fuzz_cluster: Cluster) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_cluster.gateway}/openapi.json")
    labels = []
    for result in schema.get_all_operations():
        operation: Any = result.ok()  # type: ignore[union-attr]
        labels.append(operation.label)
        # Operations without parameters or body have no invalid input to generate.
        has_input = operation.label.startswith("POST ")
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if has_input else [])
        for mode in modes:
            cases = operation.as_strategy(generation_mode=mode)

            models = st.sampled_from(["tiny", "not-served"])
            near_valid = st.tuples(cases, models).map(servable)

            @given(case=st.one_of(cases, cases.map(served_model), near_valid))
            @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
            def check(case: Any) -> None:
                response = case.call(base_url=fuzz_cluster.gateway, timeout=60)
                case.validate_response(response, checks=[not_a_server_error])

            check()
    assert "POST /v1/chat/completions" in labels
    assert "POST /v1/completions" in labels
    # The fuzzing reached the routing path with both accepted and refused requests.
    metrics = httpx.get(f"{fuzz_cluster.gateway}/metrics").text
    for endpoint in ("chat", "completions"):
        assert f'endpoint="{endpoint}",policy="kv_ttft",status="200"' in metrics
        assert f'endpoint="{endpoint}",policy="kv_ttft",status="4' in metrics
