"""sluice/lean_routes.py's Front: a lean route gets what FastAPI's layers gave it (the
request id on every answer, the app's handlers, an unexpected error as a logged 500 that
is raised on), and everything else is FastAPI's."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sluice.lean_routes import Front, LeanRoutes
from sluice.errors import InvalidRequest, SluiceError


def _front() -> tuple[Front, list[str]]:
    app = FastAPI()
    handled: list[str] = []

    @app.exception_handler(SluiceError)
    async def shaped(request: Request, exc: SluiceError) -> Response:
        handled.append("sluice")
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        handled.append("unexpected")
        return JSONResponse({"error": {"message": "internal error in the gateway"}}, status_code=500)

    async def route(request: Request) -> Response:
        body = await request.body()
        if body == b"bad":
            raise InvalidRequest("no good")
        if body == b"boom":
            raise RuntimeError("a bug")
        return JSONResponse({"id": request.scope["sluice.request_id"]})

    @app.post("/v1/x")
    async def documented(request: Request) -> Response:
        raise AssertionError("the lean route answers, not FastAPI's")

    @app.get("/v1/x")
    async def got() -> Response:
        return JSONResponse({"via": "fastapi"})

    lean = LeanRoutes()
    lean.add("/v1/x", route)
    return Front(app, lean, lambda given: given or "fresh-id"), handled


async def test_a_lean_route_answers_with_the_request_id_and_the_rest_is_fastapi_s() -> None:
    front, _ = _front()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://t") as client:
        fresh = await client.post("/v1/x", content=b"ok")
        mine = await client.post("/v1/x", content=b"ok", headers={"x-request-id": "mine-1"})
        got = await client.get("/v1/x")
        missing = await client.post("/v1/y")
    assert (fresh.json(), fresh.headers["x-request-id"]) == ({"id": "fresh-id"}, "fresh-id")
    assert (mine.json(), mine.headers["x-request-id"]) == ({"id": "mine-1"}, "mine-1")
    assert got.json() == {"via": "fastapi"}
    assert missing.status_code == 404


async def test_errors_answer_through_the_app_s_handlers_and_an_unexpected_one_is_raised_on() -> None:
    front, handled = _front()
    transport = httpx.ASGITransport(app=front, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        bad = await client.post("/v1/x", content=b"bad")
        boom = await client.post("/v1/x", content=b"boom")
    assert (bad.status_code, bad.json()["error"]["message"], bad.headers["x-request-id"]) == (400, "no good",
                                                                                            "fresh-id")
    assert (boom.status_code, boom.headers["x-request-id"]) == (500, "fresh-id")
    assert handled == ["sluice", "unexpected"]
    raising = httpx.ASGITransport(app=front)  # uvicorn sees it too, and logs it, as behind Starlette
    async with httpx.AsyncClient(transport=raising, base_url="http://t") as client:
        with pytest.raises(RuntimeError, match="a bug"):
            await client.post("/v1/x", content=b"boom")
