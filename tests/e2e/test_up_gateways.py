"""`conveyor up --gateways 2`: two gateway processes share one port (SO_REUSEPORT), each
with its own gateway id; both get connections, one killed leaves the other serving (and
`up` restarts it), and Ctrl-C stops them all. Fake-engine workers: no model to load."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.stack import CONVEYOR, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STOP_LIMIT_S = 15.0


def _gateway_ids(url: str, connections: int) -> set[str]:
    """The gateway id behind each of ``connections`` new connections."""
    ids = set()
    for _ in range(connections):
        with httpx.Client(timeout=10) as client:  # a new connection: a new port to hash
            ids.add(client.get(f"{url}/admin/state").json()["gateway_id"])
    return ids


def _complete(url: str, model: str) -> None:
    body = {"model": model, "prompt": "hi", "max_tokens": 3}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text


def test_up_runs_several_gateways_on_one_port(demo_model: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(
        os.environ,
        CONVEYOR_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
        CONVEYOR_MODEL=str(demo_model),
        CONVEYOR_DATA_DIR=str(tmp_path),
        CONVEYOR_PORT=str(port),
        CONVEYOR_ENGINE="fake",
    )
    console = tmp_path / "up.log"
    with console.open("wb") as log:
        up = subprocess.Popen(
            [CONVEYOR, "up", "--gateways", "2"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while "Conveyor is ready" not in console.read_text():
            assert up.poll() is None, console.read_text()[-3000:]
            assert time.monotonic() < deadline, console.read_text()[-3000:]
            time.sleep(0.3)
        gateways = [
            p
            for p in psutil.Process(up.pid).children()
            if p.cmdline()[-1:] == ["gateway"]  # up's own children only
        ]
        assert len(gateways) == 2
        _wait_both_ready(url)
        assert len(_gateway_ids(url, 40)) == 2, "one gateway got every connection"
        for _ in range(4):
            _complete(url, demo_model.name)
        tree = [psutil.Process(up.pid), *psutil.Process(up.pid).children(recursive=True)]

        gateways[0].kill()
        gateways[0].wait(10)
        for _ in range(10):  # the survivor takes every new connection meanwhile
            _complete(url, demo_model.name)
        _wait_both_ready(url)  # up restarted the killed one
        tree += psutil.Process(up.pid).children(recursive=True)
    finally:
        os.killpg(up.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
        try:
            up.wait(STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            raise
    time.sleep(1)
    assert console.read_text().count("all children stopped") == 1
    survivors = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not survivors, [p.cmdline() for p in survivors]


def _wait_both_ready(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if len(_gateway_ids(url, 20)) == 2:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("two gateways never answered on the port")
