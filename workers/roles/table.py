"""The one table from a worker's role to the module that runs its jobs."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from shared.roles import Role
from workers.roles import embed, encode, generate, prefill
from workers.roles.base import LoadRole

ROLES: Mapping[Role, LoadRole] = MappingProxyType(
    {
        Role.AGGREGATED: generate.load,
        Role.DECODE: generate.load,
        Role.PREFILL: prefill.load,
        Role.EMBED: embed.load,
        Role.ENCODE: encode.load,
    }
)
