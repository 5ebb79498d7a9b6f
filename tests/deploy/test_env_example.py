""".env.example is generated from shared/settings.py: the committed file must match."""

from __future__ import annotations

import re

from conveyor.env_example import render
from shared.settings import Settings
from tests.deploy.compose_model import ROOT


def test_env_example_is_the_generated_one() -> None:
    committed = (ROOT / ".env.example").read_text()
    assert committed == render(), "regenerate: python -m conveyor.env_example > .env.example"


def test_env_example_lists_every_setting_once() -> None:
    listed = re.findall(r"^#(CONVEYOR_[A-Z0-9_]+)=", render(), re.MULTILINE)
    assert sorted(listed) == sorted(f"CONVEYOR_{name.upper()}" for name in Settings.model_fields)


def test_every_default_in_env_example_is_accepted_by_settings() -> None:
    values = dict(re.findall(r"^#(CONVEYOR_[A-Z0-9_]+)=(.+)$", render(), re.MULTILINE))
    fields = {f"CONVEYOR_{name.upper()}": name for name in Settings.model_fields}
    parsed = Settings(**{fields[key]: value for key, value in values.items()})
    for key in values:
        assert getattr(parsed, fields[key]) == Settings.model_fields[fields[key]].default, key
