"""Per-API-key limits, counted fleet-wide in Redis, checked inside queue admission.

A request with a limited key carries a :class:`LimitCharge` into the admission
script (:mod:`shared.queue.job_queue`): in the same atomic step that queues its jobs,
the script checks and counts

- requests per minute and tokens per minute: fixed one-minute windows
  (``conveyor:limit:{key}:rpm:{minute}``), tokens reserved as prompt +
  ``max_tokens`` x choices;
- concurrent requests: a sorted set of request ids scored by a lease expiry the
  gateway renews while the request is open (a dead gateway's slots free
  themselves within one lease);
- a token budget per day or month (UTC): a counter per period.

When the request ends, :func:`settle` gives back what was reserved but not
used (the real token count replaces the reservation) and frees the
concurrency slot, on every path: finished, cancelled, failed or rejected.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec
import redis.asyncio as aioredis

from shared.errors import KeyRateLimited, QuotaExceeded
from shared.queue import names

WINDOW_S = 60
CONCURRENCY_LEASE_S = 15.0
"""A concurrency slot lives this long unless its gateway renews it (every third of it)."""

UNLIMITED = -1


class BudgetPeriod(StrEnum):
    DAY = "day"
    MONTH = "month"


class LimitKind(StrEnum):
    REQUESTS = "requests"
    TOKENS = "tokens"
    CONCURRENCY = "concurrency"
    BUDGET = "budget"


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-key limits, fleet-wide (per Redis when models have their own:
    docs/operations/several-hosts.md "More than
    one Redis"); None means unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    budget_tokens: int | None = None
    budget_period: BudgetPeriod | None = None

    def any(self) -> bool:
        return any(
            value is not None
            for value in (self.rpm, self.tpm, self.max_concurrent, self.budget_tokens)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rpm": self.rpm,
            "tpm": self.tpm,
            "max_concurrent": self.max_concurrent,
            "budget_tokens": self.budget_tokens,
            "budget_period": self.budget_period.value if self.budget_period else None,
        }


@dataclass(frozen=True, slots=True)
class LimitCharge:
    """What one request costs against its key's limits, at one moment."""

    key_id: str
    limits: Limits
    request_id: str
    cost_tokens: int
    now_unix: float

    @property
    def minute(self) -> int:
        return int(self.now_unix // WINDOW_S)

    def keys(self) -> list[str]:
        """The counters, in the order the admission script reads them."""
        budget = ""
        if self.limits.budget_tokens is not None and self.limits.budget_period is not None:
            budget = names.key_budget(
                self.key_id, period_id(self.limits.budget_period, self.now_unix)
            )
        return [
            names.key_window(self.key_id, "rpm", self.minute),
            names.key_window(self.key_id, "tpm", self.minute),
            names.key_concurrency(self.key_id),
            budget,
        ]

    def args(self) -> list[int | str]:
        """The script's limit arguments (see ``ADMIT_LIMITS_LUA``)."""
        limits = self.limits
        budget_ttl = 0
        if limits.budget_period is not None:
            budget_ttl = period_ttl_s(limits.budget_period, self.now_unix)
        return [
            _or_unlimited(limits.rpm),
            _or_unlimited(limits.tpm),
            _or_unlimited(limits.max_concurrent),
            _or_unlimited(limits.budget_tokens),
            self.cost_tokens,
            int(self.now_unix * 1000),
            int(CONCURRENCY_LEASE_S * 1000),
            WINDOW_S * 2,
            budget_ttl,
            self.request_id,
        ]

    def window_reset_s(self) -> float:
        return (self.minute + 1) * WINDOW_S - self.now_unix

    def reservation(self) -> Reservation:
        _, tpm_key, conc_key, budget_key = self.keys()
        return Reservation(self.cost_tokens, (tpm_key, conc_key, budget_key))


class Reservation(msgspec.Struct, frozen=True, array_like=True):
    """What admission took from a key's counters: enough to give it back later, from any
    gateway (it travels in the request's open record, shared/queue/open_requests.py)."""

    cost_tokens: int
    counters: tuple[str, str, str]
    """The key's TPM window, concurrency set and budget counter ('' when it has none)."""


LIMIT_ARG_COUNT = 10

# Runs inside the admission script before anything is queued. KEYS[K..K+3] (K = 4 in the
# admission script): the rpm and tpm windows, the concurrency set, the budget counter ('' =
# none). ARGV[L..L+9] (L is
# the first limit argument): rpm, tpm, concurrency, budget limits (-1 = none), token
# cost, now in ms, lease in ms, window ttl s, budget ttl s, request id.
# Sets `limited` to the name of the first limit the request would pass, and `usage` to
# the counts after the request (or now, when limited).
ADMIT_LIMITS_LUA = """
local function limits_check(K, L)
  local rpm_key, tpm_key, conc_key, budget_key = KEYS[K], KEYS[K + 1], KEYS[K + 2], KEYS[K + 3]
  local rpm, tpm = tonumber(ARGV[L]), tonumber(ARGV[L + 1])
  local conc, budget = tonumber(ARGV[L + 2]), tonumber(ARGV[L + 3])
  local cost, now_ms = tonumber(ARGV[L + 4]), tonumber(ARGV[L + 5])
  redis.call('ZREMRANGEBYSCORE', conc_key, '-inf', now_ms)
  local used = {
    tonumber(redis.call('GET', rpm_key) or '0'),
    tonumber(redis.call('GET', tpm_key) or '0'),
    redis.call('ZCARD', conc_key),
    budget_key ~= '' and tonumber(redis.call('GET', budget_key) or '0') or 0,
  }
  if rpm >= 0 and used[1] + 1 > rpm then return 'requests', used end
  if tpm >= 0 and used[2] + cost > tpm then return 'tokens', used end
  if conc >= 0 and used[3] + 1 > conc then return 'concurrency', used end
  if budget >= 0 and used[4] + cost > budget then return 'budget', used end
  return nil, used
end

local function limits_charge(K, L, used)
  local rpm_key, tpm_key, conc_key, budget_key = KEYS[K], KEYS[K + 1], KEYS[K + 2], KEYS[K + 3]
  local cost, now_ms = tonumber(ARGV[L + 4]), tonumber(ARGV[L + 5])
  local lease_ms, window_ttl = tonumber(ARGV[L + 6]), tonumber(ARGV[L + 7])
  local budget_ttl, request_id = tonumber(ARGV[L + 8]), ARGV[L + 9]
  redis.call('INCR', rpm_key)
  redis.call('EXPIRE', rpm_key, window_ttl)
  redis.call('INCRBY', tpm_key, cost)
  redis.call('EXPIRE', tpm_key, window_ttl)
  redis.call('ZADD', conc_key, now_ms + lease_ms, request_id)
  redis.call('PEXPIRE', conc_key, lease_ms * 2)
  if budget_key ~= '' then
    redis.call('INCRBY', budget_key, cost)
    redis.call('EXPIRE', budget_key, budget_ttl)
  end
  return {used[1] + 1, used[2] + cost, used[3] + 1, used[4] + cost}
end
"""

# The check alone, before any work is spent on a request (its exact charge is admission's).
_PRECHECK = (
    ADMIT_LIMITS_LUA
    + """
local over, used = limits_check(1, 1)
return {over or '', used}
"""
)

_SETTLE = """
local tpm_key, conc_key, budget_key = KEYS[1], KEYS[2], KEYS[3]
local give_back, request_id = tonumber(ARGV[1]), ARGV[2]
local function give(key)
  if key == '' or give_back <= 0 or redis.call('EXISTS', key) == 0 then return end
  local left = redis.call('DECRBY', key, give_back)
  if left < 0 then redis.call('SET', key, 0, 'KEEPTTL') end
end
give(tpm_key)
give(budget_key)
redis.call('ZREM', conc_key, request_id)
return 1
"""

_RENEW = """
local conc_key, until_ms = KEYS[1], tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', conc_key, 'XX', until_ms, ARGV[i])
end
redis.call('PEXPIRE', conc_key, math.max(1, until_ms - tonumber(redis.call('TIME')[1]) * 1000) * 2)
return 1
"""


@dataclass(frozen=True, slots=True)
class LimitUsage:
    """Counts against each limit right after admission (or at refusal)."""

    charge: LimitCharge
    requests: int
    tokens: int
    concurrent: int
    budget_used: int

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the limits the key has."""
        limits = self.charge.limits
        reset = _duration(self.charge.window_reset_s())
        headers: dict[str, str] = {}
        if limits.rpm is not None:
            headers["x-ratelimit-limit-requests"] = str(limits.rpm)
            headers["x-ratelimit-remaining-requests"] = str(max(0, limits.rpm - self.requests))
            headers["x-ratelimit-reset-requests"] = reset
        if limits.tpm is not None:
            headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, limits.tpm - self.tokens))
            headers["x-ratelimit-reset-tokens"] = reset
        return headers

    def retry_after_s(self, kind: LimitKind) -> int:
        if kind is LimitKind.BUDGET and self.charge.limits.budget_period is not None:
            return period_ttl_s(self.charge.limits.budget_period, self.charge.now_unix)
        if kind is LimitKind.CONCURRENCY:
            return 1
        return max(1, int(self.charge.window_reset_s() + 0.999))


class KeyLimitCounters:
    """Settlement and lease renewal (admission itself is in the queue's script)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._precheck = redis.register_script(_PRECHECK)
        self._settle = redis.register_script(_SETTLE)
        self._renew = redis.register_script(_RENEW)

    async def precheck(self, key_id: str, limits: Limits, now_unix: float) -> None:
        """Raise the 429 admission would give if the key is over a limit even for the
        cheapest request (one token): one round trip, nothing counted."""
        over = await self.over(key_id, limits, now_unix)
        if over is not None:
            raise key_limit_error(over[1], over[0])

    async def over(
        self, key_id: str, limits: Limits, now_unix: float
    ) -> tuple[LimitKind, LimitUsage] | None:
        """The limit the key is over even for the cheapest request (one token), and its
        usage; None when it is under all of them."""
        charge = LimitCharge(key_id, limits, "", 1, now_unix)
        over, counts = await self._precheck(keys=charge.keys(), args=charge.args())
        kind = over.decode() if isinstance(over, bytes) else str(over)
        return (LimitKind(kind), usage_from_reply(charge, counts)) if kind else None

    async def settle(self, charge: LimitCharge, used_tokens: int) -> None:
        """The request ended having used ``used_tokens``: give the rest back, free its slot."""
        await self.settle_reserved(charge.reservation(), charge.request_id, used_tokens)

    async def settle_reserved(
        self, reservation: Reservation, request_id: str, used_tokens: int
    ) -> None:
        """:meth:`settle` from what was recorded at admission (a dead gateway's request)."""
        give_back = max(0, reservation.cost_tokens - used_tokens)
        await self._settle(keys=list(reservation.counters), args=[give_back, request_id])

    async def renew(self, key_id: str, request_ids: list[str], now_unix: float) -> None:
        """Keep open requests' concurrency slots (a dead gateway's lapse in one lease)."""
        if request_ids:
            until_ms = int((now_unix + CONCURRENCY_LEASE_S) * 1000)
            await self._renew(keys=[names.key_concurrency(key_id)], args=[until_ms, *request_ids])


def key_limit_error(usage: LimitUsage, kind: LimitKind) -> KeyRateLimited | QuotaExceeded:
    """The 429 for a key over one of its limits, with OpenAI's headers."""
    limits, retry_after = usage.charge.limits, usage.retry_after_s(kind)
    headers = usage.headers()
    if kind is LimitKind.BUDGET:
        return QuotaExceeded(
            f"This API key has used its token budget for this {limits.budget_period} "
            f"({usage.budget_used} of {limits.budget_tokens} tokens; this request needs up "
            f"to {usage.charge.cost_tokens}). It renews in {retry_after}s.",
            retry_after_s=retry_after,
            headers=headers,
        )
    described = {
        LimitKind.REQUESTS: f"requests per minute (RPM): limit {limits.rpm}, used {usage.requests}",
        LimitKind.TOKENS: f"tokens per minute (TPM): limit {limits.tpm}, used {usage.tokens}, "
        f"requested {usage.charge.cost_tokens} (prompt + max_tokens x choices)",
        LimitKind.CONCURRENCY: f"concurrent requests: limit {limits.max_concurrent}, "
        f"open {usage.concurrent}",
    }[kind]
    limit = "tokens" if kind is LimitKind.TOKENS else "requests"
    return KeyRateLimited(
        f"Rate limit reached for this API key on {described}. Retry in {retry_after}s.",
        limit=limit,
        retry_after_s=retry_after,
        headers=headers,
    )


def usage_from_reply(charge: LimitCharge, counts: list[Any]) -> LimitUsage:
    requests, tokens, concurrent, budget = (int(value) for value in counts)
    return LimitUsage(charge, requests, tokens, concurrent, budget)


def period_id(period: BudgetPeriod, now_unix: float) -> str:
    day = dt.datetime.fromtimestamp(now_unix, dt.UTC)
    return day.strftime("d%Y%m%d") if period is BudgetPeriod.DAY else day.strftime("m%Y%m")


def period_ttl_s(period: BudgetPeriod, now_unix: float) -> int:
    """Seconds until the period ends (UTC)."""
    now = dt.datetime.fromtimestamp(now_unix, dt.UTC)
    if period is BudgetPeriod.DAY:
        end = (now + dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    else:
        first = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = (first + dt.timedelta(days=32)).replace(day=1)
    return max(1, int((end - now).total_seconds() + 0.999))


def _or_unlimited(value: int | None) -> int:
    return UNLIMITED if value is None else value


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``1s``, ``6m0s``."""
    whole = max(0, int(seconds + 0.999))
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"
