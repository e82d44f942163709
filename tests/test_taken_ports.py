"""Ports chosen free and bound a moment later by a child process: on a shared machine
another process can take one in between (and, one free port at a time, the kernel may hand
the same port to two processes of one deployment).

The embedded Redis deployments start on ports nobody else holds, or say why they did not:
any redis-server answers PING, so a start that only waited for PONG took the intruder for
its own server. The suite's workers and gateways start again on another port.
"""

from __future__ import annotations

import socket

import httpx
import pytest

import tests.conftest as harness
from sluice.embedded_failover import EmbeddedSentinel
from sluice.embedded_redis import CLUSTER_BUS_OFFSET, EmbeddedRedis, free_cluster_ports


def test_a_server_whose_port_was_taken_since_it_was_chosen_does_not_start() -> None:
    with EmbeddedRedis() as intruder:
        late = EmbeddedRedis(intruder.port)
        with pytest.raises(RuntimeError, match=f"port {intruder.port}"):
            late.start()
        assert late.process is not None and late.process.poll() is not None
        with intruder.admin() as client:
            assert client.ping()


# redis-py's sync client can leave a socket unclosed when a connection attempt to a server
# that is going away fails half-way (seen once in a full run, on the retry's clean-up): a
# warning about the harness, not about what this test checks.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_sentinel_deployment_whose_replica_port_was_taken_starts_on_fresh_ports() -> None:
    """The CI failure "timed out after 90.0s waiting for replication to start": the replica's
    port answered, from a server that replicates nothing."""
    deployment = EmbeddedSentinel()
    taken = deployment.servers[1].port
    with EmbeddedRedis(taken) as intruder:
        with deployment:
            master, replica = deployment.servers
            assert taken not in (master.port, replica.port)
            assert deployment.linked(replica.port)
            assert deployment.master_port() == master.port
        with intruder.admin() as client:
            assert client.info("replication")["role"] == "master"


def test_a_replica_that_never_links_is_reported_with_what_it_says() -> None:
    deployment = EmbeddedSentinel()
    deployment.servers[1].args = ("--replicaof", "127.0.0.1", "1")  # nothing listens there
    with pytest.raises(RuntimeError, match="waiting for replication to start") as failed:
        deployment.start(timeout_s=1, attempts=1)
    assert f"replica on port {deployment.servers[1].port}" in str(failed.value)
    assert "master_port=1 master_link_status=down" in str(failed.value)
    assert all(s.process is not None and s.process.poll() is not None for s in deployment.servers)


@pytest.mark.parametrize("kind", ["gateway", "worker"])
def test_a_process_whose_port_was_taken_since_it_was_chosen_starts_on_another(
    kind: str, start_gateway, start_worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a gateway's port taken before it bound it ended the test in an error
    ("[Errno 98] ... address already in use"), as two of test_resumable's did in one run."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        chosen = iter([port])
        free = harness.free_port
        monkeypatch.setattr(harness, "free_port", lambda: next(chosen, None) or free())
        proc = start_gateway() if kind == "gateway" else start_worker("taken-port")
    assert proc.url != f"http://127.0.0.1:{port}"
    assert httpx.get(proc.url + "/health", timeout=10).status_code == 200


def test_cluster_ports_are_distinct_with_their_bus_ports_and_avoid_the_given_ones() -> None:
    """A cluster fixture came up with two nodes of three (one port chosen twice, one at a
    time): the ports of one deployment are chosen together."""
    masters = free_cluster_ports(40)
    replicas = free_cluster_ports(40, avoid=masters)
    ports = masters + replicas
    buses = [p + CLUSTER_BUS_OFFSET for p in ports]
    assert len(set(ports + buses)) == 2 * len(ports)
