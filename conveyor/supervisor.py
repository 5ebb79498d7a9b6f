"""`conveyor up`'s process tree: start children, restart the ones that die, stop them all.

Every child is its own OS process (`conveyor gateway`, `conveyor worker --role
...`) in a session of its own, and is SIGKILLed by the kernel when this process dies
(PR_SET_PDEATHSIG, Linux): a worker still loading its engine defers SIGTERM until the
load is done, so a `conveyor up` killed before its children stopped (or before it could
stop them) must not leave one running. On a stop, no child is started or restarted any
more, and one still starting is stopped like the rest: SIGTERM, then SIGKILL to its
whole process group after the grace period.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
MAX_BACKOFF_S = 30.0
STOP_CHECK_S = 0.05
EXIT_CONFIG_ERROR = 2
"""A child that exits with this code cannot start as configured: restarting is pointless."""


def parent_death_signal(sig: signal.Signals) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` when this process dies (Linux only; a no-op
    elsewhere). A parent that died before the child asked gets it at once."""
    parent = os.getpid()
    libc = _libc()

    def preexec() -> None:
        if libc is None:
            return
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig)) == 0 and os.getppid() != parent:
            os.kill(os.getpid(), sig)  # the parent is already gone: no signal would come

    return preexec


def _libc() -> ctypes.CDLL | None:
    """Loaded in the parent: the child runs as little as possible between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


@dataclass
class Child:
    name: str
    command: list[str]
    env: dict[str, str]
    restart: bool = True
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start_monotonic: float = 0.0
    started_monotonic: float = field(default=0.0)
    on_exit: Callable[[int], None] | None = None
    """Called with the pid of the child once it has exited (workers: leave the registry)."""

    def start(self) -> None:
        # Its own process group, so whatever it spawned (vLLM's engine core) can be
        # killed with it even when it dies too abruptly to clean up after itself.
        self.process = subprocess.Popen(
            self.command,
            env=self.env,
            stdin=subprocess.DEVNULL,
            preexec_fn=parent_death_signal(signal.SIGKILL),
            start_new_session=True,
        )
        self.started_monotonic = time.monotonic()
        log.info("started %s (pid %d): %s", self.name, self.process.pid, " ".join(self.command))

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill_leftovers(self) -> None:
        """SIGKILL anything still in the child's process group (orphaned engine cores)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)


class Supervisor:
    def __init__(self, *, grace_s: float = 30.0) -> None:
        self.children: list[Child] = []
        self._grace_s = grace_s
        self._stopping = False
        self._stopped = False
        self.exit_code = 0

    def add(self, child: Child) -> None:
        self.children.append(child)
        child.start()

    def request_stop(self, *_: object) -> None:
        self._stopping = True

    def run(self, *, poll_s: float = 0.5, tick: Callable[[], None] | None = None) -> int:
        """Supervise until asked to stop; restart dead children with backoff."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.request_stop)
        while not self._stopping:
            for child in self.children:
                self._check(child)
            if tick is not None:
                tick()
            self._sleep(poll_s)
        self.stop_all()
        return self.exit_code

    def _sleep(self, seconds: float) -> None:
        """In short naps: a signal does not cut a sleep short, and Ctrl-C should act now.
        (threading.Event is not safe to set from a signal handler.)"""
        deadline = time.monotonic() + seconds
        while not self._stopping and time.monotonic() < deadline:
            time.sleep(STOP_CHECK_S)

    def _check(self, child: Child) -> None:
        if child.alive() or self._stopping:
            return
        now = time.monotonic()
        if child.process is not None and child.next_start_monotonic == 0.0:
            code = child.process.returncode
            child.kill_leftovers()
            if child.on_exit is not None:
                try:
                    child.on_exit(child.process.pid)
                except Exception as exc:  # the next heartbeat expiry does the same, later
                    log.warning("after %s exited: %s", child.name, exc)
            if not child.restart or code == EXIT_CONFIG_ERROR:
                log.error("%s exited with %s and will not be restarted; stopping", child.name, code)
                self.exit_code = 1
                self._stopping = True
                return
            if now - child.started_monotonic > 60:
                child.restarts = 0  # it ran fine for a while: reset the backoff
            delay = min(MAX_BACKOFF_S, 2.0**child.restarts)
            child.restarts += 1
            child.next_start_monotonic = now + delay
            log.warning("%s exited with %s; restarting in %.0fs", child.name, code, delay)
        if now >= child.next_start_monotonic and not self._stopping:
            child.next_start_monotonic = 0.0
            child.start()

    def stop_all(self) -> None:
        """SIGTERM every child, SIGKILL those still up after the grace period; once."""
        if self._stopped:
            return
        self._stopped = True
        processes = [(c.name, c.process) for c in self.children if c.process and c.alive()]
        for _, process in processes:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self._grace_s
        for name, process in processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # e.g. a worker still loading its engine
                log.warning("%s did not stop in time; killing it", name)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for child in self.children:
            child.kill_leftovers()
        log.info("all children stopped")


def child_env(overrides: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(overrides)
    return env
