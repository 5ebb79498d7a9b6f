"""The `conveyor` command: up, gateway, worker, demo-model; db, keys, usage, lora (admin_cli.py).

Every setting of :class:`shared.settings.Settings` is a flag (``--redis-url``)
and an environment variable (``CONVEYOR_REDIS_URL``); flags win.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr
from pydantic.fields import FieldInfo

from conveyor.engine_flags import merged_engine_args, split_engine_flags
from conveyor.model_source import with_model
from shared.settings import SETTING_GROUPS, EngineKind, Mode, Role, Settings, own_fields

log = logging.getLogger("conveyor")

_SUBCOMMAND_HELP = {
    "up": "start Redis (if needed), the gateway and the workers; Ctrl-C stops everything",
    "gateway": "run only the HTTP gateway",
    "worker": "run only one worker (an engine for one role)",
    "demo-model": "generate the tiny random-weight demo model into PATH",
}


_PRECEDENCE = "Every setting is a flag and a CONVEYOR_* environment variable; the flag wins."


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """Every setting as a flag, in one section per group (shared.settings.SETTING_GROUPS)."""
    parser.description = f"{parser.description}. {_PRECEDENCE}"
    for title, settings_group in SETTING_GROUPS:
        who = (settings_group.__doc__ or "").replace("\n    ", " ")
        group = parser.add_argument_group(f"{title} settings", who)
        for name in own_fields(settings_group):
            _add_setting_flag(group, name, Settings.model_fields[name])


def _add_setting_flag(group: argparse._ArgumentGroup, name: str, info: FieldInfo) -> None:
    flag = "--" + name.replace("_", "-")
    env = "CONVEYOR_" + name.upper()
    help_text = f"{info.description or ''} [env {env}; default {info.default}]"
    if info.annotation is bool:  # `--encode` alone means true; `--encode false` works too
        group.add_argument(
            flag, dest=name, default=None, help=help_text, metavar="BOOL", nargs="?", const="true"
        )
        return
    group.add_argument(flag, dest=name, default=None, help=help_text, metavar="VALUE")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in _SUBCOMMAND_HELP.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name == "demo-model":
            from shared.demo.model import KINDS  # stdlib only: cheap

            command.add_argument("path", type=Path)
            command.add_argument("--seed", type=int, default=0)
            command.add_argument(
                "--kind",
                choices=(*KINDS, "lora"),
                default="llama",
                help="text (llama), vision-language (llava, qwen2-vl), or a "
                "random LoRA adapter (lora) for the model folder --base",
            )
            command.add_argument(
                "--base",
                type=Path,
                default=None,
                help="--kind lora: the Llama-family model folder the adapter "
                "is for (default: the demo model, generated if missing)",
            )
        else:
            _add_setting_flags(command)
    from conveyor.admin_cli import add_admin_commands

    add_admin_commands(sub)
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        name: getattr(args, name)
        for name in Settings.model_fields
        if getattr(args, name, None) is not None
    }
    return Settings(**overrides)


class _NoProbeAccessLog(logging.Filter):
    """Keep readiness polls out of the access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "GET /ready " not in message and "GET /health " not in message


def _setup_logging(level: str, data_dir: Path | None = None) -> Path | None:
    """shared.logs: Conveyor's lines on the console, engines' and libraries' INFO in a file."""
    from shared.logs import setup_logging

    file = setup_logging(level, data_dir)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the ready poll, every 0.5 s
    logging.getLogger("uvicorn.access").addFilter(_NoProbeAccessLog())
    return file


def main(argv: list[str] | None = None) -> int:
    argv, engine_flags = split_engine_flags(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "demo-model" and args.kind == "lora":
        _setup_logging("INFO")
        return write_lora(args.path, base=args.base, seed=args.seed)
    if args.command == "demo-model":
        _setup_logging("INFO")
        from shared.demo.model import DEMO_MODEL_NOTICE, write_demo_model

        write_demo_model(args.path, seed=args.seed, kind=args.kind)
        print(f"demo model written to {args.path}\n{DEMO_MODEL_NOTICE}")
        return 0
    settings = settings_from(args)
    if engine_flags and args.command not in ("worker", "up"):
        print("conveyor: vLLM flags after `--` are for `worker` and `up`", file=sys.stderr)
        return 2
    if engine_flags:
        try:
            engine_args = merged_engine_args(settings.engine_args, engine_flags)
        except ValueError as exc:
            print(f"conveyor: {exc}", file=sys.stderr)
            return 2
        settings = settings.model_copy(update={"engine_args": engine_args})
    if args.command in ("db", "keys", "usage", "lora"):
        from conveyor.admin_cli import run_admin

        _setup_logging("WARNING")  # stdout carries the answer; a secret on its last line
        return run_admin(args, settings)
    log_file = _setup_logging(settings.log_level, settings.data_dir)
    if args.command == "gateway":
        return run_gateway(with_model(settings))
    if args.command == "worker":
        from workers.main import run_worker

        return run_worker(settings if settings.role is Role.EMBED else with_model(settings))
    log.info(
        "engine and library logs: %s (warnings show here too; --log-level debug shows all)",
        log_file,
    )
    return run_up(settings)


def write_lora(path: Path, *, base: Path | None, seed: int) -> int:
    """`conveyor demo-model PATH --kind lora [--base MODEL_DIR]`."""
    from shared.demo.lora import write_demo_lora

    if base is None:
        from shared.demo.model import write_demo_model

        base = write_demo_model(Settings().demo_model_path())
    try:
        write_demo_lora(path, base=base, seed=seed)
    except (ValueError, FileExistsError) as exc:
        print(f"conveyor demo-model: {exc}", file=sys.stderr)
        return 2
    print(f"random LoRA adapter (rank 8) for {base} written to {path}; its output is noise")
    return 0


def run_gateway(settings: Settings) -> int:
    from gateway.server import serve

    return serve(settings)


def _settings_env(settings: Settings) -> dict[str, str]:
    env = {}
    for name, value in settings.model_dump(exclude_unset=False).items():
        if isinstance(value, SecretStr):  # str() would pass "**********" to the children
            value = value.get_secret_value()
        if value is not None:
            env["CONVEYOR_" + name.upper()] = str(value)
    return env


def _conveyor_command() -> list[str]:
    script = Path(sys.executable).with_name("conveyor")
    if script.exists():
        return [str(script)]
    found = shutil.which("conveyor")
    return [found] if found else [sys.executable, "-m", "conveyor.cli"]


def run_up(settings: Settings) -> int:
    from conveyor.redis_server import redis_answers, start_private_redis, stop_private_redis
    from conveyor.supervisor import Child, Supervisor, child_env

    if settings.model_redis_map():
        log.error(
            "`conveyor up` runs one Redis: unset CONVEYOR_MODEL_REDIS_URLS (it is for gateways "
            'whose models\' workers run on other Redis; see the docs, "More than one Redis")'
        )
        return 2
    redis_process = None
    if not redis_answers(settings.redis_url):
        redis_process = start_private_redis(settings.redis_url, settings.data_dir)
    settings = with_model(settings)
    if settings.lora_demo:
        from conveyor.lora_cli import preload_demo_lora

        settings = settings.model_copy(update={"enable_lora": True})
        preload_demo_lora(settings)
    env = child_env(_settings_env(settings))
    supervisor = Supervisor()
    command = _conveyor_command()
    roles = worker_roles(settings)
    try:
        for number, (role, worker_env) in enumerate(
            zip(roles, worker_envs(settings, roles, env), strict=True)
        ):
            supervisor.add(
                Child(
                    f"{role}-{number}",
                    [*command, "worker", "--role", role],
                    worker_env,
                    on_exit=_forget_worker(settings.redis_url),
                )
            )
        for number, gateway_env in enumerate(gateway_envs(settings, env)):
            supervisor.add(Child(f"gateway-{number}", [*command, "gateway"], gateway_env))
        return supervisor.run(tick=ReadyAnnouncer(settings))
    finally:
        supervisor.stop_all()
        if redis_process is not None:
            stop_private_redis(redis_process)


def _forget_worker(redis_url: str) -> Callable[[int], None]:
    """A dead worker leaves the registry at once, so its jobs are reclaimed at once."""

    def forget(pid: int) -> None:
        from shared.queue.liveness import forget_dead_process

        for worker_id in forget_dead_process(redis_url, pid):
            log.info("worker %s is gone; the others take over its jobs now", worker_id)

    return forget


def gateway_envs(settings: Settings, env: dict[str, str]) -> list[dict[str, str]]:
    """One environment per gateway process: several share --port with SO_REUSEPORT (each
    has its own gateway id and reply stream, as gateways on several hosts do)."""
    if settings.gateways == 1:
        return [env]
    return [{**env, "CONVEYOR_REUSE_PORT": "true"} for _ in range(settings.gateways)]


def worker_roles(settings: Settings) -> list[str]:
    """The workers `up` starts: N aggregated, or N prefill + N decode; one encode worker in
    front of them with --encode; plus one embed worker when an embedding model is set."""
    roles = [Role.ENCODE.value] if settings.encode else []
    if settings.mode is Mode.DISAGGREGATED:
        roles += [Role.PREFILL.value, Role.DECODE.value] * settings.workers
    else:
        roles += [Role.AGGREGATED.value] * settings.workers
    if settings.embed_model:
        roles.append(Role.EMBED.value)
    return roles


def worker_envs(settings: Settings, roles: list[str], env: dict[str, str]) -> list[dict[str, str]]:
    """Each worker's environment: aggregated and embed engines get disjoint core slices
    (unless --cpu-omp-threads-bind pins them all); prefill/decode split cores themselves.
    Fake engines run no model threads: they get no slice."""
    from shared.cpu_cores import available_cores, cores_spec, engine_core_slices

    if settings.engine is EngineKind.FAKE:
        return [env for _ in roles]
    sliced = {Role.AGGREGATED.value, Role.EMBED.value}
    engines = sum(role in sliced for role in roles)
    slices = iter(engine_core_slices(available_cores(), engines))
    envs = []
    for role in roles:
        if role in sliced and not settings.cpu_omp_threads_bind:
            envs.append({**env, "CONVEYOR_CPU_OMP_THREADS_BIND": cores_spec(next(slices))})
        else:
            envs.append(env)
    return envs


class ReadyAnnouncer:
    """Polled by the supervisor loop: says once when the gateway reports ready."""

    def __init__(self, settings: Settings) -> None:
        self._url = f"http://{settings.host}:{settings.port}"
        self._model = settings.served_name()
        self._done = False

    def __call__(self) -> None:
        if self._done:
            return
        try:
            ready = httpx.get(f"{self._url}/ready", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return
        if ready:
            self._done = True
            log.info(
                "Conveyor is ready: %s/v1 serving model %r. Ctrl-C stops everything.",
                self._url,
                self._model,
            )


if __name__ == "__main__":
    sys.exit(main())
