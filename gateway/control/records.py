"""What the control plane knows about a key, and who a request acts as.

``KeyRecord`` is an API key as stored (minus nothing but the ORM); ``Principal`` is
what authentication hands the request path: the key's id, scopes, allowed models and
limits. Both are frozen: the key cache shares one Principal between requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from gateway.control.key_secrets import masked
from gateway.db.models import ApiKeyRow
from shared.errors import InvalidRequest

# Re-exported: their home is shared.queue.key_limits (admission counts them in Redis).
from shared.queue.key_limits import BudgetPeriod as BudgetPeriod
from shared.queue.key_limits import Limits as Limits


class Scope(StrEnum):
    INFERENCE = "inference"
    """/v1/*"""
    METRICS = "metrics"
    """/metrics"""
    ADMIN = "admin"
    """/admin/*, and every other scope."""


def parse_scopes(values: Iterable[str], *, param: str = "scopes") -> frozenset[Scope]:
    scopes: set[Scope] = set()
    for value in values:
        name = value.strip().lower()
        if not name:
            continue
        try:
            scopes.add(Scope(name))
        except ValueError:
            known = ", ".join(scope.value for scope in Scope)
            raise InvalidRequest(f"unknown scope {value!r} (known: {known})", param=param) from None
    if not scopes:
        raise InvalidRequest("a key needs at least one scope", param=param)
    return frozenset(scopes)


UNLIMITED = Limits()


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts as. ``key_id`` is None when auth is off (anonymous)."""

    key_id: str | None
    name: str
    scopes: frozenset[Scope]
    models: frozenset[str] | None
    """Models the key may use; None: every model."""
    limits: Limits
    masked_key: str | None = None

    def has_scope(self, scope: Scope) -> bool:
        return Scope.ADMIN in self.scopes or scope in self.scopes

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


ANONYMOUS = Principal(None, "anonymous", frozenset({Scope.ADMIN}), None, UNLIMITED)
"""The principal of every request while auth is off."""

ADMIN_KEY_ID = "admin"
"""The id CONVEYOR_ADMIN_KEY acts under (it has no row: it is never stored)."""


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: str
    name: str
    secret_hash: str
    prefix: str
    suffix: str
    scopes: frozenset[Scope]
    models: frozenset[str] | None
    limits: Limits
    expires_at: datetime | None
    revoked_at: datetime | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: ApiKeyRow) -> KeyRecord:
        return cls(
            id=row.id,
            name=row.name,
            secret_hash=row.secret_hash,
            prefix=row.prefix,
            suffix=row.suffix,
            scopes=frozenset(Scope(scope) for scope in row.scopes),
            models=frozenset(row.models) if row.models is not None else None,
            limits=Limits(
                rpm=row.rpm,
                tpm=row.tpm,
                max_concurrent=row.max_concurrent,
                budget_tokens=row.budget_tokens,
                budget_period=BudgetPeriod(row.budget_period) if row.budget_period else None,
            ),
            expires_at=row.expires_at,
            revoked_at=row.revoked_at,
            created_at=row.created_at,
            updated_at=row.updated_at,
        )

    @property
    def masked_key(self) -> str:
        return masked(self.prefix, self.suffix)

    def expired(self, now: datetime) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def principal(self) -> Principal:
        return Principal(self.id, self.name, self.scopes, self.models, self.limits, self.masked_key)

    def to_json(self, now: datetime) -> dict[str, Any]:
        """The public view (/admin/keys, the CLI): never the hash."""
        return {
            "object": "api_key",
            "id": self.id,
            "name": self.name,
            "masked_key": self.masked_key,
            "scopes": sorted(self.scopes),
            "models": sorted(self.models) if self.models is not None else None,
            **self.limits.to_json(),
            "status": self.status(now),
            "expires_at": _iso(self.expires_at),
            "revoked_at": _iso(self.revoked_at),
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
        }

    def status(self, now: datetime) -> str:
        if self.revoked_at is not None:
            return "revoked"
        return "expired" if self.expired(now) else "active"


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
