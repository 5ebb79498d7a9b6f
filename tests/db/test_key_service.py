"""API keys through the service (what /admin/keys and the CLI use), on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from gateway.control import key_secrets
from gateway.control.key_service import KeyService, KeySpec
from gateway.control.records import BudgetPeriod, Limits, Scope
from gateway.db.engine import Database
from gateway.db.models import ApiKeyRow
from shared.errors import ApiKeyNotFound, ApiKeyRevoked, InvalidRequest

INFERENCE = frozenset({Scope.INFERENCE})


@pytest.fixture
def service(database: Database) -> KeyService:
    return KeyService(database.sessions, None)


async def test_create_returns_the_secret_once_and_stores_only_its_hash(
    service: KeyService, database: Database
) -> None:
    created = await service.create(KeySpec("team-a", INFERENCE))
    assert key_secrets.well_formed(created.secret)
    assert created.record.id.startswith("key_")
    async with database.sessions() as session:
        row = (await session.scalars(select(ApiKeyRow))).one()
    assert row.secret_hash == key_secrets.hash_secret(created.secret)
    stored = " ".join(str(getattr(row, c.key)) for c in ApiKeyRow.__table__.columns)
    assert created.secret not in stored
    assert created.secret[8:-4] not in stored  # the masked form shows 8 + 4 characters only
    assert created.record.masked_key == f"{created.secret[:8]}\u2026{created.secret[-4:]}"


async def test_every_field_round_trips(service: KeyService) -> None:
    expires = datetime(2999, 1, 2, 3, 4, 5, tzinfo=UTC)
    limits = Limits(
        rpm=60,
        tpm=10_000,
        max_concurrent=4,
        budget_tokens=5_000_000,
        budget_period=BudgetPeriod.MONTH,
    )
    spec = KeySpec(
        "full",
        frozenset({Scope.INFERENCE, Scope.METRICS}),
        frozenset({"m1", "m2"}),
        limits,
        expires,
    )
    created = await service.create(spec)
    record = await service.get(created.record.id)
    assert record == created.record
    assert (record.name, record.scopes, record.models, record.limits, record.expires_at) == (
        "full",
        spec.scopes,
        spec.models,
        limits,
        expires,
    )
    assert record.created_at.tzinfo is not None and record.revoked_at is None


async def test_list_update_and_revoke(service: KeyService) -> None:
    first = (await service.create(KeySpec("a", INFERENCE))).record
    second = (await service.create(KeySpec("b", INFERENCE, limits=Limits(rpm=5)))).record
    assert [r.id for r in await service.list_keys()] == [first.id, second.id]

    updated = await service.update(second.id, {"rpm": None, "tpm": 100, "name": "b2"})
    assert (updated.name, updated.limits.rpm, updated.limits.tpm) == ("b2", None, 100)
    assert updated.updated_at >= second.updated_at

    revoked = await service.revoke(first.id)
    assert revoked.revoked_at is not None
    assert (await service.revoke(first.id)).revoked_at == revoked.revoked_at  # idempotent
    assert [r.id for r in await service.list_keys()] == [second.id]
    assert len(await service.list_keys(include_revoked=True)) == 2
    with pytest.raises(ApiKeyRevoked):
        await service.update(first.id, {"rpm": 1})


async def test_unknown_key_is_not_found(service: KeyService) -> None:
    for call in (service.get, service.revoke):
        with pytest.raises(ApiKeyNotFound) as caught:
            await call("key_000000000000")
        assert caught.value.param == "id"


@pytest.mark.parametrize(
    ("spec", "param"),
    [
        (KeySpec("", INFERENCE), "name"),
        (KeySpec("x" * 201, INFERENCE), "name"),
        (KeySpec("ok", frozenset()), "scopes"),
        (KeySpec("ok", INFERENCE, frozenset()), "models"),
        (KeySpec("ok", INFERENCE, limits=Limits(rpm=0)), "rpm"),
        (KeySpec("ok", INFERENCE, limits=Limits(max_concurrent=2**31)), "max_concurrent"),
        (KeySpec("ok", INFERENCE, limits=Limits(budget_tokens=5)), "budget_period"),
        (KeySpec("ok", INFERENCE, limits=Limits(budget_period=BudgetPeriod.DAY)), "budget_tokens"),
        (
            KeySpec("ok", INFERENCE, expires_at=datetime.now(UTC) - timedelta(seconds=1)),
            "expires_at",
        ),
        (KeySpec("ok", INFERENCE, expires_at=datetime(2999, 1, 1)), "expires_at"),
    ],
)
async def test_bad_input_names_the_field(service: KeyService, spec: KeySpec, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        await service.create(spec)
    assert caught.value.param == param
    assert await service.list_keys(include_revoked=True) == []


async def test_an_update_is_checked_as_a_whole(service: KeyService) -> None:
    key = (await service.create(KeySpec("a", INFERENCE))).record
    with pytest.raises(InvalidRequest) as caught:
        await service.update(key.id, {"budget_tokens": 10})
    assert caught.value.param == "budget_period"
    assert (await service.get(key.id)).limits.budget_tokens is None
