"""/metrics with auth on: a key with `metrics` or `admin` (CONVEYOR_METRICS_SCOPES) reads
it; no key is a 401, an inference key a 403. The control plane's gauges are there."""

from __future__ import annotations

from gateway.control.records import Scope
from tests.db.test_inference_auth import ADMIN_KEY, bearer, gateway, new_key  # noqa: F401
from tests.gateway.harness import LiveGateway, error_of


async def test_metrics_needs_a_metrics_or_admin_key(gateway: LiveGateway) -> None:  # noqa: F811
    assert error_of(await gateway.client.get("/metrics"), 401)["code"] == "invalid_api_key"
    inference = await new_key(gateway, {Scope.INFERENCE})
    error_of(await gateway.client.get("/metrics", headers=bearer(inference)), 403)
    for secret in (await new_key(gateway, {Scope.METRICS}), ADMIN_KEY):
        response = await gateway.client.get("/metrics", headers=bearer(secret))
        assert response.status_code == 200, response.text
        assert "conveyor_ledger_database_ok 1.0" in response.text
        assert 'conveyor_key_cache{field="loaded"} 1.0' in response.text


async def test_metrics_scopes_are_configurable(gateway: LiveGateway) -> None:  # noqa: F811
    gateway.state.settings.metrics_scopes = "inference"
    inference = await new_key(gateway, {Scope.INFERENCE})
    assert (await gateway.client.get("/metrics", headers=bearer(inference))).status_code == 200
