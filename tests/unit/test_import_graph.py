"""Imports run down the layers only, and no modules import each other
(scripts/import_graph.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py"), str(root)],
        capture_output=True,
        text=True,
        check=False,
    )


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for package in ("shared", "workers", "gateway", "conveyor"):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text("")
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.parent != tmp_path and not (path.parent / "__init__.py").exists():
            (path.parent / "__init__.py").write_text("")
        path.write_text(text)
    return tmp_path


def test_the_project_imports_down_the_layers_only_and_in_no_circle() -> None:
    result = check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 upward import(s)" in result.stdout
    assert "0 import circle(s)" in result.stdout


def test_an_upward_import_is_caught_even_inside_a_function(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "shared/bad.py": "def f():\n    from workers import runtime\n",
            "gateway/ok.py": "from shared import bad\n",
        },
    )
    result = check(root)
    assert result.returncode == 1
    assert "UPWARD IMPORT shared/bad.py:2" in result.stdout
    assert "gateway/ok.py" not in result.stdout


def test_the_gateway_and_the_workers_never_import_each_other(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "workers/runtime.py": "",
            "gateway/serving/endpoints.py": "from workers.runtime import x\n",
        },
    )
    assert "UPWARD IMPORT gateway/serving/endpoints.py:1" in check(root).stdout


def test_the_wire_vocabulary_imports_no_later_stage(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "gateway/dispatch/plan.py": "",
            "gateway/openai/schemas.py": "from gateway.dispatch.plan import Plan\n",
            "gateway/serving/translate.py": "from gateway.openai.schemas import Request\n",
        },
    )
    result = check(root)
    assert "UPWARD IMPORT gateway/openai/schemas.py:1" in result.stdout
    assert "serving/translate.py" not in result.stdout


def test_production_code_never_imports_the_demo_models(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "shared/demo/model.py": "",
            "workers/engines/lora/check.py": "from shared.demo.model import x\n",
            "conveyor/cli.py": "from shared.demo.model import x\n",
        },
    )
    result = check(root)
    assert "UPWARD IMPORT workers/engines/lora/check.py:1" in result.stdout
    assert "conveyor/cli.py" not in result.stdout


def test_a_circle_is_caught_unless_one_side_is_for_type_checking(tmp_path: Path) -> None:
    circle = {
        "gateway/dispatch/a.py": "from gateway.dispatch import b\n",
        "gateway/dispatch/b.py": "def f():\n    from gateway.dispatch import a\n",
    }
    result = check(tree(tmp_path / "circle", circle))
    assert result.returncode == 1
    assert "IMPORT CIRCLE: gateway.dispatch.a <-> gateway.dispatch.b" in result.stdout

    typed = {
        "gateway/dispatch/a.py": "from gateway.dispatch import b\n",
        "gateway/dispatch/b.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from gateway.dispatch import a\n"
        ),
    }
    result = check(tree(tmp_path / "typed", typed))
    assert result.returncode == 0, result.stdout
