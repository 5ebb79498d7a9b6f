"""MkDocs hook: the Configuration page, generated at build time from shared/settings.py.

Walks the settings the way the `conveyor` command does (``SETTING_GROUPS``, each
group's own fields) and takes every flag from the command's real argument parser, so
the page lists exactly what ``conveyor up --help`` accepts. Nothing is committed: the
page exists only in the build (``on_files``).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
PAGE = "configuration.md"

INTRO = """\
# Configuration

Every setting is a command-line flag and a `CONVEYOR_*` environment variable; the
flag wins. `conveyor up --help` prints the same list. For `docker compose`, copy
`.env.example` (generated from the same settings) to `.env` and uncomment what you
change.

Each process reads only its group: every process reads the common settings, the
gateway and the workers the image settings, and so on. The page is generated from
`shared/settings.py` when the docs are built.
"""


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, PAGE, content=render()))
    return files


def render() -> str:
    """The page's Markdown: one table per settings group."""
    _checkout_first()
    from shared.settings import SETTING_GROUPS, Settings, own_fields

    flags = setting_flags()
    parts = [INTRO]
    for title, group in SETTING_GROUPS:
        parts.append(f"\n## {title.capitalize()} settings\n\n{_doc(group)}\n\n")
        parts.append("| environment variable | flag | default | meaning |\n|---|---|---|---|\n")
        for name in own_fields(group):
            info = Settings.model_fields[name]
            env = f"CONVEYOR_{name.upper()}"
            cells = (f"`{env}`", f"`{flags[name]}`", _default(info.default), info.description)
            parts.append("| " + " | ".join(_cell(cell) for cell in cells) + " |\n")
    return "".join(parts)


def setting_flags() -> dict[str, str]:
    """Setting name -> its flag, read from `conveyor up`'s argument parser."""
    _checkout_first()
    from conveyor.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    up = commands.choices["up"]
    flagged = (action for action in up._actions if action.option_strings)
    return {action.dest: action.option_strings[0] for action in flagged}


def _checkout_first() -> None:
    """Read this checkout's code, not an installed copy of the package."""
    root = str(ROOT)
    if sys.path[:1] != [root]:
        sys.path.insert(0, root)


def _doc(group: type) -> str:
    return " ".join(inspect.cleandoc(group.__doc__ or "").split())


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    text = str(getattr(value, "value", value))
    return f"`{text}`" if text else "empty"


def _cell(text: str | None) -> str:
    """One table cell: one line, pipes escaped, `<...>` outside code spans kept as text."""
    pieces = " ".join((text or "").split()).replace("|", "\\|").split("`")
    for i in range(0, len(pieces), 2):  # even pieces lie outside code spans
        pieces[i] = pieces[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(pieces)
