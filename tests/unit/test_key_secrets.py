"""API key secrets: format, hashing, masking."""

from __future__ import annotations

from gateway.control import key_secrets


def test_a_secret_is_cvy_and_43_url_safe_characters() -> None:
    secrets = {key_secrets.new_secret() for _ in range(100)}
    assert len(secrets) == 100
    assert all(key_secrets.well_formed(s) and len(s) == 47 for s in secrets)
    assert all(key_secrets.new_key_id().startswith("key_") for _ in range(3))


def test_hash_is_sha256_hex() -> None:
    digest = key_secrets.hash_secret("cvy-x")
    assert len(digest) == 64 and digest == key_secrets.hash_secret("cvy-x")
    assert digest != key_secrets.hash_secret("cvy-y")


def test_mask_shows_at_most_twelve_characters() -> None:
    secret = key_secrets.new_secret()
    masked = key_secrets.mask(secret)
    assert masked == f"{secret[:8]}\u2026{secret[-4:]}"
    assert secret[8:-4] not in masked
    assert key_secrets.mask("short-secret") == "***"
    assert key_secrets.mask("\udcff" * 30).startswith("\udcff")  # any string, no crash
    assert key_secrets.hash_secret("\udcff")  # undecodable header bytes hash too
