#!/usr/bin/env bash
# Creates .venv and installs ember with its test tools. torch is pinned first: an unpinned
# torch would pull a multi-GB CUDA build, the pinned one is a CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -c scripts/constraints.txt -e '.[test]'
