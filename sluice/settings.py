"""Settings every process shares."""

from __future__ import annotations

import ipaddress

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings

from sluice import redis_url


class RedisSettings(BaseSettings):
    #: The Redis every gateway and worker shares (env SLUICE_REDIS_URL, or the CLI flag):
    #: ``redis://``, ``redis+cluster://`` or ``redis+sentinel://`` (sluice/redis_url.py).
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("SLUICE_REDIS_URL", "redis_url"),
    )
    #: Shared secret gateways present to workers (``Authorization: Bearer``) on
    #: /internal/generate and /metrics. ``sluice up`` makes one for its children.
    internal_token: str | None = Field(
        default=None, validation_alias=AliasChoices("SLUICE_INTERNAL_TOKEN", "internal_token"),
    )
    #: Connections each process keeps to each Redis server; past it, commands wait for one.
    redis_max_connections: int = Field(
        default=64, ge=4,
        validation_alias=AliasChoices("SLUICE_REDIS_MAX_CONNECTIONS", "redis_max_connections"),
    )

    @field_validator("redis_url")
    @classmethod
    def _usable_url(cls, url: str) -> str:
        return redis_url.validate(url)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or a client's) is this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
