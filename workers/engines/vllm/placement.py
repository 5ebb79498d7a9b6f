"""Where a CPU vLLM engine runs: its cores (OpenMP binding, pinning), in-process or not,
and the KV connector's settings (NIXL side-channel port, the connector module).

Only the vLLM engine (:mod:`workers.engines.vllm.engine`) uses it.
"""

from __future__ import annotations

import logging
import os
import random
import socket
from pathlib import Path
from typing import Any

from shared.cpu_cores import available_cores, cores_spec, engine_core_slices, parse_cores
from shared.settings import Role, Settings
from workers.engines.host_address import advertised_host

log = logging.getLogger(__name__)


def kv_transfer_config(settings: Settings) -> Any:
    """Prefill and decode engines share KV through a connector (NIXL over UCX on CPU)."""
    if settings.role not in (Role.PREFILL, Role.DECODE):
        return None
    from vllm.config import KVTransferConfig

    _set_nixl_environment(settings)
    producer = settings.role is Role.PREFILL
    return KVTransferConfig(
        kv_connector=settings.kv_connector,
        kv_connector_module_path=_nixl_module_path(settings),
        kv_role="kv_producer" if producer else "kv_consumer",
        kv_buffer_device="cpu",
        kv_connector_extra_config={"backends": ["UCX"]},
        # decode recomputes the prompt when the prefill that holds its KV is gone
        kv_load_failure_policy="fail" if producer else "recompute",
    )


def _nixl_module_path(settings: Settings) -> str | None:
    """On CPU, vLLM's own NIXL connectors come from :mod:`workers.engines.vllm.nixl_connector`:
    the same classes, but NIXL's UCX progress thread (which busy-polls a whole core per
    engine, idle or not) is off and the engine step drives UCX progress instead."""
    from vllm.platforms import current_platform

    names = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")
    if current_platform.is_cpu() and settings.kv_connector in names:
        return "workers.engines.vllm.nixl_connector"
    return None


def _set_nixl_environment(settings: Settings) -> None:
    port = settings.kv_side_channel_port or _free_port()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", side_channel_host(settings))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores_spec(engine_cores(settings))


def side_channel_host(settings: Settings) -> str:
    """Where decode workers reach this prefill worker's NIXL side channel: the configured
    address, or with `auto` this host's address (:mod:`workers.engines.host_address`; in a
    container, its own address on its network)."""
    return advertised_host(settings.kv_side_channel_host)


def engine_cores(settings: Settings) -> list[int]:
    """The cores an engine's model threads keep to.

    Prefill takes the lower half, decode the upper: NIXL moves the model thread onto
    the last core (and its UCX progress thread spun then, see nixl_connector); measured
    here, an unpinned pair made each engine step ~100x slower and the first decode wait
    ~30 s for the prefill's KV lease to expire. Any other engine takes every core but
    the first, which stays free for the event loops beside it (this worker's, the
    gateway's, Redis): a model thread that shares its core with them waits for them
    every step.
    """
    if settings.cpu_omp_threads_bind:
        return parse_cores(settings.cpu_omp_threads_bind)
    cores = available_cores()
    if settings.role not in (Role.PREFILL, Role.DECODE):
        return engine_core_slices(cores, 1)[0]
    half = max(1, len(cores) // 2)
    chosen = cores[:half] if settings.role is Role.PREFILL else cores[half:] or cores[-1:]
    return chosen


def place_engine(settings: Settings) -> None:
    """On CPU: the model runs on :func:`engine_cores`, inside vLLM's engine-core process
    unless ``cpu_engine_in_process`` is off.

    vLLM's CPU platform otherwise always adds a separate model-worker process beside the
    engine core, and every step crosses between the two; that process also busy-polls
    its queue for 1 s after each step (vLLM's shm broadcast), so an idle prefill/decode
    pair burned ~0.2 cores on its 10-s canaries alone. In-process, vLLM does not bind
    OpenMP threads itself, so the standard OpenMP variables do it (the engine core is
    spawned after this, and reads them when it starts).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    cores = engine_cores(settings)
    if not settings.cpu_engine_in_process:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores_spec(cores)
        return
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    os.environ["OMP_PLACES"] = ",".join(f"{{{core}}}" for core in cores)
    os.environ["OMP_PROC_BIND"] = "close"


def pin_process_tree(cores: list[int]) -> None:
    """Pin every thread of this process and its children (the engine core) to ``cores``."""
    import psutil

    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            for thread in process.threads():
                os.sched_setaffinity(thread.id, set(cores))
        except (psutil.Error, OSError) as exc:
            log.warning("could not pin %s to cores %s: %s", process.pid, cores, exc)


def _free_port() -> int:
    """A free port for NIXL's side channel, from below the kernel's ephemeral range.

    The engine binds it seconds later; a port from the ephemeral range could meanwhile
    become the local end of some outgoing connection (seen here: the replacement of a
    killed prefill worker hung at start-up on "Address already in use")."""
    low = _ephemeral_low()
    candidates = list(range(max(10_000, low - 12_000), low))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # nothing free below the range: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
