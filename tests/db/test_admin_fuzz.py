"""Fuzz /admin/* with the control plane on (SQLite; PostgreSQL too where it runs): query
strings of /admin/usage and /admin/keys, key bodies, key ids, and Authorization headers.
No input may give a 5xx or an error that is not OpenAI-shaped. Derandomized."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.db.test_admin_routes import ADMIN_KEY, bearer, plane_factory  # noqa: F401
from tests.gateway.test_http_fuzz import json_values

FUZZ = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

ODD = [
    "", " ", "0", "-1", "1", "1000", "1001", "99999999999999999999", "9" * 5000, "1e3", "1.5",
    "nan", "inf", "-inf", "NaN", "\u00b2" * 3, "0x10", "1_0",
    "\u00b2", "\u0661\u0662", "\uff11", "x" * 2000, "\u00e9", "%00",
    "7d", "0d", "-7d", "1e400d", "99999999999w", "9" * 400 + "d", "1.5h", "2025-06-01",
    "2025-06-01T12:00:00Z", "2025-13-40", "0000-00-00", "9999-12-31T23:59:59+14:00",
    "2025-06-01T12:00:00-23:59", "1748736000", "1e20", "-1748736000", "253402300800", "z",
    "day", "key", "model", "DAY", "key_x", "null", "[]", "{}", "'; DROP TABLE keys; --",
]  # fmt: skip
VALUES = st.sampled_from(ODD) | st.text(max_size=20)
USAGE_PARAMS = ["since", "until", "group_by", "key", "model", "limit", "other"]


def assert_no_server_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    assert response.headers["content-type"].startswith("application/json"), response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert response.status_code < 500, response.text


def examples(strategy: st.SearchStrategy[Any]) -> list[Any]:
    """Hypothesis's (derandomized) examples of ``strategy``, drawn up front: the requests
    are async and Hypothesis runs only synchronous tests."""
    drawn: list[Any] = []

    @FUZZ
    @given(strategy)
    def draw(value: Any) -> None:
        drawn.append(value)

    draw()
    return drawn


async def test_usage_query_strings_never_give_a_server_error(plane_factory: Any) -> None:  # noqa: F811
    client, _plane = await plane_factory(admin_key=ADMIN_KEY)
    async with client:
        for params in examples(
            st.lists(st.tuples(st.sampled_from(USAGE_PARAMS), VALUES), max_size=5)
        ):
            response = await client.get("/admin/usage", params=params, headers=bearer(ADMIN_KEY))
            assert_no_server_error(response)


async def test_a_limit_of_non_ascii_digits_is_a_400(plane_factory: Any) -> None:  # noqa: F811
    """str.isdigit() passes "²" and "١٢", which int() refuses: that was a 500."""
    client, _plane = await plane_factory(admin_key=ADMIN_KEY)
    async with client:
        for limit in ["\u00b2", "\u0661\u0662", "\uff11", "9" * 5000]:
            response = await client.get(
                "/admin/usage", params={"limit": limit}, headers=bearer(ADMIN_KEY)
            )
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "limit"


EXPIRIES = st.sampled_from(["9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00", "2999-01-01"])
KEY_FIELDS = ["name", "scopes", "models", "rpm", "tpm", "max_concurrent", "budget_tokens",
              "budget_period", "expires_at", "other"]  # fmt: skip
KEY_BODIES = st.dictionaries(
    st.sampled_from(KEY_FIELDS), json_values | VALUES | EXPIRIES, max_size=5
) | (json_values)
KEY_CALLS = st.tuples(
    st.sampled_from(["GET", "POST", "PATCH", "DELETE"]),
    st.sampled_from(["", "/key_x", "/%00", "/" + "k" * 3000, "/..", "/%E9", "/\u00e9"]),
    st.lists(st.tuples(st.sampled_from(["include_revoked", "x"]), VALUES), max_size=2),
    KEY_BODIES,
)


async def test_key_calls_never_give_a_server_error(plane_factory: Any) -> None:  # noqa: F811
    client, _plane = await plane_factory(admin_key=ADMIN_KEY)
    async with client:
        for method, tail, params, body in examples(KEY_CALLS):
            response = await client.request(
                method, "/admin/keys" + tail, params=params, headers=bearer(ADMIN_KEY),
                content=json.dumps(body, allow_nan=True) if method in ("POST", "PATCH") else None,
            )  # fmt: skip
            assert_no_server_error(response)


AUTHORIZATION = st.sampled_from(
    [b"", b"Bearer", b"Bearer ", b"bearer " + ADMIN_KEY.encode(), b"Bearer  " + ADMIN_KEY.encode(),
     b"Bearer " + ADMIN_KEY.encode() + b" ", ADMIN_KEY.encode(), b"Basic dXNlcjpwYXNz",
     b"Bearer " + b"k" * 8000, b" " * 40, b"Bearer \xe9\xff\xfe", b"\xe9", b"Bearer a b c",
     b"Bearer cvy-" + b"x" * 43, b"Bearer cvy-\xe9" + b"x" * 42, b"Token t"]
)  # fmt: skip
PATHS = ["/admin/keys", "/admin/usage", "/admin/state", "/admin/keys/key_x", "/ready"]


async def test_authorization_headers_never_give_a_server_error(plane_factory: Any) -> None:  # noqa: F811
    client, _plane = await plane_factory(admin_key=ADMIN_KEY)
    async with client:
        for auth, path in examples(st.tuples(AUTHORIZATION, st.sampled_from(PATHS))):
            response = await client.get(path, headers={"authorization": auth})
            assert_no_server_error(response)
            if response.status_code == 200 and path.startswith("/admin"):
                assert auth.split()[-1] == ADMIN_KEY.encode(), auth[:40]


async def test_an_expiry_past_the_last_utc_instant_is_a_400(plane_factory: Any) -> None:  # noqa: F811
    """9999-12-31T23:59:59-14:00 is past datetime.max once in UTC: that was a 500."""
    client, _plane = await plane_factory(admin_key=ADMIN_KEY)
    async with client:
        body = {"name": "a", "expires_at": "9999-12-31T23:59:59-14:00"}
        response = await client.post("/admin/keys", json=body, headers=bearer(ADMIN_KEY))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "expires_at"
