"""The gateway process: uvicorn serving :func:`gateway.app.create_app`."""

from __future__ import annotations

import sys

from gateway.app import create_app
from gateway.config import GatewaySettings
from gateway.tenancy import StartupRefused, Tenancy
from sluice.redis_pool import create_pool
from sluice.serve import Server, run_async, uvicorn_config
from sluice.telemetry import setup_tracing


async def preflight(settings: GatewaySettings) -> None:
    """Checks that must stop the process with a message, before uvicorn starts."""
    redis = await create_pool(settings.redis_url)
    try:
        await Tenancy(redis, settings).check_startup()
    finally:
        await redis.aclose()


def run(settings: GatewaySettings) -> None:
    try:
        run_async(preflight(settings))
    except StartupRefused as exc:
        print(f"sluice gateway: {exc}", file=sys.stderr)
        sys.exit(2)
    setup_tracing("sluice-gateway")
    config = uvicorn_config(
        create_app(settings), settings.host, settings.port,
        graceful_s=settings.shutdown_grace_s, lifespan=True,
    )
    run_async(Server(config).serve())
