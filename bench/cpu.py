"""Where the machine's CPU time went during a measurement (Linux /proc).

Splits the busy CPU seconds of the whole machine into: each process of the server's
process tree (its children may start sessions of their own), the redis-server on the
benchmark's Redis port, this benchmark client, and everything else (other people's
tests on the same 2 cores show up there).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

_TICK = float(os.sysconf("SC_CLK_TCK"))


@dataclass(frozen=True, slots=True)
class _Proc:
    label: str
    ppid: int
    pgid: int
    cpu_s: float
    command: str


def _read_proc(pid: int) -> _Proc | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw_cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is state (field 3): ppid is field 4, pgrp 5, utime 14, stime 15.
    ppid, pgid = int(fields[1]), int(fields[2])
    utime, stime = int(fields[11]), int(fields[12])
    args = [a.decode(errors="replace") for a in raw_cmd.split(b"\0") if a]
    label = comm
    if args and comm.lower().startswith(("python", "conveyor")):
        words = [os.path.basename(a) for a in args[1:4] if not a.startswith("-")]
        label = " ".join(words) or args[0]
    return _Proc(label[:48] or comm, ppid, pgid, (utime + stime) / _TICK, " ".join(args))


def _all_procs() -> dict[int, _Proc]:
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (proc := _read_proc(int(entry))) is not None:
            procs[int(entry)] = proc
    return procs


def _tree(root: int, procs: dict[int, _Proc]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, proc in procs.items():
        children.setdefault(proc.ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def process_tree(root: int) -> dict[int, int]:
    """``root`` and its living descendants, each with its process group id."""
    procs = _all_procs()
    return {pid: procs[pid].pgid for pid in _tree(root, procs)}


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) used so far by ``root`` and its living descendants."""
    procs = _all_procs()
    return sum(procs[pid].cpu_s for pid in _tree(root, procs))


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores)."""
    return _machine_busy_s()


def _machine_busy_s() -> float:
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in parts]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    busy = sum(values[:8]) - idle  # guest time is already inside user
    return busy / _TICK


@dataclass(frozen=True, slots=True)
class CpuReport:
    wall_s: float
    machine_busy_s: float
    server: dict[str, float]
    redis_s: float
    client_s: float
    other_s: float

    def engine_s(self) -> float:
        return sum(s for label, s in self.server.items() if label.startswith(ENGINE_PREFIX))

    def frontend_s(self) -> float:
        """Everything of the server but vLLM's engine processes, plus its Redis."""
        return sum(self.server.values()) - self.engine_s() + self.redis_s

    def lines(self) -> list[str]:
        capacity = self.wall_s * (os.cpu_count() or 1)
        out = [
            f"  CPU over {self.wall_s:.1f}s wall ({capacity:.1f} core-s available): "
            f"machine busy {self.machine_busy_s:.1f}s, server {sum(self.server.values()):.1f}s,"
            f" redis {self.redis_s:.1f}s, bench client {self.client_s:.1f}s, "
            f"other processes {self.other_s:.1f}s"
        ]
        for label, seconds in sorted(self.server.items(), key=lambda kv: -kv[1]):
            if seconds >= 0.05:
                out.append(f"    {seconds:7.1f}s  {label}")
        return out


def merge(reports: list[CpuReport]) -> CpuReport:
    """The sum of several measurements (e.g. the rounds against one server)."""
    server: dict[str, float] = {}
    for report in reports:
        for label, seconds in report.server.items():
            server[label] = server.get(label, 0.0) + seconds
    return CpuReport(
        wall_s=sum(r.wall_s for r in reports),
        machine_busy_s=sum(r.machine_busy_s for r in reports),
        server=server,
        redis_s=sum(r.redis_s for r in reports),
        client_s=sum(r.client_s for r in reports),
        other_s=sum(r.other_s for r in reports),
    )


ENGINE_PREFIX = "VLLM::"
"""vLLM's engine-core and model-runner processes name themselves so (setproctitle)."""


class CpuMeter:
    """``start()`` then ``stop()`` around a measurement of the server whose root is ``pid``."""

    def __init__(self, pid: int | None, redis_port: int | None) -> None:
        self._pid = pid
        self._redis_mark = f":{redis_port}" if redis_port else None
        self._before: dict[int, _Proc] = {}
        self._busy = 0.0
        self._client = 0.0
        self._wall = 0.0

    def start(self) -> None:
        self._before = _all_procs()
        self._busy = _machine_busy_s()
        self._client = _own_cpu_s()
        self._wall = time.monotonic()

    def stop(self) -> CpuReport:
        after = _all_procs()
        busy = _machine_busy_s() - self._busy
        client = _own_cpu_s() - self._client
        server: dict[str, float] = {}
        redis = 0.0
        accounted = client
        tree = set() if self._pid is None else _tree(self._pid, after)
        for pid, proc in after.items():
            if pid == os.getpid():
                continue
            before = self._before.get(pid)
            delta = proc.cpu_s - (before.cpu_s if before and before.label == proc.label else 0.0)
            if pid in tree:
                server[proc.label] = server.get(proc.label, 0.0) + delta
                accounted += delta
            elif (
                self._redis_mark is not None
                and proc.label.startswith("redis-server")
                and self._redis_mark in proc.command
            ):
                redis += delta
                accounted += delta
        return CpuReport(
            wall_s=time.monotonic() - self._wall,
            machine_busy_s=busy,
            server=server,
            redis_s=redis,
            client_s=client,
            other_s=max(0.0, busy - accounted),
        )


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system
