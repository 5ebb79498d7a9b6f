"""`conveyor db|keys|usage` against SQLite and PostgreSQL (in process, as a user runs them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from conveyor.cli import main
from gateway.control.key_secrets import SECRET_PATTERN
from shared.queue import names
from tests.conftest import REAL_REDIS_URL, _require_real_redis
from tests.support.sql import SqlTarget

NO_REDIS = "redis://127.0.0.1:1/0"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_db_upgrade_current_downgrade(
    sql_target: SqlTarget, capsys: pytest.CaptureFixture[str]
) -> None:
    db = ("--database-url", sql_target.url)
    code, out, _ = run(capsys, "db", "current", *db)
    assert code == 0 and "current: empty" in out and "conveyor db upgrade" in out
    code, out, _ = run(capsys, "db", "upgrade", *db)
    assert code == 0 and "migrated: empty -> 0003" in out
    assert "current: 0003\nhead: 0003" in run(capsys, "db", "current", *db)[1]
    code, out, _ = run(capsys, "db", "downgrade", "0001", *db)
    assert code == 0 and "migrated: 0003 -> 0001" in out
    code, out, _ = run(capsys, "db", "downgrade", "base", *db)
    assert code == 0 and "migrated: 0001 -> empty" in out


def test_keys_lifecycle_with_the_secret_alone_on_the_last_line(
    sql_target: SqlTarget, capsys: pytest.CaptureFixture[str]
) -> None:
    where = ("--database-url", sql_target.url, "--redis-url", NO_REDIS)
    assert run(capsys, "db", "upgrade", *where)[0] == 0
    code, out, err = run(
        capsys,
        "keys",
        "create",
        "--name",
        "team-a",
        "--scopes",
        "inference,metrics",
        "--rpm",
        "5",
        "--tpm",
        "100",
        "--max-concurrent",
        "2",
        "--budget-tokens",
        "1000",
        "--budget-period",
        "month",
        "--models",
        "a,b",
        "--expires",
        "30d",
        *where,
    )
    assert code == 0, err
    lines = out.rstrip("\n").split("\n")
    secret = lines[-1]
    assert SECRET_PATTERN.fullmatch(secret), out
    assert all(secret not in line for line in lines[:-1])
    assert "could not tell the gateways" in err  # Redis is down: best effort, still done

    [listed] = json.loads(run(capsys, "keys", "list", "--json", *where)[1])
    assert (listed["name"], listed["rpm"], listed["budget_period"], listed["models"]) == (
        "team-a",
        5,
        "month",
        ["a", "b"],
    )
    key_id = listed["id"]
    code, out, _ = run(capsys, "keys", "update", key_id, "--rpm", "none", "--tpm", "7", *where)
    assert code == 0 and "tpm             7" in out
    shown = json.loads(run(capsys, "keys", "show", key_id, "--json", *where)[1])
    assert (shown["rpm"], shown["tpm"]) == (None, 7)
    code, out, _ = run(capsys, "keys", "revoke", key_id, *where)
    assert code == 0 and "revoked" in out
    assert "team-a" not in run(capsys, "keys", "list", *where)[1]
    assert "revoked" in run(capsys, "keys", "list", "--all", *where)[1]
    code, _, err = run(capsys, "keys", "show", "key_nope", *where)
    assert code == 1 and "no API key" in err


def test_bad_input_exits_2_and_says_why(
    sql_target: SqlTarget, capsys: pytest.CaptureFixture[str]
) -> None:
    where = ("--database-url", sql_target.url, "--redis-url", NO_REDIS)
    run(capsys, "db", "upgrade", *where)
    for argv, words in (
        (("--name", "x", "--scopes", "root"), "unknown scope"),
        (("--name", "x", "--budget-tokens", "5"), "budget_period"),
        (("--name", "x", "--rpm", "many"), "--rpm"),
        (("--name", "x", "--expires", "soon"), "expires_at"),
    ):
        code, out, err = run(capsys, "keys", "create", *argv, *where)
        assert code == 2 and words in err and out == "", (argv, err)


def test_an_external_database_behind_head_is_refused(
    sql_target: SqlTarget, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "keys", "list", "--database-url", sql_target.url)
    assert code == 1 and "conveyor db upgrade" in err


def test_usage_report(sql_target: SqlTarget, capsys: pytest.CaptureFixture[str]) -> None:
    where = ("--database-url", sql_target.url)
    run(capsys, "db", "upgrade", *where)
    code, out, _ = run(capsys, "usage", "--group-by", "key", "--since", "7d", *where)
    assert code == 0 and out.splitlines()[0].startswith("KEY") and "total: requests 0" in out
    report = json.loads(run(capsys, "usage", "--json", "--model", "m", *where)[1])
    assert report["filter"]["model"] == "m" and report["data"] == []
    assert run(capsys, "usage", "--since", "whenever", *where)[0] == 2


def test_the_embedded_database_needs_no_set_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CONVEYOR_DATABASE_URL", raising=False)
    where = ("--data-dir", str(tmp_path / "state"), "--redis-url", NO_REDIS)
    code, out, _ = run(
        capsys, "keys", "create", "--name", "first-admin", "--scopes", "admin", *where
    )
    assert code == 0 and SECRET_PATTERN.fullmatch(out.splitlines()[-1])
    assert (tmp_path / "state" / "conveyor.db").exists()


@pytest.mark.redis
def test_a_key_change_bumps_the_generation_gateways_poll(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CONVEYOR_DATABASE_URL", raising=False)
    _require_real_redis(REAL_REDIS_URL)
    client = redis.Redis.from_url(REAL_REDIS_URL)
    try:
        client.delete(names.API_KEYS_GENERATION)
        where = ("--data-dir", str(tmp_path), "--redis-url", REAL_REDIS_URL)
        code, _, err = run(capsys, "keys", "create", "--name", "k", *where)
        assert code == 0 and "warning" not in err
        assert client.get(names.API_KEYS_GENERATION) == b"1"
    finally:
        client.delete(names.API_KEYS_GENERATION)
        client.close()
