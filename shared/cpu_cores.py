"""Which cores CPU engines run on: one rule for `conveyor up` and the workers.

The first core stays free for the event loops (gateway, workers, Redis); the
rest are split into contiguous, disjoint slices, one per engine worker, so two
engines never bind their OpenMP threads to the same cores. With exactly as many
cores as engines, each engine gets a core of its own, the first included: two
engines sharing one core would halve each engine's speed, while the event loops
need only a fraction of a core. With more engines than cores, engines share
single cores round-robin. GPU workers ignore it.
"""

from __future__ import annotations

import os


def available_cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def engine_core_slices(cores: list[int], engines: int) -> list[list[int]]:
    """``engines`` slices of ``cores`` minus the first (all of them on a 1-core box, and
    one core each when there are exactly as many cores as engines)."""
    usable = cores[1:] or cores
    if engines <= 0:
        return []
    if engines == len(cores):
        return [[core] for core in cores]
    if len(usable) < engines:
        return [[usable[i % len(usable)]] for i in range(engines)]
    size, extra = divmod(len(usable), engines)
    slices, start = [], 0
    for index in range(engines):
        end = start + size + (1 if index < extra else 0)
        slices.append(usable[start:end])
        start = end
    return slices


def cores_spec(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def parse_cores(spec: str) -> list[int]:
    """``'1,3-5'`` -> ``[1, 3, 4, 5]`` (the inverse of :func:`cores_spec`)."""
    cores: list[int] = []
    for part in spec.split(","):
        low, _, high = part.partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return cores
