"""``conveyor lora add|rm|ls``: the LoRA registry from the shell.

Like ``conveyor keys`` these talk to the database directly and to Redis, through the same
:class:`~gateway.control.lora_service.LoraService` the gateway's ``/admin/loras`` uses:
``add`` registers, publishes and waits until a live worker reports the adapter loaded (or
rolls back and says why); ``rm`` unregisters (workers finish its requests, then unload
it); ``ls`` lists the registry with each worker's state. Running gateways pick changes
up from Redis within a second.

The base models ``add`` accepts: the served model of these settings (``--model`` /
``--served-model-name``) and every model a live aggregated worker serves. A base model
listed in ``CONVEYOR_MODEL_REDIS_URLS`` has its desired state published to its own Redis
(where its workers read it), as the gateway does.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC
from pathlib import Path
from typing import Any

from gateway.control.lora_service import LoraService
from shared.connections.connect import connect
from shared.connections.model_redis import ModelRedis
from shared.queue.liveness import WorkerRegistry
from shared.queue.lora_registry import SERVING_ROLE, LoraSpec
from shared.settings import Settings


def add_lora_commands(sub: Any, connection: argparse.ArgumentParser, help_text: str) -> None:
    lora = sub.add_parser("lora", help=help_text, description=help_text)
    lora_sub = lora.add_subparsers(dest="lora_command", required=True)
    add = lora_sub.add_parser(
        "add", parents=[connection], help="register an adapter; wait until a worker loaded it"
    )
    add.add_argument("name", help="the model name clients will send for it")
    add.add_argument("path", type=Path, help="the PEFT adapter folder (made absolute)")
    add.add_argument("--base-model", help="its base model's served name (default: this one)")
    remove = lora_sub.add_parser("rm", parents=[connection], help="unregister an adapter")
    remove.add_argument("name")
    listing = lora_sub.add_parser("ls", parents=[connection], help="the registry, per worker")
    listing.add_argument("--json", action="store_true")


async def run_lora(args: argparse.Namespace, settings: Settings) -> int:
    from conveyor.admin_session import CliError, open_control

    async with open_control(settings) as (database, redis):
        if redis is None:
            raise CliError("Redis is needed to reach the workers")
        urls = settings.model_redis_map()
        model_redis = ModelRedis(settings.redis_url, urls, connect, home=redis)
        try:
            live = [
                worker
                for client in model_redis.by_url.values()
                for worker in await WorkerRegistry(client, ttl_s=1.0).live_workers()
            ]
            served = {w.model for w in live if w.role is SERVING_ROLE} | {settings.served_name()}
            service = LoraService(
                database.sessions,
                redis,
                bases=lambda: served,
                load_timeout_s=settings.lora_load_timeout_s,
                roots=settings.lora_root_paths(),
                redis_for=model_redis.for_model,
            )
            return await _run(service, args, settings)
        finally:
            for client in model_redis.by_url.values():
                if client is not redis:
                    await client.aclose()


async def _run(service: LoraService, args: argparse.Namespace, settings: Settings) -> int:
    if args.lora_command == "add":
        return await _add(service, args, settings)
    if args.lora_command == "rm":
        spec = await service.unregister(args.name)
        print(f"removed {spec.name} (was {spec.path} for {spec.base_model})")
        return 0
    return await _list(service, as_json=args.json)


async def _add(service: LoraService, args: argparse.Namespace, settings: Settings) -> int:
    spec = LoraSpec(
        name=args.name,
        path=str(args.path.expanduser().resolve()),
        base_model=args.base_model or settings.served_name(),
    )
    rollout = await service.register(spec)
    print(f"{spec.name}: {spec.path} for {spec.base_model}")
    print(f"loaded on: {', '.join(rollout.loaded)}")
    for worker, reason in sorted(rollout.failed.items()):
        print(f"failed on {worker}: {reason}")
    if rollout.pending:
        print(f"still loading on: {', '.join(rollout.pending)}")
    return 0


async def _list(service: LoraService, *, as_json: bool) -> int:
    registered = await service.list_registered()
    if as_json:
        rows = [
            {
                "name": r.spec.name,
                "path": r.spec.path,
                "base_model": r.spec.base_model,
                "created": r.created_at.astimezone(UTC).isoformat(timespec="seconds"),
                "workers": r.workers,
            }
            for r in registered
        ]
        print(json.dumps(rows, indent=2))
        return 0
    if not registered:
        print("no LoRA adapters registered")
    for r in registered:
        since = r.created_at.astimezone(UTC).isoformat(timespec="seconds")
        print(f"{r.spec.name}  base {r.spec.base_model}  {r.spec.path}  (since {since})")
        for worker, state in r.workers.items():
            print(f"    {worker}: {state}")
        if not r.workers:
            print("    no live worker of its base model")
    return 0


DEMO_LORA_NAME = "demo-lora"


def preload_demo_lora(settings: Settings) -> None:
    """``conveyor up --lora-demo``: write a random adapter for the model (once) and register
    and publish it before any worker starts, so every worker loads it before it is ready
    and it is listed in /v1/models. Problems are logged: the stack starts without it."""
    import asyncio
    import logging

    log = logging.getLogger("conveyor")
    try:
        asyncio.run(_preload(settings))
    except Exception as exc:  # a demo convenience never stops `up`
        log.error("demo LoRA adapter not preloaded: %s", exc)


async def _preload(settings: Settings) -> None:
    import logging

    from conveyor.admin_session import open_control
    from shared.demo.lora import write_demo_lora

    folder = (settings.data_dir / DEMO_LORA_NAME).resolve()
    if not (folder / "adapter_config.json").exists():
        write_demo_lora(folder, base=Path(str(settings.model)))
    spec = LoraSpec(name=DEMO_LORA_NAME, path=str(folder), base_model=settings.served_name())
    async with open_control(settings) as (database, redis):
        if redis is None:
            raise RuntimeError("no Redis client")
        service = LoraService(
            database.sessions,
            redis,
            bases=lambda: [spec.base_model],
            load_timeout_s=settings.lora_load_timeout_s,
            roots=settings.lora_root_paths(),
        )
        added = await service.add_if_absent(spec)
        await service.publish(spec.base_model)
    logging.getLogger("conveyor").info(
        "demo LoRA adapter %r (%s) %s; its output is noise",
        spec.name,
        folder,
        "registered" if added else "already registered",
    )
