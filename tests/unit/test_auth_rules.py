"""Auth settings and the start-up rule (auth off only on loopback), bearer parsing, scopes."""

from __future__ import annotations

import pytest

from gateway.auth import AuthConfigError, bearer_secret, check_auth_settings, is_loopback
from gateway.control.records import ANONYMOUS, Limits, Principal, Scope, parse_scopes
from shared.errors import InvalidApiKey, InvalidRequest
from shared.settings import Settings

ADMIN = "a" * 32


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.9.9.9", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("gateway.internal", False),
        ("", False),
    ],
)
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_auth_off_on_a_public_address_refuses_to_start() -> None:
    with pytest.raises(AuthConfigError, match=r"refusing to listen on 0\.0\.0\.0 with auth off"):
        check_auth_settings(Settings(host="0.0.0.0"))
    check_auth_settings(Settings(host="0.0.0.0", allow_unauthenticated_public=True))
    check_auth_settings(Settings(host="0.0.0.0", admin_key=ADMIN))
    check_auth_settings(Settings(host="0.0.0.0", auth="on"))
    check_auth_settings(Settings(host="127.0.0.1"))


def test_auth_mode_follows_the_admin_key() -> None:
    assert not Settings().auth_enabled()
    assert Settings(admin_key=ADMIN).auth_enabled()
    assert not Settings(admin_key="").auth_enabled()  # empty counts as unset
    assert Settings(auth="on").auth_enabled()
    with pytest.raises(AuthConfigError, match="contradicts"):
        check_auth_settings(Settings(auth="off", admin_key=ADMIN))
    with pytest.raises(AuthConfigError, match="at least 16"):
        check_auth_settings(Settings(admin_key="short"))
    with pytest.raises(AuthConfigError, match="METRICS_SCOPES"):
        check_auth_settings(Settings(metrics_scopes="metrics,root"))


def test_the_admin_key_stays_secret_in_settings() -> None:
    settings = Settings(admin_key=ADMIN)
    assert ADMIN not in repr(settings) and ADMIN not in str(settings.model_dump())
    assert settings.admin_secret() == ADMIN


def test_database_url_defaults_to_the_embedded_file() -> None:
    settings = Settings(data_dir=".conveyor-x")
    assert settings.database_is_embedded()
    assert settings.database_url_or_default().startswith("sqlite+aiosqlite:////")
    assert settings.database_url_or_default().endswith("/.conveyor-x/conveyor.db")
    external = Settings(database_url="postgresql+asyncpg://u@db/conveyor")
    assert not external.database_is_embedded()
    assert external.database_url_or_default() == "postgresql+asyncpg://u@db/conveyor"


def test_bearer_header() -> None:
    assert bearer_secret(None) is None
    assert bearer_secret("Bearer cvy-abc") == "cvy-abc"
    assert bearer_secret("bearer   cvy-abc ") == "cvy-abc"
    for malformed in ("cvy-abc", "Basic dXNlcjpwYXNz", "Bearer", "Bearer   "):
        with pytest.raises(InvalidApiKey):
            bearer_secret(malformed)


def test_scopes() -> None:
    assert parse_scopes(["inference", " Metrics ", ""]) == {Scope.INFERENCE, Scope.METRICS}
    for bad in ([], [""], ["root"]):
        with pytest.raises(InvalidRequest):
            parse_scopes(bad)
    metrics_only = Principal("key_1", "m", frozenset({Scope.METRICS}), None, Limits())
    assert metrics_only.has_scope(Scope.METRICS) and not metrics_only.has_scope(Scope.INFERENCE)
    assert all(ANONYMOUS.has_scope(scope) for scope in Scope)  # admin includes every scope


def test_the_gateway_refuses_to_start_open_on_a_public_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from gateway.server import serve

    assert serve(Settings(host="0.0.0.0")) == 2
    assert "CONVEYOR_ALLOW_UNAUTHENTICATED_PUBLIC" in caplog.text
