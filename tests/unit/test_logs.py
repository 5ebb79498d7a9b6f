"""shared.logs: Conveyor's lines on the console; other loggers' INFO in the file only,
their warnings on the console once, everything on the console at DEBUG."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.logs import FILE_ONLY_WARNINGS, ConsoleRule, log_file


def _record(name: str, level: int, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


@pytest.fixture(autouse=True)
def _forget_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ConsoleRule, "_warned", set())


def test_own_lines_follow_the_level_others_show_warnings_once_and_errors_always() -> None:
    rule = ConsoleRule("INFO")
    assert rule.filter(_record("gateway.app", logging.INFO, "serving"))
    assert not rule.filter(_record("gateway.app", logging.DEBUG, "detail"))
    assert not rule.filter(_record("vllm.config", logging.INFO, "config dump"))
    assert not rule.filter(_record("alembic.runtime.migration", logging.INFO, "Context impl"))
    assert rule.filter(_record("vllm.utils", logging.WARNING, "weight %s", "a"))
    assert not rule.filter(_record("vllm.utils", logging.WARNING, "weight %s", "b"))
    assert rule.filter(_record("uvicorn.error", logging.ERROR, "Exception in ASGI app"))
    assert rule.filter(_record("uvicorn.error", logging.ERROR, "Exception in ASGI app"))
    assert not ConsoleRule("WARNING").filter(_record("workers.main", logging.INFO, "x"))


def test_warnings_conveyor_causes_by_design_stay_in_the_file() -> None:
    rule = ConsoleRule("INFO")
    for name, message in FILE_ONLY_WARNINGS:
        assert not rule.filter(_record(name, logging.WARNING, message + " and more"))


def test_debug_shows_everything_every_time() -> None:
    rule = ConsoleRule("DEBUG")
    for _ in range(2):
        assert rule.filter(_record("vllm.config", logging.DEBUG, "config dump"))
        assert rule.filter(_record("vllm.utils", logging.WARNING, "again"))


PROCESS = """
import logging, sys, warnings
from pathlib import Path
from shared.logs import setup_logging
print(setup_logging("INFO", Path(sys.argv[1])))
logging.getLogger("vllm.engine").info("engine config dump")
for _ in range(3):
    logging.getLogger("alembic.runtime").warning("same warning")
logging.getLogger("workers.main").info("worker ready")
warnings.warn("old API", FutureWarning)
"""


def test_a_process_sends_library_info_to_the_file_and_tells_vllm_the_rule(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    done = subprocess.run(
        [sys.executable, "-c", PROCESS, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    file = log_file(tmp_path)
    assert done.stdout.strip() == str(file)
    console = done.stderr
    assert console.count("same warning") == 1 and console.count("worker ready") == 1
    assert console.count("FutureWarning: old API") == 1
    assert "engine config dump" not in console
    logged = file.read_text()
    assert "engine config dump" in logged and logged.count("same warning") == 3
    config = json.loads((file.parent / "logging-info.json").read_text())
    assert config["root"]["handlers"] == ["console", "file"]
