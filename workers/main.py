"""`conveyor worker`: load the role's engine (:mod:`workers.roles.table`) and run the
worker loop until SIGTERM."""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import socket
import sys
import uuid
from typing import NoReturn

import uvloop

from shared.connections.connect import connect
from shared.heap import freeze_startup_heap
from shared.roles import Role
from shared.settings import EngineKind, Settings
from shared.tracing.tracer import build_tracer
from workers.assembly import WorkerPolicy, build_worker
from workers.roles.table import ROLES

log = logging.getLogger(__name__)

EXIT_CONFIG_ERROR = 2
"""Exit code for 'cannot start as configured' (conveyor up does not restart it)."""


def new_worker_id(role: Role) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def model_of(settings: Settings) -> tuple[str, str]:
    """(model folder, served name) this worker loads: the embedding model for --role embed."""
    if settings.role is Role.EMBED:
        path, name = settings.embed_model_path(), settings.embed_served_name()
        if path is None or name is None:
            raise ValueError("--role embed needs --embed-model (a folder, or `default`)")
        return path, name
    if settings.model is None:
        raise ValueError("no model: set --model (`conveyor worker` serves the demo model then)")
    return settings.model, settings.served_name()


async def serve(settings: Settings) -> int:
    try:
        model_path, served_name = model_of(settings)
    except (ValueError, ImportError) as exc:
        log.error("worker has no model to load: %s", exc)
        return EXIT_CONFIG_ERROR
    if settings.engine_args.strip() and settings.engine is not EngineKind.VLLM:
        log.error("engine arguments (--engine-args, flags after --) are for --engine vllm")
        return EXIT_CONFIG_ERROR
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # A signal during the (blocking) engine load is handled right after it, so the
        # engine is shut down properly instead of being orphaned.
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        loaded = ROLES[settings.role](settings, model_path, served_name)
    except Exception as exc:
        log.error("worker could not load model %s: %s", model_path, _one_line(exc))
        return EXIT_CONFIG_ERROR
    await asyncio.sleep(0)
    if stop_requested.is_set():
        loaded.engine.shutdown()
        return 0
    redis = connect(settings.redis_url)
    worker_id = new_worker_id(settings.role)
    tracer = build_tracer(
        settings.otlp_endpoint, settings.trace_sample_ratio, "conveyor-worker", worker_id
    )
    runtime = build_worker(
        worker_id=worker_id,
        role=settings.role,
        model=served_name,
        parts=loaded.connect(redis),
        redis=redis,
        policy=WorkerPolicy.from_settings(settings),
        heartbeat_redis_url=settings.redis_url,
        tracer=tracer,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, runtime.stop)
    freeze_startup_heap()
    try:
        await runtime.run()
    finally:
        loaded.engine.shutdown()
        await redis.aclose()
        tracer.shutdown()
    return 1 if runtime.engine_dead or runtime.journal_failed else 0


def run_worker(settings: Settings) -> NoReturn:
    # uvloop, as vLLM's own server runs AsyncLLM: less CPU per token beside the engine.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        code = runner.run(serve(settings))
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """Exit as the interpreter would, less its finalization: the full garbage collection of
    a heap holding torch and vLLM takes seconds, and nanobind lists every Triton object it
    finds alive at exit (the start-up heap is frozen, see shared/heap.py). The exit
    handlers still run: logging flushes, multiprocessing releases its semaphores."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines()]
    useful = [line for line in lines if line and not line.startswith("For further information")]
    return f"{type(exc).__name__}: {' | '.join(useful)[:500]}"


if __name__ == "__main__":
    run_worker(Settings())
