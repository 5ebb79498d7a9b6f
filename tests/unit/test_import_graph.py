"""Imports run down the layers only (scripts/import_graph.py): shared < workers.engines <
workers < gateway < conveyor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_imports_a_higher_layer() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py"), str(ROOT)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 upward import(s)" in result.stdout


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    for package in ("shared", "workers", "gateway", "conveyor"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "shared" / "bad.py").write_text("def f():\n    from workers import runtime\n")
    (tmp_path / "gateway" / "ok.py").write_text("from shared import bad\n")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "UPWARD IMPORT shared/bad.py:2" in result.stdout
    assert "gateway/ok.py" not in result.stdout
