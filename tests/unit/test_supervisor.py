"""`conveyor up`'s supervisor: a dead worker leaves the registry at once and is restarted."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis

from conveyor.supervisor import Child, Supervisor
from shared.queue import names
from shared.queue.liveness import BEAT, beat_args, forget_dead_process
from tests.conftest import REAL_REDIS_URL
from tests.waiting import eventually_sync


def test_a_child_that_exits_is_reported_and_restarted_after_a_backoff() -> None:
    exited: list[int] = []
    supervisor = Supervisor(grace_s=5)
    child = Child("quick", [sys.executable, "-c", "pass"], {}, on_exit=exited.append)
    supervisor.add(child)
    first_pid = child.process.pid if child.process else -1
    child.process.wait(10)  # type: ignore[union-attr]
    supervisor._check(child)
    assert exited == [first_pid]
    # Not restarted at once: the first backoff is 1 s.
    assert child.process is not None and child.process.pid == first_pid
    assert child.next_start_monotonic - time.monotonic() > 0.5

    def restarted() -> bool:
        supervisor._check(child)
        return child.process is not None and child.process.pid != first_pid

    eventually_sync(restarted, what="the restart after the backoff")
    supervisor.stop_all()


def test_a_stop_request_ends_the_loop_at_once_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.supervisor")
    supervisor = Supervisor(grace_s=5)
    supervisor.add(Child("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], {}))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    asked = time.monotonic()
    threading.Timer(0.2, supervisor.request_stop).start()
    try:
        supervisor.run(poll_s=30)  # the nap between checks does not delay the stop
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    supervisor.stop_all()  # `conveyor up` calls it again on the way out
    assert time.monotonic() - asked < 5
    assert [r.getMessage() for r in caplog.records].count("all children stopped") == 1


@pytest.mark.redis
def test_forget_dead_process_removes_only_that_process() -> None:
    client = redis.Redis.from_url(REAL_REDIS_URL)
    client.flushdb()
    try:
        for worker_id in (
            "aggregated-box-4242-abc123",
            "decode-box-4242-def456",
            "aggregated-box-14242-aaaaaa",
            "aggregated-other-4242-bbbbbb",
        ):
            keys, args = beat_args(worker_id, b"{}", 60_000)
            client.register_script(BEAT)(keys=keys, args=args)
        gone = forget_dead_process(REAL_REDIS_URL, 4242, host="box")
        assert sorted(gone) == ["aggregated-box-4242-abc123", "decode-box-4242-def456"]
        left = sorted(k.decode() for k in client.scan_iter(names.WORKER_HEARTBEAT_PATTERN))
        assert left == [
            names.worker_heartbeat("aggregated-box-14242-aaaaaa"),
            names.worker_heartbeat("aggregated-other-4242-bbbbbb"),
        ]
        listed = sorted(w.decode() for w in client.zrange(names.WORKER_SET, 0, -1))
        assert listed == ["aggregated-box-14242-aaaaaa", "aggregated-other-4242-bbbbbb"]
    finally:
        client.flushdb()
        client.close()


def test_up_puts_an_encode_worker_in_front_of_either_mode() -> None:
    from conveyor.cli import worker_roles
    from shared.settings import Mode, Settings

    assert worker_roles(Settings(encode=True)) == ["encode", "aggregated"]
    assert worker_roles(Settings(encode=True, mode=Mode.DISAGGREGATED, workers=2)) == [
        "encode",
        "prefill",
        "decode",
        "prefill",
        "decode",
    ]
    assert worker_roles(Settings(embed_model="default")) == ["aggregated", "embed"]


def test_boolean_settings_are_bare_flags() -> None:
    from conveyor.cli import build_parser, settings_from

    assert settings_from(build_parser().parse_args(["up", "--encode"])).encode is True
    assert settings_from(build_parser().parse_args(["up", "--encode", "false"])).encode is False
    assert settings_from(build_parser().parse_args(["up", "--port", "9001"])).encode is False


@pytest.mark.parametrize(
    ("cores", "engines", "slices"),
    [
        ([0, 1], 1, [[1]]),
        ([0, 1], 2, [[0], [1]]),  # as many cores as engines: one each, the first too
        ([0, 1], 3, [[1], [1], [1]]),  # more engines than cores: they share the free one
        ([0, 1, 2, 3], 4, [[0], [1], [2], [3]]),
        ([0, 1, 2, 3], 1, [[1, 2, 3]]),
        ([0, 1, 2, 3], 2, [[1, 2], [3]]),
        ([0, 1, 2, 3, 4, 5, 6, 7, 8], 4, [[1, 2], [3, 4], [5, 6], [7, 8]]),
        ([0], 2, [[0], [0]]),  # a 1-core box has nothing to keep free
        ([0, 1], 0, []),
    ],
)
def test_engine_core_slices_keep_the_first_core_free_unless_each_engine_gets_one(
    cores: list[int], engines: int, slices: list[list[int]]
) -> None:
    from shared.cpu_cores import engine_core_slices

    assert engine_core_slices(cores, engines) == slices


def test_up_gives_each_engine_worker_its_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.cli import worker_envs, worker_roles
    from shared import cpu_cores
    from shared.settings import Settings

    monkeypatch.setattr(cpu_cores, "available_cores", lambda: [0, 1, 2, 3, 4])
    settings = Settings(encode=True, workers=2, embed_model="default")
    roles = worker_roles(settings)
    binds = [env.get("CONVEYOR_CPU_OMP_THREADS_BIND") for env in worker_envs(settings, roles, {})]
    assert list(zip(roles, binds, strict=True)) == [
        ("encode", None),
        ("aggregated", "1,2"),
        ("aggregated", "3"),
        ("embed", "4"),
    ]
    pinned = Settings(workers=2, cpu_omp_threads_bind="2")
    assert worker_envs(pinned, worker_roles(pinned), {"X": "1"}) == [{"X": "1"}, {"X": "1"}]


SUPERVISOR = """
import signal, sys, time
from conveyor.supervisor import Child, Supervisor
supervisor = Supervisor(grace_s=30)
loading = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(60)"
)
child = Child("loading", [sys.executable, "-c", loading], {})
supervisor.add(child)
print(child.process.pid, flush=True)
supervisor.run(poll_s=0.1)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie is dead
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_still_starting_dies_with_its_supervisor() -> None:
    """`up` SIGKILLed while a worker is still loading (it defers SIGTERM until then): the
    kernel kills the worker with it."""
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR], stdout=subprocess.PIPE, text=True
    )
    try:
        assert supervisor.stdout is not None
        lines = {supervisor.stdout.readline().strip() for _ in range(2)}
        (pid,) = (int(line) for line in lines if line.isdigit())
        supervisor.send_signal(signal.SIGTERM)  # stop_all: SIGTERM, which it ignores
        time.sleep(0.5)
        assert not _gone(pid)
        supervisor.kill()
        eventually_sync(lambda: _gone(pid), timeout_s=5, what="the child to die with `up`")
    finally:
        supervisor.kill()
        supervisor.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_child_that_ignores_sigterm_is_killed_with_its_group_after_the_grace() -> None:
    supervisor = Supervisor(grace_s=0.5)
    stubborn = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    child = Child("stubborn", [sys.executable, "-c", stubborn], {})
    supervisor.add(child)
    assert child.process is not None
    time.sleep(0.5)
    supervisor.request_stop()
    supervisor._check(child)  # nothing is restarted once stopping
    supervisor.stop_all()
    assert child.process.returncode == -signal.SIGKILL
    # SIGKILL to the group is sent, not yet handled: the grandchild dies when it is next scheduled
    eventually_sync(
        lambda: _group_gone(child.process.pid) if child.process else True,
        timeout_s=5,
        what="the stubborn child's whole group to die",
    )


def _group_gone(pgid: int) -> bool:
    group = [p for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == pgid]
    return all(_gone(int(p)) for p in group)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_several_gateways_share_the_port_with_reuse_port() -> None:
    from conveyor.cli import gateway_envs
    from shared.settings import Settings

    env = {"CONVEYOR_PORT": "8123"}
    assert gateway_envs(Settings(gateways=1), env) == [env]
    several = gateway_envs(Settings(gateways=3), env)
    assert several == [{**env, "CONVEYOR_REUSE_PORT": "true"}] * 3


def test_reuse_port_sockets_bind_the_same_port_twice() -> None:
    from gateway.server import reuse_port_socket

    first = reuse_port_socket("127.0.0.1", 0)
    second = reuse_port_socket("127.0.0.1", first.getsockname()[1])
    try:
        assert first.getsockname() == second.getsockname()
    finally:
        first.close()
        second.close()
