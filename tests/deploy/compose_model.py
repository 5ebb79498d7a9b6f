"""compose.yaml as data: its services, and the environment compose would give each one.

Interpolation follows compose's rules for the forms the file uses: ``${VAR}``,
``${VAR:-default}`` (default when unset or empty), ``${VAR-default}`` (when unset) and
``${VAR:?message}`` (required: compose stops with the message when unset or empty; here
it reads as empty), nested inner first.
An ``environment`` key with no value is passed on only when the variable is set.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
CONVEYOR_IMAGE = "${IMAGE_REPOSITORY:-conveyor}"

_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}$]*))?\}")


def load() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return data


def services() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = load()["services"]
    return found


def conveyor_services() -> dict[str, dict[str, Any]]:
    """The services that run the `conveyor` image (every one but redis and postgres)."""
    return {
        name: spec
        for name, spec in services().items()
        if str(spec.get("image", "")).startswith(CONVEYOR_IMAGE)
    }


def referenced_variables(text: str) -> set[str]:
    return set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))


def required_variables(text: str) -> set[str]:
    """The variables compose refuses to start without (``${VAR:?message}``)."""
    return set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*):\?", text))


def interpolate(value: str, variables: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        name, operator, default = match.groups()
        current = variables.get(name)
        if operator == ":-" and not current:
            return default
        if operator == "-" and current is None:
            return default
        return current or ""

    while True:  # innermost references first: a default may hold one
        replaced = _REFERENCE.sub(replace, value)
        if replaced == value:
            return replaced
        value = replaced


def service_environment(spec: dict[str, Any], variables: dict[str, str]) -> dict[str, str]:
    """What the container's environment gets from compose (``variables``: .env + shell)."""
    env: dict[str, str] = {}
    for key, value in (spec.get("environment") or {}).items():
        if value is None:
            if key in variables:
                env[key] = variables[key]
            continue
        env[key] = interpolate(str(value), variables)
    return env


def command_of(spec: dict[str, Any]) -> list[str]:
    command = spec.get("command") or []
    assert isinstance(command, list), "commands are exec-form lists (no shell in between)"
    return [str(part) for part in command]
