"""Every /admin/* route: API keys, usage, and what this gateway holds (/admin/state).

All of them need a key with the ``admin`` scope when auth is on. Errors are
OpenAI-shaped (the funnel in gateway/error_handlers.py): bad input is a 400 naming
the field in ``param``, an unknown key id a 404, a change to a revoked key a 409.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, cast

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, StrictInt

from gateway.auth import require_scope
from gateway.control.key_service import KeySpec, KeyUpdate
from gateway.control.plane import ControlPlane
from gateway.control.records import BudgetPeriod, Limits, Scope, parse_scopes
from gateway.control.times import parse_instant
from gateway.control.usage_report import usage_report
from gateway.db.usage_repo import GroupBy, UsageFilter
from gateway.state import GatewayState, StateDep
from shared.errors import DatabaseUnavailable, InvalidRequest
from shared.roles import Role

router = APIRouter(prefix="/admin", dependencies=[Depends(require_scope(Scope.ADMIN))])

MAX_USAGE_ROWS = 1000
_ROW_COUNT = re.compile(r"[0-9]{1,9}")


async def _control(state: StateDep) -> ControlPlane:
    if state.control is None:
        raise DatabaseUnavailable("the control plane is not started yet", retry_after_s=1)
    return state.control


ControlDep = Annotated[ControlPlane, Depends(_control)]


class _KeyFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[str] | None = None
    rpm: StrictInt | None = None
    tpm: StrictInt | None = None
    max_concurrent: StrictInt | None = None
    budget_tokens: StrictInt | None = None
    budget_period: Literal["day", "month"] | None = None
    expires_at: datetime | None = None


class KeyCreateBody(_KeyFields):
    name: str
    scopes: list[str] = [Scope.INFERENCE.value]

    def spec(self) -> KeySpec:
        return KeySpec(
            name=self.name,
            scopes=parse_scopes(self.scopes),
            models=frozenset(self.models) if self.models is not None else None,
            limits=Limits(
                rpm=self.rpm,
                tpm=self.tpm,
                max_concurrent=self.max_concurrent,
                budget_tokens=self.budget_tokens,
                budget_period=BudgetPeriod(self.budget_period) if self.budget_period else None,
            ),
            expires_at=self.expires_at,
        )


class KeyUpdateBody(_KeyFields):
    name: str | None = None
    scopes: list[str] | None = None

    def changes(self) -> KeyUpdate:
        """Only the fields the request names; an explicit null clears a limit or expiry."""
        changes: dict[str, Any] = {}
        for field in self.model_fields_set:
            value = getattr(self, field)
            if field in ("name", "scopes") and value is None:
                raise InvalidRequest(f"{field} cannot be null", param=field)
            if field == "scopes":
                value = parse_scopes(value)
            elif field == "models":
                value = frozenset(value) if value is not None else None
            elif field == "budget_period":
                value = BudgetPeriod(value) if value is not None else None
            changes[field] = value
        return cast(KeyUpdate, changes)


@router.post("/keys", status_code=201)
async def create_key(body: KeyCreateBody, control: ControlDep) -> dict[str, Any]:
    """The answer carries the secret once, as ``key``; only its hash is stored."""
    created = await control.key_service.create(body.spec())
    return {**created.record.to_json(_now()), "key": created.secret}


@router.get("/keys")
async def list_keys(control: ControlDep, include_revoked: bool = False) -> dict[str, Any]:
    records = await control.key_service.list_keys(include_revoked=include_revoked)
    now = _now()
    return {"object": "list", "data": [record.to_json(now) for record in records]}


@router.get("/keys/{key_id}")
async def get_key(key_id: str, control: ControlDep) -> dict[str, Any]:
    return (await control.key_service.get(key_id)).to_json(_now())


@router.patch("/keys/{key_id}")
async def update_key(key_id: str, body: KeyUpdateBody, control: ControlDep) -> dict[str, Any]:
    return (await control.key_service.update(key_id, body.changes())).to_json(_now())


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, control: ControlDep) -> dict[str, Any]:
    """Revoke (keys are never deleted: the ledger keeps naming them)."""
    return (await control.key_service.revoke(key_id)).to_json(_now())


@router.get("/usage")
async def usage(
    control: ControlDep,
    key: str | None = None,
    model: str | None = None,
    since: str | None = None,
    until: str | None = None,
    group_by: str | None = None,
    limit: str | None = None,
) -> dict[str, Any]:
    """Rows (newest first, ``limit`` of them) or totals per day / key / model, always with
    the grand total of the filter. Times: ISO 8601, unix seconds, or ``7d`` ago."""
    now = _now()
    where = UsageFilter(
        key_id=key,
        model=model,
        since=parse_instant(since, param="since", now=now) if since else None,
        until=parse_instant(until, param="until", now=now) if until else None,
    )
    return await usage_report(control.database.sessions, where, _group_by(group_by), _limit(limit))


@router.get("/state")
async def admin_state(state: StateDep) -> dict[str, Any]:
    """What this gateway holds right now (for operators and leak checks)."""
    body: dict[str, Any] = {
        "gateway_id": state.gateway_id,
        "draining": state.draining,
        "open_requests": state.cells.open_requests(),
        "workers": sorted(w.worker_id for c in state.cells.all() for w in c.directory.all()),
        "pools": _pools(state),
        "placement_index": _placement_index(state),
        "placement": state.settings.placement,
        "loads": {
            worker_id: load
            for cell in state.cells.all()
            for worker_id, load in cell.directory.loads().items()
        },
    }
    if state.control is not None:
        _, body["control"] = await state.control.readiness()
        body["control"]["database"]["url"] = state.control.database.url
    return body


def _pools(state: GatewayState) -> dict[str, dict[Role, int]]:
    """Live workers per model and role, each model from its own Redis's registry."""
    pools: dict[str, dict[Role, int]] = {}
    for cell in state.cells.all():
        for model, roles in cell.directory.pools().items():
            merged = pools.setdefault(model, {})
            for role, count in roles.items():
                merged[role] = merged.get(role, 0) + count
    return pools


def _placement_index(state: GatewayState) -> dict[str, Any]:
    """The prefix index of each Redis's workers: blocks indexed per worker (-1: waiting
    for its snapshot after lost KV events), distinct blocks, blocks announced as coming
    and not stored yet, gaps seen."""
    workers: dict[str, int] = {}
    blocks = pending = gaps = 0
    for cell in state.cells.all():
        if cell.placement is not None:
            index = cell.placement.index
            workers.update(index.blocks_by_worker())
            blocks += index.blocks()
            pending += index.pending_blocks()
            gaps += index.gaps
    return {
        "workers": dict(sorted(workers.items())),
        "blocks": blocks,
        "pending": pending,
        "gaps": gaps,
    }


def _group_by(value: str | None) -> GroupBy | None:
    if not value:
        return None
    try:
        return GroupBy(value)
    except ValueError:
        raise InvalidRequest("group_by must be day, key or model", param="group_by") from None


def _limit(value: str | None) -> int:
    if value is None:
        return 100
    # ASCII digits only: str.isdigit() also passes "²", which int() refuses
    if not _ROW_COUNT.fullmatch(value) or not 0 < int(value) <= MAX_USAGE_ROWS:
        raise InvalidRequest(f"limit must be 1 to {MAX_USAGE_ROWS}", param="limit")
    return int(value)


def _now() -> datetime:
    return datetime.now(UTC)
