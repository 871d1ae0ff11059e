"""The real model through the whole stack answers sensibly (slow: loads SmolLM2)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from engine_worker.server import create_app as create_worker_app
from kvrouter.embedded_redis import free_port
from kvrouter.gateway.app import create_app as create_gateway_app
from kvrouter.gateway.settings import RouterSettings
from tests.support.cluster import run_ingester, worker_settings
from tests.support.servers import serve_app, wait_http

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def gateway(redis_server: Any) -> Iterator[str]:
    redis_server.start()
    wport, gport = free_port(), free_port()
    settings = worker_settings("smol", wport, redis_server.url, model="smollm2", max_model_len=2048)
    with (
        run_ingester(redis_server.url),
        serve_app(create_worker_app(settings), port=wport),
        serve_app(
            create_gateway_app(
                RouterSettings(port=gport, models=["smollm2"], redis_url=redis_server.url)
            ),
            port=gport,
        ) as url,
    ):
        wait_http(f"{url}/ready", timeout=60)
        yield url


def test_smollm2_answers_a_factual_question(gateway: str) -> None:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    answer = chat.choices[0].message.content or ""
    assert "Paris" in answer, answer
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        if c.choices
    )
    assert streamed == answer
    again = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=4,
        temperature=0,
    )
    assert again.usage is not None
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens
