#!/usr/bin/env bash
# Lint, type-check, build the docs (strict) and run the whole test suite (unit, contract,
# end-to-end).
# Starts a Redis for the tests when none answers at 127.0.0.1:6379.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin

"$BIN/python" scripts/ensure_services.py

echo "== ruff"
"$BIN/ruff" check .
"$BIN/ruff" format --check .
echo "== mypy (strict)"
"$BIN/mypy"
echo "== docs"
NO_MKDOCS_2_WARNING=1 "$BIN/mkdocs" build --strict -q -d "$(mktemp -d)"
echo "== pytest"
"$BIN/python" -m pytest "$@"
