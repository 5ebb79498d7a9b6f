"""The docs' front door stays short and the generated Configuration page lists every setting."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from shared.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _settings_page() -> ModuleType:
    path = ROOT / "docs" / "hooks" / "settings_page.py"
    spec = importlib.util.spec_from_file_location("settings_page", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_a_short_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200


def test_configuration_page_lists_every_setting_with_its_flag() -> None:
    page = _settings_page().render()
    for name in Settings.model_fields:
        assert f"`CONVEYOR_{name.upper()}`" in page, name
        assert f"`--{name.replace('_', '-')}`" in page, name
