#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
.venv/bin/python -m ruff check ember tests benchmarks
.venv/bin/python -m pytest -q "$@"
