"""``conveyor db|keys|usage|lora``: the control plane from the command line.

These talk to the database directly (CONVEYOR_DATABASE_URL, default the embedded
SQLite file, which they migrate to head like the gateway does) and announce key
changes to the running gateways through Redis (best effort: with Redis down the
gateways pick changes up on their periodic full reload).

``keys create`` prints the new secret alone on its last line, so scripts can take
it with ``tail -n 1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any, cast

from conveyor.admin_output import print_key, print_key_table, print_usage, warn_unannounced
from conveyor.admin_session import CliError, open_control
from conveyor.lora_cli import add_lora_commands, run_lora
from gateway.control.key_service import KeyService, KeySpec, KeyUpdate
from gateway.control.records import BudgetPeriod, Limits, parse_scopes
from gateway.control.times import parse_instant
from gateway.control.usage_report import usage_report
from gateway.db import schema
from gateway.db.engine import open_database
from gateway.db.usage_repo import GroupBy, UsageFilter
from shared.errors import ConveyorError, InvalidRequest
from shared.settings import Settings

ADMIN_COMMANDS = {
    "db": "show or migrate the database schema (Alembic)",
    "keys": "create, list, show, update and revoke API keys",
    "usage": "usage ledger: rows or totals per day/key/model",
    "lora": "add, remove and list LoRA adapters (the registry the workers load)",
}

LIMIT_FLAGS = ("rpm", "tpm", "max_concurrent", "budget_tokens")


# ------------------------------------------------------------------------- parser


def add_admin_commands(sub: Any) -> None:
    """Add ``db``, ``keys`` and ``usage`` to the ``conveyor`` sub-command parser."""
    connection = argparse.ArgumentParser(add_help=False)
    group = connection.add_argument_group("where (flag > CONVEYOR_* environment > default)")
    group.add_argument(
        "--database-url",
        metavar="URL",
        help="[env CONVEYOR_DATABASE_URL; default <data-dir>/conveyor.db]",
    )
    group.add_argument("--redis-url", metavar="URL", help="[env CONVEYOR_REDIS_URL]")
    group.add_argument("--data-dir", metavar="PATH", help="[env CONVEYOR_DATA_DIR]")

    db = sub.add_parser("db", help=ADMIN_COMMANDS["db"], description=ADMIN_COMMANDS["db"])
    db_sub = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_sub.add_parser("upgrade", parents=[connection], help="migrate to REV (head)")
    upgrade.add_argument("revision", nargs="?", default="head")
    db_sub.add_parser("current", parents=[connection], help="the schema's revision and head")
    downgrade = db_sub.add_parser("downgrade", parents=[connection], help="migrate down to REV")
    downgrade.add_argument("revision", help="a revision id, or `base` (drops every table)")

    keys = sub.add_parser("keys", help=ADMIN_COMMANDS["keys"], description=ADMIN_COMMANDS["keys"])
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", parents=[connection], help="create a key")
    create.add_argument("--name", required=True)
    create.add_argument("--scopes", default="inference", help="inference,metrics,admin")
    _add_key_flags(create, clearable=False)
    listing = keys_sub.add_parser("list", parents=[connection], help="list keys")
    listing.add_argument("--all", action="store_true", help="revoked keys too")
    listing.add_argument("--json", action="store_true")
    show = keys_sub.add_parser("show", parents=[connection], help="one key")
    show.add_argument("id")
    show.add_argument("--json", action="store_true")
    update = keys_sub.add_parser(
        "update", parents=[connection], help="change a key's name, scopes, models, limits or expiry"
    )
    update.add_argument("id")
    update.add_argument("--name")
    update.add_argument("--scopes")
    _add_key_flags(update, clearable=True)
    revoke = keys_sub.add_parser("revoke", parents=[connection], help="revoke a key")
    revoke.add_argument("id")

    usage = sub.add_parser(
        "usage",
        parents=[connection],
        help=ADMIN_COMMANDS["usage"],
        description=ADMIN_COMMANDS["usage"],
    )
    usage.add_argument("--key", help="a key id")
    usage.add_argument("--model")
    usage.add_argument("--since", help="ISO 8601, unix seconds, or a duration ago (7d)")
    usage.add_argument("--until", help="same forms as --since")
    usage.add_argument("--group-by", choices=[g.value for g in GroupBy])
    usage.add_argument("--limit", type=int, default=50, help="rows without --group-by")
    usage.add_argument("--json", action="store_true")
    add_lora_commands(sub, connection, ADMIN_COMMANDS["lora"])


def _add_key_flags(parser: argparse.ArgumentParser, *, clearable: bool) -> None:
    none = " (`none`: no limit)" if clearable else ""
    for flag in LIMIT_FLAGS:
        parser.add_argument("--" + flag.replace("_", "-"), metavar="N", help=f"{flag}{none}")
    parser.add_argument("--budget-period", choices=[p.value for p in BudgetPeriod])
    parser.add_argument(
        "--models",
        help="models the key may use, comma-separated"
        + (" (`all`: every model)" if clearable else " (default: every model)"),
    )
    parser.add_argument(
        "--expires",
        help="a duration from now (30d) or a time (ISO 8601)"
        + (" (`never`: no expiry)" if clearable else ""),
    )


# ------------------------------------------------------------------------- running


def run_admin(args: argparse.Namespace, settings: Settings) -> int:
    commands: dict[str, Callable[[argparse.Namespace, Settings], Coroutine[Any, Any, int]]] = {
        "db": _db,
        "keys": _keys,
        "usage": _usage,
        "lora": run_lora,
    }
    try:
        return asyncio.run(commands[args.command](args, settings))
    except InvalidRequest as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    except (ConveyorError, CliError) as exc:
        print(f"error: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 1


async def _db(args: argparse.Namespace, settings: Settings) -> int:
    database = open_database(settings.database_url_or_default())
    try:
        before = await schema.current_revision(database.engine)
        if args.db_command == "upgrade":
            await schema.upgrade(database.engine, args.revision)
        elif args.db_command == "downgrade":
            await schema.downgrade(database.engine, args.revision)
        status = await schema.schema_status(database.engine)
    finally:
        await database.dispose()
    print(f"database: {database.url}")
    if args.db_command != "current":
        print(f"migrated: {before or 'empty'} -> {status.current or 'empty'}")
    print(f"current: {status.current or 'empty'}\nhead: {status.head}")
    if args.db_command == "current" and not status.at_head:
        print(status.problem())
    return 0


async def _keys(args: argparse.Namespace, settings: Settings) -> int:
    async with open_control(settings) as (database, redis):
        service = KeyService(database.sessions, redis)
        now = datetime.now(UTC)
        if args.keys_command == "create":
            created = await service.create(_spec(args, now))
            print_key(created.record, now)
            warn_unannounced(service)
            print("The secret is shown once (only its hash is stored); it is the next line:")
            print(created.secret)
            return 0
        if args.keys_command == "list":
            records = await service.list_keys(include_revoked=args.all)
            if args.json:
                print(json.dumps([record.to_json(now) for record in records], indent=2))
            else:
                print_key_table(records, now)
            return 0
        if args.keys_command == "show":
            record = await service.get(args.id)
        elif args.keys_command == "update":
            record = await service.update(args.id, _changes(args, now))
        else:
            record = await service.revoke(args.id)
        if getattr(args, "json", False):
            print(json.dumps(record.to_json(now), indent=2))
        else:
            print_key(record, now)
        if args.keys_command in ("update", "revoke"):
            warn_unannounced(service)
        return 0


async def _usage(args: argparse.Namespace, settings: Settings) -> int:
    now = datetime.now(UTC)
    where = UsageFilter(
        key_id=args.key,
        model=args.model,
        since=parse_instant(args.since, param="since", now=now) if args.since else None,
        until=parse_instant(args.until, param="until", now=now) if args.until else None,
    )
    group_by = GroupBy(args.group_by) if args.group_by else None
    if not 0 < args.limit <= 100_000:
        raise InvalidRequest("--limit must be 1 to 100000", param="limit")
    async with open_control(settings, redis_needed=False) as (database, _):
        report = await usage_report(database.sessions, where, group_by, args.limit)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_usage(report)
    return 0


# ------------------------------------------------------------------------- arguments


def _spec(args: argparse.Namespace, now: datetime) -> KeySpec:
    return KeySpec(
        name=args.name,
        scopes=parse_scopes(args.scopes.split(",")),
        models=_models(args.models),
        limits=Limits(
            **{flag: _count(getattr(args, flag), flag) for flag in LIMIT_FLAGS},
            budget_period=BudgetPeriod(args.budget_period) if args.budget_period else None,
        ),
        expires_at=_expiry(args.expires, now),
    )


def _changes(args: argparse.Namespace, now: datetime) -> KeyUpdate:
    changes: dict[str, Any] = {}
    if args.name is not None:
        changes["name"] = args.name
    if args.scopes is not None:
        changes["scopes"] = parse_scopes(args.scopes.split(","))
    if args.models is not None:
        changes["models"] = None if args.models.strip() == "all" else _models(args.models)
    for flag in LIMIT_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            changes[flag] = None if value.strip() == "none" else _count(value, flag)
    if args.budget_period is not None:
        changes["budget_period"] = BudgetPeriod(args.budget_period)
    if args.expires is not None:
        never = args.expires.strip() == "never"
        changes["expires_at"] = None if never else _expiry(args.expires, now)
    if not changes:
        raise InvalidRequest("nothing to change: give at least one flag", param="id")
    return cast(KeyUpdate, changes)


def _count(value: str | None, flag: str) -> int | None:
    if value is None:
        return None
    if not value.strip().isdigit():
        raise InvalidRequest(f"--{flag.replace('_', '-')} must be a whole number", param=flag)
    return int(value)


def _models(value: str | None) -> frozenset[str] | None:
    if value is None:
        return None
    return frozenset(name.strip() for name in value.split(",") if name.strip())


def _expiry(value: str | None, now: datetime) -> datetime | None:
    if value is None:
        return None
    return parse_instant(value, param="expires_at", now=now, ago=False)
