"""API key secrets: made, hashed and masked here and nowhere else.

A secret is ``cvy-`` + 43 URL-safe characters (256 random bits). Only its SHA-256
is stored: with that much entropy a fast hash is safe, and it lets the gateway find
a key with one dictionary lookup. Logs and errors show the masked form only.
"""

from __future__ import annotations

import hashlib
import re
import secrets

SECRET_PREFIX = "cvy-"
SECRET_BYTES = 32
SECRET_PATTERN = re.compile(r"cvy-[A-Za-z0-9_-]{43}")
KEY_ID_PREFIX = "key_"
PREFIX_CHARS = 8
"""Shown at the start of a masked key: ``cvy-`` and four characters of the secret."""
SUFFIX_CHARS = 4
ELLIPSIS = "\u2026"


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(SECRET_BYTES)


def new_key_id() -> str:
    """The public id (``key_`` + 12 hex digits): safe to show, useless to authenticate."""
    return KEY_ID_PREFIX + secrets.token_hex(6)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def well_formed(secret: str) -> bool:
    return SECRET_PATTERN.fullmatch(secret) is not None


def prefix_of(secret: str) -> str:
    return secret[:PREFIX_CHARS]


def suffix_of(secret: str) -> str:
    return secret[-SUFFIX_CHARS:]


def masked(prefix: str, suffix: str) -> str:
    return f"{prefix}{ELLIPSIS}{suffix}"


def mask(secret: str) -> str:
    """The masked form of any presented string: never more than 8 + 4 of its characters,
    and nothing of a string too short to hide anything."""
    if len(secret) < PREFIX_CHARS + SUFFIX_CHARS + 8:
        return "***"
    return masked(prefix_of(secret), suffix_of(secret))
