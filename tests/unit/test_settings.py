"""Settings are grouped by who reads them, in one CONVEYOR_* namespace and one --help."""

from __future__ import annotations

import re

import pytest

from conveyor.cli import build_parser
from shared.settings import (
    SETTING_GROUPS,
    CommonSettings,
    GatewaySettings,
    ImageSettings,
    Settings,
    WorkerSettings,
    own_fields,
)


def test_every_setting_belongs_to_exactly_one_group() -> None:
    declared = [name for _, group in SETTING_GROUPS for name in own_fields(group)]
    assert sorted(declared) == sorted(Settings.model_fields)
    assert len(declared) == len(set(declared))


def test_every_setting_is_a_flag_listed_once_under_its_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    help_text = capsys.readouterr().out
    flags = re.findall(r"^  (--[a-z-]+)", help_text, flags=re.MULTILINE)
    assert sorted(flags) == sorted("--" + name.replace("_", "-") for name in Settings.model_fields)
    sections = re.split(r"^(\w[\w ]*) settings:$", help_text, flags=re.MULTILINE)
    by_title = dict(zip(sections[1::2], sections[2::2], strict=True))
    for title, group in SETTING_GROUPS:
        for name in own_fields(group):
            assert f"--{name.replace('_', '-')}" in by_title[title]
            assert f"CONVEYOR_{name.upper()}" in by_title[title]


@pytest.mark.parametrize(
    ("group", "name", "raw", "value"),
    [
        (GatewaySettings, "queue_max_depth", "7", 7),
        (ImageSettings, "image_max_bytes", "1000", 1000),
        (WorkerSettings, "worker_max_slots", "3", 3),
        (GatewaySettings, "redis_url", "redis://elsewhere:1/2", "redis://elsewhere:1/2"),
    ],
)
def test_each_group_reads_the_same_environment_variables(
    monkeypatch: pytest.MonkeyPatch,
    group: type[CommonSettings],
    name: str,
    raw: str,
    value: object,
) -> None:
    monkeypatch.setenv(f"CONVEYOR_{name.upper()}", raw)
    assert getattr(group(), name) == value
    assert getattr(Settings(), name) == value
