"""The OpenAI error shape on every failure path, over real HTTP: the worker and the
gateway install the same handlers (``engine_worker.http_errors``)."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from engine_worker.http_errors import ServerErrors, install_error_handlers
from engine_worker.protocol import CompletionRequest
from tests.support.servers import serve_app


def test_a_bug_is_an_openai_500_and_the_connection_serves_on() -> None:
    # Found live: a bug's 500 was plain text, and the client's next request on the same
    # connection was reset (uvicorn closes it after Starlette re-raises).
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(ServerErrors)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict[str, str]:
        if body.prompt == "bug":
            raise KeyError("a bug in a handler")
        return {"ok": "yes"}

    with serve_app(app) as url, httpx.Client(base_url=url) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "bug"})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error"
        assert "KeyError" in err["message"]
        # Where every member of a union failed, the error names the field, and the
        # validator's own message rather than "not a valid string".
        r = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"]})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "prompt"
        assert "only one prompt" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "stop": [1]})
        assert r.json()["error"]["param"] == "stop"
        assert client.post("/v1/completions", json={"model": "m", "prompt": "ok"}).json() == {
            "ok": "yes"
        }
