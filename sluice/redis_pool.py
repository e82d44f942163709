"""Creating the Redis client every process shares."""

from __future__ import annotations

import asyncio
import logging
import re

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("sluice.redis")


def redact_url(url: str) -> str:
    """The URL without its password, for logs and banners."""
    return re.sub(r"//[^@/]*@", "//***@", url)


async def create_pool(url: str, *, retries: int = 20, delay_s: float = 0.25) -> Redis:
    """Connect to ``url`` and PING it, retrying while the server comes up.

    >>> redis = await create_pool("redis://127.0.0.1:6379/0")
    """
    redis: Redis = Redis.from_url(
        url, socket_connect_timeout=2, socket_timeout=5, health_check_interval=30
    )
    for attempt in range(1, retries + 1):
        try:
            await redis.ping()
            return redis
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            if attempt == retries:
                await redis.aclose()
                raise
            log.warning("redis %s not reachable (%s), retry %d/%d", url, exc, attempt, retries)
            await asyncio.sleep(delay_s)
    raise AssertionError("unreachable")
