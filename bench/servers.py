"""Start and stop the servers under test, each in its own process group.

Every server is started in a new session (so a Ctrl-C in the terminal reaches only the
benchmark, which then stops the server in order) and is told by the kernel to get
SIGTERM if the benchmark dies (PR_SET_PDEATHSIG). ``stop`` notes the server's process
tree, sends SIGINT to the server process, waits for a clean exit, then SIGKILLs whatever
is left of the process groups of that tree (`conveyor up` starts each child in a
session of its own, and engine processes may outlive their parent).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.cpu import process_tree

_PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 40.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerFailed(RuntimeError):
    pass


@dataclass
class ManagedServer:
    name: str
    command: list[str]
    env: dict[str, str]
    port: int
    ready_path: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def wait_ready(self, timeout_s: float) -> float:
        """Poll ``ready_path`` until it answers 200; returns the seconds it took."""
        started = time.monotonic()
        with httpx.Client(base_url=self.base_url, timeout=2.0, trust_env=False) as client:
            while time.monotonic() - started < timeout_s:
                if self.process is None or self.process.poll() is not None:
                    raise ServerFailed(f"{self.name} exited while starting\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.ready_path).status_code == 200:
                        return time.monotonic() - started
                time.sleep(0.5)
        raise ServerFailed(f"{self.name} not ready after {timeout_s:.0f}s\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(f"  | {line}" for line in text.splitlines()[-lines:])

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        process = self.process
        if process is None:
            return
        groups = {process.pid, *process_tree(process.pid).values()}
        try:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGINT)
                try:
                    process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    print(
                        f"  {self.name} did not stop in {grace_s:.0f}s; killing what is left",
                        file=sys.stderr,
                    )
        finally:  # even when a second Ctrl-C cut the wait short
            groups.update(process_tree(process.pid).values())  # children started meanwhile
            for group in groups - {os.getpgid(0)}:  # stragglers, if any; never our own group
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)


@contextlib.contextmanager
def running(server: ManagedServer, startup_timeout_s: float) -> Iterator[ManagedServer]:
    """Start ``server``, wait until ready, and stop it on leaving (errors and Ctrl-C too)."""
    try:
        server.start()
        took = server.wait_ready(startup_timeout_s)
        print(
            f"  {server.name} ready at {server.base_url} after {took:.1f}s "
            f"(log: {server.log_path})",
            flush=True,
        )
        yield server
    finally:
        server.stop()


def conveyor_server(
    model: Path,
    served_name: str,
    redis_url: str,
    dtype: str,
    max_num_seqs: int,
    log_dir: Path,
    *,
    mode: str = "aggregated",
    variant: str | None = None,
    env_overrides: dict[str, str] | None = None,
) -> ManagedServer:
    """``conveyor up``: one aggregated worker, or (``mode="disaggregated"``) prefill + decode;
    a ``variant`` is another aggregated one with ``env_overrides`` (named conveyor-VARIANT)."""
    port = free_port()
    name = "conveyor" if mode == "aggregated" else "conveyor-pd"
    if variant is not None:
        name = f"conveyor-{variant}"
    script = Path(sys.executable).with_name("conveyor")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "conveyor.cli"]
    command += [
        "up",
        "--port",
        str(port),
        "--model",
        str(model),
        "--served-model-name",
        served_name,
        "--redis-url",
        redis_url,
        "--workers",
        "1",
        "--data-dir",
        str(log_dir / f"{name}-data"),  # each its own SQLite state (keys, ledger)
        "--dtype",
        dtype,
        "--worker-max-slots",
        str(max_num_seqs),
        "--mode",
        mode,
    ]
    env = {**os.environ, **(env_overrides or {})}
    return ManagedServer(name, command, env, port, "/ready", log_dir / f"{name}.log")


def vllm_server(
    model: Path,
    served_name: str,
    dtype: str,
    max_num_seqs: int,
    log_dir: Path,
    *,
    name: str = "vllm",
    env_overrides: dict[str, str] | None = None,
) -> ManagedServer:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        dtype,
        "--max-num-seqs",
        str(max_num_seqs),
    ]
    # Conveyor's worker does the same (setdefault from --kv-cache-gib, default 1 GiB).
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, **(env_overrides or {})}
    return ManagedServer(name, command, env, port, "/v1/models", log_dir / f"{name}.log")


BENCH_KEY_LIMITS = {
    "rpm": 10**7,
    "tpm": 10**12,
    "max_concurrent": 10**5,
    "budget_tokens": 10**15,
    "budget_period": "month",
}
"""Limits no bench run reaches: every check of the admission script runs, none refuses."""


def limited_key(server: ManagedServer) -> str | None:
    """With auth on (CONVEYOR_ADMIN_KEY in its env), an inference key carrying every limit,
    created through /admin/keys; the load then runs with it. None: auth is off."""
    admin = server.env.get("CONVEYOR_ADMIN_KEY")
    if not admin:
        return None
    response = httpx.post(
        f"{server.base_url}/admin/keys",
        json={"name": "bench", **BENCH_KEY_LIMITS},
        headers={"Authorization": f"Bearer {admin}"},
        timeout=30,
    )
    response.raise_for_status()
    secret: str = response.json()["key"]
    return secret


def parse_env(spec: str) -> dict[str, str]:
    """``KEY=VALUE,KEY=VALUE`` -> a dict (``--vllm-env``, ``--variant``)."""
    pairs = [item.partition("=") for item in spec.split(",") if item]
    if any(not key or not sep for key, sep, _ in pairs):
        raise ValueError(f"expected KEY=VALUE[,KEY=VALUE...], got {spec!r}")
    return {key: value for key, _, value in pairs}


def with_db(redis_url: str, db: int) -> str:
    return f"{redis_url.rsplit('/', 1)[0]}/{db}"


def drop_stale_jobs(redis_url: str, served_name: str) -> None:
    """Forget jobs a killed earlier run left in the bench's Redis db for this model."""
    import redis

    from shared.queue import names

    client = redis.Redis.from_url(redis_url)
    try:
        client.delete(
            *(names.job_stream(served_name, role) for role in ("aggregated", "prefill", "decode"))
        )
    finally:
        client.close()


def kv_transfers(redis_url: str, served_name: str) -> tuple[int, float]:
    """(transfers, seconds) the model's decode workers report in the registry so far."""
    import json

    import redis

    from shared.queue import names

    client = redis.Redis.from_url(redis_url)
    try:
        names = list(client.scan_iter(names.WORKER_HEARTBEAT_PATTERN))
        workers = [json.loads(v) for v in (client.mget(names) if names else []) if v]
    finally:
        client.close()
    decoders = [w for w in workers if w.get("model") == served_name and w.get("role") == "decode"]
    return (
        sum(int(w.get("kv_transfers", 0)) for w in decoders),
        sum(float(w.get("kv_transfer_s", 0.0)) for w in decoders),
    )


def interrupt_on_signals() -> None:
    """Ctrl-C and SIGTERM both raise KeyboardInterrupt, so the finally blocks that stop
    the servers run (SIGINT explicitly too: a shell starts background jobs with SIGINT
    ignored)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt
