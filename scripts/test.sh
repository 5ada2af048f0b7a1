#!/usr/bin/env bash
# Creates .venv if missing, installs llm-serving with its test extra, runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -m ruff check .
exec .venv/bin/python -m pytest -q "$@"
