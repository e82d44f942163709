"""What a Sluice Redis URL names: one server, a Cluster, or a Sentinel-managed master.

    redis://[[user]:password@]host:port[/db]                  one server (rediss:// for TLS)
    redis+cluster://[[user]:password@]host:port               a Cluster; any one node
    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]
                    [?sentinel_password=...&sentinel_username=...&db=N&password=...]

For ``redis+sentinel://`` the hosts are the *sentinels* (port 26379 when left out); the
path names the master's service as the sentinels know it (``sentinel monitor <service>``)
and, after it, the database. The user and password in front of the hosts (or
``?username=``/``?password=``) are the *master's* (``requirepass``); the sentinels' own
(``requirepass`` in sentinel.conf, rarely set) go in ``?sentinel_username=`` and
``?sentinel_password=``. An unknown query parameter is refused, so a misspelt password
does not pass silently. TLS to a Sentinel deployment is not supported
(``rediss+sentinel://`` is refused).

>>> parse("redis+sentinel://:pw@10.0.0.1,10.0.0.2:26380/cache/2").sentinels
(('10.0.0.1', 26379), ('10.0.0.2', 26380))
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.sentinel

SENTINEL_SCHEME = "redis+sentinel://"
CLUSTER_SCHEMES = {"redis+cluster://": "redis://", "rediss+cluster://": "rediss://"}
SENTINEL_PORT = 26379
_SENTINEL_OPTIONS = {"db", "password", "username", "sentinel_password", "sentinel_username"}


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """A master found through sentinels, and how to log in to it and to them."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    def master_kwargs(self) -> dict[str, object]:
        return {"db": self.db, "username": self.username, "password": self.password}

    def sentinel_kwargs(self) -> dict[str, object]:
        return {"username": self.sentinel_username, "password": self.sentinel_password}


def is_cluster_url(url: str) -> bool:
    return url.startswith(tuple(CLUSTER_SCHEMES))


def is_sentinel_url(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEME)


def cluster_node_url(url: str) -> str:
    """The ``redis://`` URL of the cluster node a ``redis+cluster://`` URL names."""
    scheme, plain = next((s, p) for s, p in CLUSTER_SCHEMES.items() if url.startswith(s))
    return plain + url[len(scheme):]


def parse(url: str) -> SentinelTarget:
    """The sentinels, service and credentials of a ``redis+sentinel://`` URL; ValueError
    saying what is wrong otherwise."""
    if url.startswith("rediss+sentinel://"):
        raise ValueError("TLS to Redis Sentinel is not supported: use redis+sentinel:// on a trusted network")
    if not is_sentinel_url(url):
        raise ValueError(f"not a {SENTINEL_SCHEME} URL")
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels = tuple(_host_port(h) for h in hosts.split(","))
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError("a redis+sentinel:// URL names the service: redis+sentinel://host:port/<service>[/db]")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = set(query) - _SENTINEL_OPTIONS
    if unknown:
        raise ValueError(f"unknown redis+sentinel:// option(s): {', '.join(sorted(unknown))}")
    user, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    db_text = query.get("db", path[1] if len(path) == 2 else "0")
    if not db_text.isdigit():
        raise ValueError(f"the database must be a number, not {db_text!r}")
    return SentinelTarget(
        sentinels=sentinels, service=path[0], db=int(db_text),
        username=query.get("username") or unquote(user) or None,
        password=query.get("password") or unquote(password) or None,
        sentinel_username=query.get("sentinel_username") or None,
        sentinel_password=query.get("sentinel_password") or None,
    )


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = text.partition(":")
    port = port or str(SENTINEL_PORT)
    if not host or not port.isdigit():
        raise ValueError(f"a sentinel is host[:port], not {text!r}")
    return host, int(port)


def validate(url: str) -> str:
    """``url`` if Sluice can use it; ValueError naming the problem (for settings validators)."""
    if is_sentinel_url(url) or url.startswith("rediss+sentinel://"):
        parse(url)
    elif not url.startswith(("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)):
        raise ValueError("a Redis URL starts with redis://, rediss://, unix://, redis+cluster:// or redis+sentinel://")
    return url


def sync_client(url: str) -> redis.Redis | redis.RedisCluster:
    """A synchronous client for any Sluice Redis URL (benchmarks, tests, one-off tools):
    the master for ``redis+sentinel://``, the whole cluster for ``redis+cluster://``."""
    if is_cluster_url(url):
        return redis.RedisCluster.from_url(cluster_node_url(url))
    if is_sentinel_url(url):
        target = parse(url)
        sentinel = redis.sentinel.Sentinel(list(target.sentinels), sentinel_kwargs=target.sentinel_kwargs(),
                                           socket_timeout=2.0, socket_connect_timeout=2.0)
        return sentinel.master_for(target.service, **target.master_kwargs())  # type: ignore[no-any-return]
    return redis.Redis.from_url(url)
