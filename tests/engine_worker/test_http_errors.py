"""The OpenAI error shape on every failure path, over real HTTP: the worker and the
gateway install the same handlers (``engine_worker.http_errors``)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI

from engine_worker.http_errors import ServerErrors, install_error_handlers
from engine_worker.protocol import ChatCompletionRequest, CompletionRequest
from tests.support.servers import serve_app


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(ServerErrors)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict[str, str]:
        if body.prompt == "bug":
            raise KeyError("a bug in a handler")
        return {"ok": "yes"}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest) -> dict[str, str]:
        return {"ok": "yes"}

    with serve_app(app) as url, httpx.Client(base_url=url) as c:
        yield c


def test_a_bug_is_an_openai_500_and_the_connection_serves_on(client: httpx.Client) -> None:
    # Found live: a bug's 500 was plain text, and the client's next request on the same
    # connection was reset (uvicorn closes it after Starlette re-raises).
    r = client.post("/v1/completions", json={"model": "m", "prompt": "bug"})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error"
    assert "KeyError" in err["message"]
    assert client.post("/v1/completions", json={"model": "m", "prompt": "ok"}).json() == {
        "ok": "yes"
    }


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        # Our validator's own message, not pydantic's "not a valid string" for the
        # union's other members.
        ("completions", {"prompt": ["a", "b"]}, "prompt", "only one prompt"),
        ("completions", {"prompt": "x", "stop": ["ok", "\ud800"]}, "stop.1", "surrogate"),
        ("completions", {"prompt": "x", "stop": [1]}, "stop.0", "valid string"),
        # An image part: the text-part member got furthest in, and says what it wants.
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.0.type",
            "'text'",
        ),
    ],
)
def test_a_union_fields_error_names_the_place_and_what_is_wrong(
    client: httpx.Client, path: str, body: dict[str, object], param: str, says: str
) -> None:
    import json

    r = client.post(f"/v1/{path}", content=json.dumps({"model": "m", **body}).encode(),
                    headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param
    assert says in err["message"]
