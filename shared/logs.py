"""Where log lines go: one rule for every Conveyor process and the engine processes it starts.

- Conveyor's own loggers (:data:`OWN_LOGGERS`) print on the console (stderr) at the
  configured level.
- Everyone else's (vLLM, torch, transformers, uvicorn, Alembic, SQLAlchemy, httpx...)
  write INFO and up to ``<data_dir>/logs/conveyor.log``; their warnings and errors print on
  the console too, each warning once per process (vLLM repeats some every request).
- ``--log-level debug``: everything, every time, on the console (and in the file).

vLLM applies a logging configuration of its own in each process it starts (its engine
core is a spawned process that inherits nothing); ``VLLM_LOGGING_CONFIG_PATH`` points it at
this same configuration, written as JSON beside the log file, so that process follows
the rule too.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import sys
from pathlib import Path
from typing import Any, ClassVar

OWN_LOGGERS = ("conveyor", "gateway", "workers", "shared", "__main__")
"""Conveyor's loggers (``logging.getLogger(__name__)`` in its packages)."""

FILE_ONLY_WARNINGS = (
    # Conveyor hands vLLM token ids (a TokensPrompt) on purpose: workers/engines/vllm.
    ("vllm.v1.engine.input_processor", "Passing raw prompts to InputProcessor is deprecated"),
    # After the worker drained, the engine core gets ENGINE_TEARDOWN_S, then is killed.
    ("vllm.v1.utils", "[shutdown] Process manager: force killing"),
)
"""Other loggers' warnings that Conveyor causes by design, on every run: the file has them."""

LOG_FILE_NAME = "conveyor.log"
LINE_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"


def log_file(data_dir: Path) -> Path:
    """Where engines' and libraries' INFO lines go (every process of a stack appends)."""
    return (data_dir / "logs" / LOG_FILE_NAME).resolve()


def is_own(logger_name: str) -> bool:
    return any(logger_name == own or logger_name.startswith(own + ".") for own in OWN_LOGGERS)


class ConsoleRule(logging.Filter):
    """What the console shows: Conveyor's lines at ``level``; other loggers' warnings once
    and their errors always; at DEBUG, everything."""

    _warned: ClassVar[set[tuple[str, str]]] = set()
    """(logger, message template) already shown by this process. Per process, not per
    filter: vLLM re-applies the configuration (a new filter) after its first warnings."""

    def __init__(self, level: str = "INFO") -> None:
        super().__init__()
        self.level = logging.getLevelNamesMapping()[level.upper()]

    def filter(self, record: logging.LogRecord) -> bool:
        if is_own(record.name):
            return record.levelno >= self.level
        if record.name == "py.warnings":  # "file:line: Category: text\n  source line\n"
            record.msg = str(record.msg).split("\n", 1)[0]
        if self.level <= logging.DEBUG or record.levelno > logging.WARNING:
            return True
        if record.levelno < logging.WARNING or _expected(record):
            return False
        key = (record.name, str(record.msg))
        if key in self._warned:
            return False
        self._warned.add(key)
        return True


def _expected(record: logging.LogRecord) -> bool:
    message = str(record.msg)
    return any(
        record.name == name and message.startswith(start) for name, start in FILE_ONLY_WARNINGS
    )


def console_handler(show_level: str = "INFO") -> logging.Handler:
    """stderr through :class:`ConsoleRule`. Python warnings (``warnings.warn``) become
    records of the ``py.warnings`` logger, so they are shown once like other warnings."""
    logging.captureWarnings(True)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ConsoleRule(show_level))
    handler.setFormatter(logging.Formatter(LINE_FORMAT))
    return handler


def logging_config(level: str, file: Path | None) -> dict[str, Any]:
    """The :func:`logging.config.dictConfig` of the rule (JSON-serialisable, for vLLM)."""
    debug = level.upper() == "DEBUG"
    handlers: dict[str, Any] = {
        "console": {"()": f"{__name__}.console_handler", "show_level": level.upper()}
    }
    if file is not None:
        handlers["file"] = {
            "class": "logging.FileHandler",
            "filename": str(file),
            "encoding": "utf-8",
            "formatter": "line",
            "level": "DEBUG" if debug else "INFO",
        }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"line": {"format": LINE_FORMAT}},
        "handlers": handlers,
        "root": {"level": "DEBUG" if debug else "INFO", "handlers": list(handlers)},
    }


def setup_logging(level: str, data_dir: Path | None = None) -> Path | None:
    """Apply the rule in this process and hand it to the vLLM processes it will start;
    returns the log file (None without ``data_dir``: then other loggers' INFO is dropped)."""
    file = log_file(data_dir) if data_dir is not None else None
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
    config = logging_config(level, file)
    logging.config.dictConfig(config)
    if file is not None and _vllm_takes_a_config():
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(_write_config(config, file.parent, level))
    return file


def _vllm_takes_a_config() -> bool:
    """Unless the user configured vLLM's logging themselves."""
    told = "VLLM_LOGGING_CONFIG_PATH" in os.environ
    return not told and os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0"


def _write_config(config: dict[str, Any], folder: Path, level: str) -> Path:
    """Atomically: processes of one stack write the same file at the same time."""
    path = folder / f"logging-{level.lower()}.json"
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(config, indent=1), encoding="utf-8")
    temporary.replace(path)
    return path
