"""The checks on the request line and headers, before the body is read: with auth off,
only loopback Host names are answered (DNS rebinding); tests/db/test_inference_auth.py
has the key check of auth on."""

from __future__ import annotations

import pytest

from gateway.catalog.served_models import ServedModel
from gateway.edge_guard import host_name
from tests.gateway.harness import error_of, live_gateway


@pytest.mark.parametrize(
    ("host", "answered"),
    [
        ("localhost:8000", True),
        ("127.0.0.1:8000", True),
        ("127.1.2.3", True),
        ("[::1]:8000", True),
        ("LOCALHOST.", True),
        ("attacker.example", False),
        ("attacker.example:8000", False),
        ("10.0.0.5:8000", False),
        ("localhost.attacker.example", False),
    ],
)
async def test_with_auth_off_only_loopback_hosts_are_answered(
    served_model: ServedModel, host: str, answered: bool
) -> None:
    async with live_gateway(served_model, allowed_hosts="") as live:
        for path in ("/admin/state", "/health"):
            response = await live.client.get(path, headers={"Host": host})
            if answered:
                assert response.status_code == 200, response.text
            else:
                assert error_of(response, 403)["code"] == "host_not_allowed"


async def test_allowed_hosts_widens_the_loopback_rule(served_model: ServedModel) -> None:
    async with live_gateway(served_model, allowed_hosts="gw, models.internal") as live:
        response = await live.client.get("/admin/state", headers={"Host": "models.internal"})
        assert response.status_code == 200
        response = await live.client.get("/admin/state", headers={"Host": "other.internal"})
        assert error_of(response, 403)["code"] == "host_not_allowed"
    async with live_gateway(served_model, allowed_hosts="*") as live:
        response = await live.client.get("/admin/state", headers={"Host": "anything.example"})
        assert response.status_code == 200


@pytest.mark.parametrize(
    ("host", "name"),
    [
        ("a.example:80", "a.example"),
        ("[::1]:8000", "::1"),
        ("::1", "::1"),
        ("A.Example.", "a.example"),
    ],
)
def test_host_name_drops_the_port(host: str, name: str) -> None:
    assert host_name(host) == name
