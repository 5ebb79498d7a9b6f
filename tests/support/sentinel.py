"""A real Sentinel-watched Redis on this machine: a master, a replica and three Sentinels
(quorum 2), each a ``redis-server`` process on a free loopback port in a folder of its own.

Fail-over is tuned to be quick (``down-after-milliseconds`` 500, ``failover-timeout``
2000); every node runs with AOF on, as docs/operations/several-hosts.md asks of an operator.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from conveyor.redis_server import DURABLE_OPTIONS
from tests.e2e.stack import free_ports

SERVICE = "conveyor"
QUORUM = 2
DOWN_AFTER_MS = 500
FAILOVER_TIMEOUT_MS = 2000


def _sentinel_id(port: int) -> str:
    return f"{port:040x}"


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    return found


@dataclass
class SentinelGroup:
    workdir: Path
    db: int = 0
    ports: list[int] = field(default_factory=lambda: free_ports(5))
    """Master, replica and the three Sentinels: distinct (two of them on one port left a
    Sentinel exiting at start and the group never settled)."""
    nodes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    killed_at: float | None = None
    """When :meth:`kill_master` last killed one (``time.monotonic()``)."""

    @property
    def master_port(self) -> int:
        return self.ports[0]

    @property
    def replica_port(self) -> int:
        return self.ports[1]

    @property
    def sentinel_ports(self) -> tuple[int, ...]:
        return tuple(self.ports[2:])

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/{self.db}"

    def start(self) -> None:
        # No 5 s wait for more replicas before a diskless full sync (the default delay).
        self._start_node(self.master_port, ["--repl-diskless-sync-delay", "0"])
        self._start_node(self.replica_port, ["--replicaof", "127.0.0.1", str(self.master_port)])
        self._wait_replica_linked()
        for port in self.sentinel_ports:
            self._start_sentinel(port)
        self.wait_ready()

    def _wait_replica_linked(self, timeout_s: float = 20) -> None:
        """A Sentinel asks the master for its replicas at once, then every 10 s: started
        before the replica links, the group would take those 10 s to settle."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError, OSError):
                client = redis.Redis(port=self.replica_port, socket_timeout=0.5)
                try:
                    if client.info("replication").get("master_link_status") == "up":
                        return
                finally:
                    client.close()
            time.sleep(0.05)
        raise TimeoutError(f"the replica did not link to its master; logs in {self.workdir}")

    def _start_node(self, port: int, extra: list[str]) -> None:
        folder = self.workdir / f"node-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        command = [
            redis_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(folder),
            *DURABLE_OPTIONS,
            "--save",
            "",
            "--logfile",
            str(folder / "redis.log"),
            # Stopped all at once: a master would wait 10 s for a replica already gone.
            "--shutdown-timeout",
            "0",
            *extra,
        ]
        self.nodes[port] = subprocess.Popen(command, stdin=subprocess.DEVNULL)

    def _start_sentinel(self, port: int) -> None:
        folder = self.workdir / f"sentinel-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "sentinel.conf"  # Sentinel rewrites it: one file per Sentinel
        config.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {folder}\nlogfile {folder / 'sentinel.log'}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} {QUORUM}\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
            # Known up front, as a Sentinel would write them to its file once it had heard
            # of them (hello messages every 2 s): the group is ready at once.
            f"sentinel myid {_sentinel_id(port)}\n"
            f"sentinel known-replica {SERVICE} 127.0.0.1 {self.replica_port}\n"
            + "".join(
                f"sentinel known-sentinel {SERVICE} 127.0.0.1 {other} {_sentinel_id(other)}\n"
                for other in self.sentinel_ports
                if other != port
            )
        )
        command = [redis_binary(), str(config), "--sentinel"]
        self.nodes[port] = subprocess.Popen(command, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout_s: float = 20) -> None:
        """Every Sentinel knows the master, its replica and the other Sentinels."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._sentinel_sees_all(port) for port in self.sentinel_ports):
                return
            time.sleep(0.1)
        raise TimeoutError(f"the Sentinel group did not settle; logs in {self.workdir}")

    def _sentinel_sees_all(self, port: int) -> bool:
        try:
            client = redis.Redis(port=port, socket_timeout=0.5, decode_responses=True)
            try:
                master = client.sentinel_master(SERVICE)
            finally:
                client.close()
        except (redis.RedisError, OSError):
            return False
        others = len(self.sentinel_ports) - 1
        return int(master["num-slaves"]) >= 1 and int(master["num-other-sentinels"]) >= others

    def master_address(self) -> tuple[str, int]:
        """Where the Sentinels say the master is now."""
        client = redis.Redis(port=self.sentinel_ports[0], socket_timeout=0.5)
        try:
            host, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        finally:
            client.close()
        return host.decode(), int(port)

    def kill_master(self) -> int:
        """SIGKILL the current master; returns its port."""
        _, port = self.master_address()
        process = self.nodes[port]
        process.send_signal(signal.SIGKILL)
        self.killed_at = time.monotonic()
        process.wait()
        return port

    def cut_replication(self) -> None:
        """Stop the replica hearing from the master: SIGSTOP it (so it cannot reconnect),
        then have the master drop its link (so nothing more is sent, not even into the
        replica's socket buffer). The master keeps acknowledging writes."""
        self.nodes[self.replica_port].send_signal(signal.SIGSTOP)
        master = redis.Redis(port=self.master_address()[1], socket_timeout=1)
        try:
            master.client_kill_filter(_type="replica")
        finally:
            master.close()

    def resume_replica(self) -> None:
        self.nodes[self.replica_port].send_signal(signal.SIGCONT)

    def wait_replicated(self, timeout_s: float = 5) -> None:
        """The replica has every write the master took (the master's offset reached)."""
        master = redis.Redis(port=self.master_address()[1], socket_timeout=1)
        try:
            master.wait(1, int(timeout_s * 1000))
        finally:
            master.close()

    def stop(self) -> None:
        for process in self.nodes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.nodes.values():
            try:  # a node still writing its first AOF refuses SIGTERM ("can't exit")
                process.wait(2)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
