"""The gateway process: uvicorn serving :func:`gateway.app.create_app`."""

from __future__ import annotations

from gateway.app import create_app
from gateway.config import GatewaySettings
from sluice.serve import Server, run_async, uvicorn_config


def run(settings: GatewaySettings) -> None:
    config = uvicorn_config(
        create_app(settings), settings.host, settings.port,
        graceful_s=settings.shutdown_grace_s, lifespan=True,
    )
    run_async(Server(config).serve())
