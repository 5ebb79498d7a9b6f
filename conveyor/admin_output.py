"""What ``conveyor keys`` and ``conveyor usage`` print (tables for people; --json elsewhere)."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Any

from gateway.control.key_service import KeyService
from gateway.control.records import KeyRecord


def print_key(record: KeyRecord, now: datetime) -> None:
    view = record.to_json(now)
    width = max(len(name) for name in view)
    for name, value in view.items():
        if name != "object":
            shown = ",".join(value) if isinstance(value, list) else value
            print(f"{name:<{width}}  {'-' if shown is None else shown}")


def print_key_table(records: list[KeyRecord], now: datetime) -> None:
    rows = [("ID", "NAME", "KEY", "SCOPES", "STATUS", "RPM", "TPM", "CREATED")]
    for record in records:
        limits = record.limits
        rows.append(
            (
                record.id,
                record.name,
                record.masked_key,
                ",".join(sorted(record.scopes)),
                record.status(now),
                _dash(limits.rpm),
                _dash(limits.tpm),
                record.created_at.strftime("%Y-%m-%d %H:%M"),
            )
        )
    _print_table(rows)


def print_usage(report: dict[str, Any]) -> None:
    columns = [
        "requests",
        "prompt_tokens",
        "completion_tokens",
        "cached_prompt_tokens",
        "total_tokens",
    ]
    if "group_by" in report:
        head = [report["group_by"].upper(), *(c.upper() for c in columns)]
        rows = [
            [_dash(item[report["group_by"]]), *(str(item[c]) for c in columns)]
            for item in report["data"]
        ]
    else:
        head = ["REQUEST", "KEY", "MODEL", "PROMPT", "COMPLETION", "STATUS", "RECEIVED"]
        rows = [
            [
                item["request_id"],
                _dash(item["key_id"]),
                item["model"],
                str(item["prompt_tokens"]),
                str(item["completion_tokens"]),
                item["status"],
                item["received_at"],
            ]
            for item in report["data"]
        ]
    _print_table([head, *rows])
    total = report["total"]
    print("total: " + ", ".join(f"{c} {total[c]}" for c in columns))


def _print_table(rows: list[Any]) -> None:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(
                f"{cell!s:<{width}}" for cell, width in zip(row, widths, strict=True)
            ).rstrip()
        )


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def warn_unannounced(service: KeyService) -> None:
    if service.notify_error is not None:
        print(
            f"warning: could not tell the gateways through Redis ({service.notify_error}); "
            "they pick the change up within 30 s",
            file=sys.stderr,
        )
